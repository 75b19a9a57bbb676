#!/usr/bin/env bash
# The whole test suite (what CI runs): installs what it needs, checks the import rules and that
# no name is undefined or imported unused (ruff's pyflakes rules), then pytest on 2 workers.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
.venv/bin/lint-imports            # the layers and import rules of spec/FORMAT.md "Architecture"
.venv/bin/ruff check --quiet --select F ckptfmt tests benchmarks examples
exec .venv/bin/python -m pytest -n 2 --dist loadgroup --durations=15 tests "$@"
