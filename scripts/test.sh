#!/usr/bin/env bash
# The whole test suite (what CI runs): installs what it needs, then pytest on 2 workers.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
exec .venv/bin/python -m pytest -n 2 --dist loadgroup tests "$@"
