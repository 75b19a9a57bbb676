#!/usr/bin/env bash
# The main job: train the reference model (tiny) on the CPU with checkpoints, interrupt it with
# SIGTERM mid-run, checkpoint-and-continue with SIGUSR1, resume, and prove with inspect,
# validate, diff and bisect that the interrupted run is bit-identical to a straight one.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
ck=.venv/bin/ckptfmt
STEPS=${STEPS:-400}
rm -rf runs/straight runs/demo runs/demo.png
mkdir -p runs
say() { printf '\n== %s\n' "$*"; }
wait_for_step() {  # wait until .loss.json of run $1 has a record of step >= $2
  until .venv/bin/python - "$1" "$2" <<'PY' 2>/dev/null
import json, sys
steps = [json.loads(l).get("step", 0) for l in open(sys.argv[1] + "/.loss.json") if '"loss"' in l]
sys.exit(0 if steps and max(steps) >= int(sys.argv[2]) else 1)
PY
  do sleep 0.2; done
}

say "1. straight run: tiny config to step $STEPS, a checkpoint every 100 steps"
$ck train --run runs/straight --config tiny --steps "$STEPS" --checkpoint-every 100 --log-every 100

say "2. the same run, stopped by SIGTERM at an arbitrary step"
$ck train --run runs/demo --config tiny --steps "$STEPS" --checkpoint-every 100 --log-every 100 &
pid=$!
wait_for_step runs/demo 137
kill -TERM "$pid"
wait "$pid" && echo "trainer exited 0 after SIGTERM"

say "3. resume; SIGUSR1 asks for a checkpoint and training goes on"
$ck train --run runs/demo --config tiny --steps "$STEPS" --checkpoint-every 100 --log-every 100 &
pid=$!
wait_for_step runs/demo 250
kill -USR1 "$pid"
wait "$pid"

say "4. ls and inspect"
$ck ls runs/demo
$ck inspect "runs/demo/step_$(printf %06d "$STEPS").bin"

say "5. validate the whole run (every generation, history, sidecars)"
$ck validate runs/demo

say "6. diff against the straight run: must be bit-identical (exit 0)"
$ck diff "runs/straight/step_$(printf %06d "$STEPS").bin" "runs/demo/step_$(printf %06d "$STEPS").bin"
$ck bisect runs/straight runs/demo

say "7. the loss history with its resume marked"
$ck plot runs/straight runs/demo --out runs/demo.png
echo "main job done: runs/demo is bit-identical to runs/straight after SIGTERM + resume + SIGUSR1"
