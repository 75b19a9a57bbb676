#!/usr/bin/env bash
# The one command for the lent GPU machine (benchmarks/README.md "GPU"):
#
#     bash benchmarks/gpu_check.sh [gpu_check.py options]
#
# The image's python3 has torch but not blake3 or zstandard, and nothing can be fetched there:
# their cp312 wheels travel in .whl/ (downloaded beforehand with the command in
# benchmarks/README.md) and are installed into /tmp/site unless they import already. The wheels
# and this checkout go on PYTHONPATH (no venv, no registry), and the check runs under a total
# timeout with its output copied to $OUT/gpu_check.out. The check's own --deadline (480 s) ends
# it first; GPU_CHECK_TIMEOUT (560 s) is the last resort, below the device tool's 600 s.
set -u
cd "$(dirname "$0")/.."
PY="${PYTHON:-python3}"
if ! "$PY" -c "import blake3, zstandard" 2>/dev/null; then
    if ! ls .whl/*.whl >/dev/null 2>&1; then
        echo "gpu_check.sh: blake3 or zstandard missing and no wheels in .whl/ (benchmarks/README.md \"GPU\")" >&2
        exit 2
    fi
    "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
        || { echo "gpu_check.sh: $PY could not install the wheels in .whl/" >&2; exit 2; }
    export PYTHONPATH="/tmp/site${PYTHONPATH:+:$PYTHONPATH}"
fi
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
export OUT="${OUT:-$PWD/benchmarks/results/gpu_check}"
mkdir -p "$OUT"
set -o pipefail
timeout -k 5 "${GPU_CHECK_TIMEOUT:-560}" "$PY" benchmarks/gpu_check.py --out "$OUT" "$@" 2>&1 | tee "$OUT/gpu_check.out"
