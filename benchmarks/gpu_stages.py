"""The correctness stages of benchmarks/gpu_check.py that run in one process: the environment,
20 saves from GPU memory each checked against an independent hash, and an async save.

"Independent": the expected digest is blake3 over the bytes of ``tensor.cpu()`` laid out as
the seed file (header, weights, m, v), computed here with the blake3 library directly, not by
the writer that streamed the file through its pinned staging buffers; every region of the file
is also compared byte for byte with ``tensor.cpu()``. A save that copied a stale staging buffer,
skipped a piece or hashed something other than what it wrote fails one of the three checks.
"""
from __future__ import annotations

import json
import mmap
import os
import platform
import struct
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import blake3
import numpy as np
import torch

from gpu_stage import Context

SAVES, DRY_SAVES = 20, 5


def build(ctx: Context, seed: int = 0) -> tuple[torch.nn.Module, torch.optim.Optimizer, str]:
    """The reference model (andrea-120m; tiny in the dry run) on the stage's device, with an
    AdamW state (one step on fixed random gradients, which stay for further steps)."""
    from ckptfmt.trainer.config import CONFIGS
    from ckptfmt.trainer.model import GPT
    cfg = CONFIGS["tiny" if ctx.dry_run else "andrea-120m"]
    torch.manual_seed(seed)
    with torch.device(ctx.device):
        model = GPT(cfg)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    gen = torch.Generator(device=ctx.device).manual_seed(seed)
    for p in model.parameters():
        p.grad = torch.randn(p.shape, generator=gen, device=ctx.device) * 1e-3
    opt.step()
    return model, opt, cfg.name


def regions(model: torch.nn.Module, opt: torch.optim.Optimizer) -> dict[str, list[torch.Tensor]]:
    """weights, m, v in the file's order, read from the optimizer itself (not the library)."""
    params = list(model.parameters())
    return {"weights": params, "m": [opt.state[p]["exp_avg"] for p in params],
            "v": [opt.state[p]["exp_avg_sq"] for p in params]}


def sync(ctx: Context) -> None:
    if ctx.device == "cuda":
        torch.cuda.synchronize()


def independent_check(path: Path, step: int, tensors: dict[str, list[torch.Tensor]]) -> dict[str, Any]:
    """The file against ``tensor.cpu()``: the digest of the expected bytes vs the manifest's,
    the file's own digest vs that, and the bytes themselves, region by region."""
    n = sum(t.numel() for t in tensors["weights"])
    recorded = json.loads(path.with_suffix(".json").read_text())["blake3"]
    header = struct.pack("<ii", step, n)
    expected = blake3.blake3(max_threads=blake3.blake3.AUTO)
    expected.update(header)
    mismatch = None
    with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as mm:
        data = np.frombuffer(mm, dtype=np.uint8)
        if data.size != len(header) + 12 * n or bytes(data[:8]) != header:
            mismatch = f"size {data.size} or header differs"
        offset = len(header)
        for region, group in tensors.items():
            for t in group:
                host = t.detach().cpu().reshape(-1).numpy().view(np.uint8)
                expected.update(host)
                if mismatch is None and not np.array_equal(data[offset:offset + host.size], host):
                    mismatch = f"{region}: bytes {offset}..{offset + host.size}"
                offset += host.size
        on_disk = blake3.blake3(data, max_threads=blake3.blake3.AUTO).hexdigest()
        del data
    digest = expected.hexdigest()
    return {"digest_matches_manifest": digest == recorded, "file_matches_digest": on_disk == digest,
            "bytes_match": mismatch is None, "first_mismatch": mismatch}


def _matched(check: dict[str, Any]) -> bool:
    return check["digest_matches_manifest"] and check["file_matches_digest"] and check["bytes_match"]


# ---------------------------------------------------------------- environment
def _versions() -> dict[str, str | None]:
    from importlib.metadata import PackageNotFoundError, version
    out: dict[str, str | None] = {}
    for name in ("numpy", "blake3", "zstandard", "safetensors", "click"):
        try:
            out[name] = version(name)
        except PackageNotFoundError:
            out[name] = None
    return out


def _driver() -> str | None:
    try:
        proc = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                              capture_output=True, text=True, timeout=15)
        return proc.stdout.strip() or None
    except (OSError, subprocess.TimeoutExpired):
        return None


def _filesystem(folder: Path) -> dict[str, Any]:
    """The scratch folder's mount (longest matching mount point) and free space."""
    best = ("?", "?")
    try:
        for line in Path("/proc/mounts").read_text().splitlines():
            _, point, kind = line.split()[:3]
            if str(folder.resolve()).startswith(point) and len(point) >= len(best[0]):
                best = (point, kind)
    except OSError:
        pass
    st = os.statvfs(folder)
    return {"folder": str(folder), "mount": best[0], "type": best[1], "free_gb": round(st.f_bavail * st.f_frsize / 1e9, 1)}


def _sdpa(device: str) -> dict[str, Any]:
    """Which attention kernels run a bf16 causal attention shaped like andrea-12m's, forward and
    backward, and which are enabled (the trainer pins the math kernel: determinism.py)."""
    from torch.nn.attention import SDPBackend, sdpa_kernel
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    q = torch.randn(4, 6, 512, 64, device=device, dtype=dtype, requires_grad=True)
    runs: dict[str, str] = {}
    for backend in (SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.CUDNN_ATTENTION,
                    SDPBackend.MATH):
        try:
            with sdpa_kernel([backend]):
                torch.nn.functional.scaled_dot_product_attention(q, q, q, is_causal=True).sum().backward()
            runs[backend.name] = "runs"
        except RuntimeError as exc:
            runs[backend.name] = "unavailable: " + (str(exc).strip().splitlines() or ["?"])[0][:160]
    b = torch.backends.cuda
    enabled = {"flash": b.flash_sdp_enabled(), "mem_efficient": b.mem_efficient_sdp_enabled(),
               "math": b.math_sdp_enabled(), "cudnn": getattr(b, "cudnn_sdp_enabled", lambda: None)()}
    return {"dtype": str(dtype), "kernels": runs, "enabled_by_default": enabled}


def environment(ctx: Context) -> None:
    """What the machine is, recorded first: every later figure is read against it."""
    cuda = torch.cuda.is_available()
    ctx.record(python=platform.python_version(), executable=sys.executable, platform=platform.platform(),
               cpus=os.cpu_count(), torch=torch.__version__, cuda=torch.version.cuda,
               cudnn=torch.backends.cudnn.version() if torch.backends.cudnn.is_available() else None,
               packages=_versions(), filesystem=_filesystem(ctx.folder), cuda_available=cuda)
    if cuda:
        props = torch.cuda.get_device_properties(0)
        ctx.record(gpu={"name": props.name, "capability": f"{props.major}.{props.minor}",
                        "memory_gib": round(props.total_memory / 2 ** 30, 1),
                        "multiprocessors": props.multi_processor_count}, driver=_driver())
    ctx.record(sdpa=_sdpa(ctx.device))
    from ckptfmt.trainer import determinism
    kernels = determinism.apply(torch.device(ctx.device))
    ok = (cuda or ctx.dry_run) and kernels["sdpa"] == "math" and kernels["deterministic"]
    gpu = ctx.found.get("gpu", {}).get("name", "no GPU (dry run)")
    ctx.finish("passed" if ok else "failed", trainer_kernels=kernels,
               line=f"{gpu}, torch {torch.__version__}, CUDA {torch.version.cuda}, {os.cpu_count()} CPUs")


# ---------------------------------------------------------------- saves
def save_digests(ctx: Context) -> None:
    """Saves of the model + AdamW from device memory, an optimizer step between them so each
    file holds new values; every one checked independently (module docstring)."""
    import ckptfmt.torch as ct
    model, opt, config = build(ctx)
    tensors = regions(model, opt)
    n = sum(p.numel() for p in tensors["weights"])
    planned = DRY_SAVES if ctx.dry_run else SAVES
    ctx.record(model=config, n_params=n, bytes=8 + 12 * n, saves_planned=planned, saves=[])
    done: list[dict[str, Any]] = []
    previous: Path | None = None
    for step in range(1, planned + 1):
        ctx.check_time(f"save {step}")
        opt.step()
        sync(ctx)
        path = ctx.folder / f"step_{step:06d}.bin"
        started = time.perf_counter()
        ct.save(str(path), model, opt, step)
        seconds = time.perf_counter() - started
        done.append({"step": step, "save_s": round(seconds, 3), **independent_check(path, step, tensors)})
        ctx.record(saves=done)
        if previous is not None:                 # one file at a time on the machine's disk
            previous.unlink()
            previous.with_suffix(".json").unlink()
        previous = path
    bad = [d["step"] for d in done if not _matched(d)]
    ctx.finish("failed" if bad else "passed", mismatched_steps=bad,
               line=f"{len(done) - len(bad)} of {len(done)} saves of {n:,} parameters matched")


def async_save(ctx: Context) -> None:
    """The manager's async save from device memory; the loop adds 1 to every tensor as soon as
    ``save`` returns. The committed file must hold the values at the save, not after."""
    from ckptfmt.torch import CheckpointManager
    model, opt, config = build(ctx)
    tensors = regions(model, opt)
    at_save = {name: [t.detach().cpu().clone() for t in group] for name, group in tensors.items()}
    run = ctx.folder / "run"
    mgr = CheckpointManager(run, model, opt, every=None, keep_last=2, async_save=True, handle_signals=False)
    try:
        started = time.perf_counter()
        mgr.save(1, "gpu_check")
        stall = mgr.stall_s
        with torch.no_grad():
            for group in tensors.values():
                for t in group:
                    t.add_(1.0)
        sync(ctx)
        pending = not (run / "step_000001.json").exists()
        mgr.wait()
        commit_s = time.perf_counter() - started
    finally:
        mgr.close()
    check = independent_check(run / "step_000001.bin", 1, at_save)
    ctx.finish("passed" if _matched(check) else "failed", model=config, stall_ms=round(stall * 1e3, 2),
               commit_s=round(commit_s, 3), changed_while_pending=pending, **check,
               line=f"stall {stall * 1e3:.1f} ms, committed after {commit_s:.2f} s, "
                    f"file {'holds' if _matched(check) else 'does NOT hold'} the values at the save")


STAGES = {"environment": environment, "save_digests": save_digests, "async_save": async_save}
