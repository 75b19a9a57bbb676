#!/usr/bin/env bash
# The long tier, run by hand, not in CI: the reliability suite at its large counts
# (RELIABILITY_SCALE=long: 1,000 SIGKILLs at 150 MB, 2,000 power cuts, 10^6 bit flips, 1,000
# SIGUSR1, 100 kill/resume cycles, 20,000 bit flips in each kind of manifest, the fault matrix
# (236 cases: every tier x part x fault, flips and truncations at 8 offsets), the fuzz corpus with
# its mutations) and the full interruption sweeps of the manager (13 points per
# signal) and of the manager under torchrun, which CI checks at one point per phase; 1,000
# SIGKILLs of a two-rank torchrun job on object storage (a torchrun launch each: 27 s a kill on 2
# shared cores, about 7 hours; RELIABILITY_RANK_KILLS=N runs N instead); and beside
# them 10 minutes of coverage-guided fuzzing whose minimised corpus replaces fuzz/corpus. Figures go to spec/RELIABILITY.md with date and command.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
.venv/bin/python -c "import atheris" 2>/dev/null || .venv/bin/pip install -q atheris
rm -rf fuzz/new fuzz/min && mkdir -p fuzz/new fuzz/min
.venv/bin/python fuzz/target.py fuzz/new fuzz/corpus -max_total_time="${FUZZ_SECONDS:-600}" \
    -print_final_stats=1 > fuzz/last-run.log 2>&1 &
fuzz=$!
set +o pipefail     # a failing test must not skip the corpus merge below; the summary says it
RELIABILITY_SCALE=long .venv/bin/python -m pytest -q -s -p no:warnings --timeout 0 tests/reliability tests/format/test_seal.py tests/manager/test_manager.py tests/distributed/test_manager_ddp.py "$@" \
    | tee /tmp/long-tier.log | grep -E "FIGURE|crash states|passed|failed"
wait "$fuzz" || { echo "fuzzing found a crash: see fuzz/last-run.log"; exit 1; }
# libFuzzer's merge re-executes fuzz/target.py: its shebang must find the venv's python first
PATH="$PWD/.venv/bin:$PATH" fuzz/target.py -merge=1 fuzz/min fuzz/corpus fuzz/new >> fuzz/last-run.log 2>&1
if [ "$(ls fuzz/min | wc -l)" -ge "$(ls fuzz/corpus | wc -l)" ]; then
  rm -rf fuzz/corpus fuzz/new && mv fuzz/min fuzz/corpus
else
  echo "merge produced fewer files than the old corpus; keeping fuzz/corpus and fuzz/new"; exit 1
fi
grep -E "stat::|Done" fuzz/last-run.log | tail -4
echo "long tier done: $(ls fuzz/corpus | wc -l) corpus files; commit fuzz/corpus and the figures"
