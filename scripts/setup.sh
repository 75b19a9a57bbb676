#!/usr/bin/env bash
# Create .venv and install ckptfmt with its torch, test, plot, remote, lightning, hf, data and docs extras (the
# tests start a local S3 server: moto[server], in the test extra). torch==2.13.0 goes
# first: it is the CPU build that lies on this disk; a bare "torch" would pull a CUDA build
# (pytorch-lightning asks only for torch>=2.1 and torchdata for torch>=2, so pip keeps the one installed).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
# System tools the tests run as a user would (zstd -d, b3sum --check): Debian packages.
need=""
for tool in zstd b3sum; do command -v "$tool" >/dev/null || need="$need $tool"; done
if [ -n "$need" ]; then
  if [ "$(id -u)" = 0 ]; then SUDO=""; elif command -v sudo >/dev/null; then SUDO="sudo -n"; else SUDO="false"; fi
  { $SUDO apt-get update -qq && $SUDO apt-get install -y -qq $need; } >/dev/null 2>&1 \
    || { echo "setup: could not install$need (apt-get as root); install them and rerun" >&2; exit 2; }
fi
[ -x .venv/bin/python ] || "$PY" -m venv .venv
stamp=.venv/.ckptfmt-installed
want=$(cat pyproject.toml scripts/setup.sh | sha256sum | cut -c1-16)
if [ "$(cat "$stamp" 2>/dev/null)" != "$want" ]; then
  .venv/bin/python -c "import torch" 2>/dev/null || .venv/bin/pip install -q --disable-pip-version-check torch==2.13.0
  # The rest through uv when the registry has it (seconds against pip's 92 s on a cold cache);
  # it keeps the torch installed above. Byte-compiled at install: with PYTHONDONTWRITEBYTECODE
  # set (as on this project's machines) nothing else ever writes the .pyc files, and every test
  # process would compile transformers and Lightning again. pip when uv cannot be had.
  extras=".[torch,test,plot,remote,lightning,hf,data,docs]"
  if .venv/bin/pip install -q --disable-pip-version-check uv 2>/dev/null; then
    .venv/bin/uv pip install -q --compile-bytecode --python .venv/bin/python -e "$extras"
  else
    .venv/bin/pip install -q --disable-pip-version-check -e "$extras"
  fi
  echo "$want" > "$stamp"
fi
