"""The checkpoint manager on a CUDA device: a loop whose dropout draws from the CUDA RNG, with a
torch generator on the device, async saves and bf16 parameters, resumed in a fresh process,
must end bit-identical to a straight run; resumed without its RNGs it must not (the negative
control). ``--device cpu`` runs the same check on the CPU (the CPU path is also covered in CI by
tests/manager/test_manager.py's SIGTERM/SIGKILL resumes of examples/plain_loop.py).

    python -m benchmarks cuda-manager --device cuda --out benchmarks/results/cuda_manager.jsonl
    python benchmarks/cuda_manager_check.py --device cpu --steps 12      # the CPU twin

Each variant: straight to --steps; the same to --steps/2, then a fresh process resumes to
--steps; again with ``restore(restore_rng=False)``. Exit 0 when every variant resumes exactly
and every negative control diverges.
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

VARIANTS = {"float32-async": {"dtype": "float32", "async_save": True},
            "bfloat16-sync": {"dtype": "bfloat16", "async_save": False}}


def worker(run: str, device: str, steps: int, dtype: str, async_save: bool, restore_rng: bool) -> None:
    """One process of the loop: restore, train to ``steps``, close."""
    import os
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")    # deterministic cuBLAS
    import numpy as np
    import torch
    torch.use_deterministic_algorithms(True)

    from ckptfmt.torch import CheckpointManager
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.ReLU(), torch.nn.Dropout(0.2),
                                torch.nn.Linear(256, 1)).to(device, getattr(torch, dtype))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    noise = torch.Generator(device=device).manual_seed(7)
    data = np.random.default_rng(3)
    mgr = CheckpointManager(run, model, opt, generators={"noise": noise, "data": data},
                            every=5, keep_last=2, async_save=async_save, handle_signals=False)
    start = mgr.restore(restore_rng=restore_rng)
    for step in range(start + 1, steps + 1):
        x = torch.from_numpy(data.standard_normal((32, 64)).astype("float32")).to(device, model[0].weight.dtype)
        y = torch.randn(32, 1, generator=noise, device=device, dtype=x.dtype)
        loss = torch.nn.functional.mse_loss(model(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        mgr.step(step, loss=loss.float().item())
    mgr.close(steps)


def launch(run: Path, device: str, steps: int, variant: dict, restore_rng: bool = True) -> None:
    args = [sys.executable, __file__, "--worker", str(run), "--device", device, "--steps", str(steps),
            "--dtype", variant["dtype"]] + (["--async-save"] if variant["async_save"] else []) \
        + ([] if restore_rng else ["--omit-rng-restore"])
    proc = subprocess.run(args, capture_output=True, text=True)
    if proc.returncode:
        raise SystemExit(f"{run}: worker failed ({proc.returncode}): {proc.stderr[-2000:]}")


def check(device: str, steps: int, root: Path) -> dict:
    """Each variant's verdict: straight vs resumed vs resumed without RNGs."""
    import ckptfmt
    out = {}
    for name, variant in VARIANTS.items():
        started = time.perf_counter()
        runs = {k: root / f"{name}-{k}" for k in ("straight", "resumed", "no-rng")}
        launch(runs["straight"], device, steps, variant)
        for key in ("resumed", "no-rng"):
            launch(runs[key], device, steps // 2, variant)
            launch(runs[key], device, steps, variant, restore_rng=key == "resumed")
        prints = {k: ckptfmt.open(r / f"step_{steps:06d}.bin", verify=True).fingerprint() for k, r in runs.items()}
        cuda = "torch_cuda" in ckptfmt.open(runs["resumed"] / f"step_{steps:06d}.bin").manifest["rng"]
        out[name] = {"resumed_identical": prints["resumed"] == prints["straight"],
                     "negative_control_diverged": prints["no-rng"] != prints["straight"],
                     "cuda_rng_in_manifest": cuda, "seconds": round(time.perf_counter() - started, 2)}
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--out", help="write the verdict as results here (JSON lines)")
    ap.add_argument("--worker", help=argparse.SUPPRESS)
    ap.add_argument("--dtype", default="float32", help=argparse.SUPPRESS)
    ap.add_argument("--async-save", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--omit-rng-restore", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        worker(args.worker, args.device, args.steps, args.dtype, args.async_save, not args.omit_rng_restore)
        return
    with tempfile.TemporaryDirectory() as tmp:
        verdict = {"device": args.device, "steps": args.steps, "variants": check(args.device, args.steps, Path(tmp))}
    if args.device == "cuda":
        import torch
        verdict["gpu"] = torch.cuda.get_device_name(0)
        verdict["torch"] = torch.__version__
    print(json.dumps(verdict, indent=1))
    if args.out:
        from harness.record import write_results
        write_results("cuda-manager", verdict, args.out)
    ok = all(v["resumed_identical"] and v["negative_control_diverged"] for v in verdict["variants"].values())
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
