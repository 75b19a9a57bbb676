#!/usr/bin/env bash
# The whole test suite (what CI runs): installs what it needs, checks the import rules, then
# pytest on 2 workers.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
.venv/bin/lint-imports            # the layers and import rules of spec/FORMAT.md "Architecture"
exec .venv/bin/python -m pytest -n 2 --dist loadgroup tests "$@"
