"""One short script for a machine with a CUDA GPU (issue 5 item 7, issue 7 last goal).

    python benchmarks/gpu_check.py [--out benchmarks/results/gpu.json]

Checks, in fresh processes: the trainer picks CUDA, manifests hold the CUDA RNG state, a run
stopped by a real SIGTERM and resumed is byte-identical to a straight run (bf16 autocast,
deterministic settings); then measures save from GPU memory and load to GPU memory for the
120M model against the device-to-host / host-to-device copy limits measured in the same run.
Exit 0 when every check passed. No GPU: exit 2 with a one-line reason.
"""
from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

PY = sys.executable


def train_cmd(run: Path, steps: int) -> list[str]:
    return [PY, "-m", "ckptfmt.cli", "train", "--run", str(run), "--steps", str(steps), "--config", "tiny",
            "--device", "cuda", "--checkpoint-every", "40", "--sample-every", "0", "--log-every", "100000"]


def last_step(run: Path) -> int:
    try:
        return max((json.loads(x)["step"] for x in (run / ".loss.json").read_text().splitlines() if '"loss"' in x), default=0)
    except (FileNotFoundError, ValueError):
        return 0


def resume_check(d: Path) -> dict:
    import ckptfmt
    straight, cut = d / "straight", d / "cut"
    subprocess.run(train_cmd(straight, 120), check=True, capture_output=True)
    proc = subprocess.Popen(train_cmd(cut, 120), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    while last_step(cut) < 53:
        time.sleep(0.01)
    proc.send_signal(signal.SIGTERM)
    proc.wait(timeout=120)
    subprocess.run(train_cmd(cut, 120), check=True, capture_output=True)
    a = ckptfmt.open(straight / "step_000120.bin", verify=True)
    b = ckptfmt.open(cut / "step_000120.bin", verify=True)
    return {"sigterm_exit": proc.returncode, "device": a.manifest["run"]["device"], "amp": a.manifest["run"]["amp"],
            "cuda_rng_in_manifest": "torch_cuda" in a.manifest["rng"],
            "bit_identical": a.fingerprint() == b.fingerprint()}


def throughput(d: Path) -> dict:
    import ckptfmt.torch as ct
    from ckptfmt.trainer.config import CONFIGS
    from ckptfmt.trainer.model import GPT
    model = GPT(CONFIGS["andrea-120m"]).cuda()
    opt = torch.optim.AdamW(model.parameters())
    for p in model.parameters():
        opt.state[p] = {"step": torch.tensor(1.0), "exp_avg": torch.randn_like(p) * 1e-3,
                        "exp_avg_sq": torch.rand_like(p) * 1e-6}
    n = sum(p.numel() for p in model.parameters())
    nbytes = 8 + 12 * n
    host = torch.empty(3 * n, dtype=torch.float32, pin_memory=True)
    dev = torch.empty(3 * n, dtype=torch.float32, device="cuda")
    torch.cuda.synchronize()
    t = time.perf_counter(); host.copy_(dev); torch.cuda.synchronize(); d2h = time.perf_counter() - t
    t = time.perf_counter(); dev.copy_(host); torch.cuda.synchronize(); h2d = time.perf_counter() - t
    path = d / "step_000001.bin"
    t = time.perf_counter(); ct.save(str(path), model, opt, 1); save = time.perf_counter() - t
    t = time.perf_counter(); ct.load(str(path), model, opt, verify=True).close(); torch.cuda.synchronize(); load = time.perf_counter() - t
    return {"n_params": n, "bytes": nbytes, "d2h_gbps": nbytes / d2h / 1e9, "h2d_gbps": nbytes / h2d / 1e9,
            "save_from_gpu_gbps": nbytes / save / 1e9, "load_to_gpu_verified_gbps": nbytes / load / 1e9,
            "save_vs_d2h": d2h / save, "load_vs_h2d": h2d / load}


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=os.path.join(os.environ.get("OUT", "benchmarks/results"), "gpu.json"))
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print("gpu_check: no CUDA device here", file=sys.stderr)
        return 2
    d = Path(tempfile.mkdtemp())
    result = {"gpu": torch.cuda.get_device_name(0), "torch": torch.__version__, "resume": resume_check(d),
              "throughput": throughput(d)}
    ok = result["resume"]["bit_identical"] and result["resume"]["cuda_rng_in_manifest"] and result["resume"]["sigterm_exit"] == 0
    result["all_passed"] = bool(ok)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=1))
    print(json.dumps(result, indent=1))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
