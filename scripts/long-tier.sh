#!/usr/bin/env bash
# The long tier of the reliability suite (issue 8), run by hand, not in CI:
# 1,000 SIGKILLs at 150 MB, 2,000 power cuts, 10^6 bit flips, 1,000 SIGUSR1, 100 kill/resume
# cycles, then 10 minutes of coverage-guided fuzzing whose minimised corpus is committed.
# Results go to spec/RELIABILITY.md by hand, with the date and this command.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
RELIABILITY_SCALE=long .venv/bin/python -m pytest -q -p no:warnings tests/test_reliability_*.py "$@"
.venv/bin/pip install -q atheris
mkdir -p fuzz/new fuzz/min
.venv/bin/python fuzz/target.py fuzz/new fuzz/corpus -max_total_time="${FUZZ_SECONDS:-600}" -print_final_stats=1
.venv/bin/python fuzz/target.py -merge=1 fuzz/min fuzz/corpus fuzz/new
rm -rf fuzz/corpus fuzz/new && mv fuzz/min fuzz/corpus
echo "long tier done; commit fuzz/corpus and the figures in spec/RELIABILITY.md"
