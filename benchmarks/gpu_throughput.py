"""The throughput stages of benchmarks/gpu_check.py, last in priority: the machine's limits, saves
from GPU memory and loads to GPU memory of the 120M model + AdamW (tiny in the dry run).

A save from GPU memory pipelines three things: the copy to pinned host buffers, blake3 and
write + fsync, so its floor is the slowest of the three, each measured here on the same bytes;
the report (gpu_report.summarize) compares the save with that floor and with write + fsync, not
with the D2H copy alone. Every peer is durable the same way (temp, fsync, rename, directory
fsync: common.durable). Contenders alternate within each repetition; figures are medians, in GB
of checkpoint payload (8 + 12n bytes) per second. Cold loads need the file's pages evicted
(posix_fadvise DONTNEED, checked with mincore): where the kernel ignores that, the stage says so
instead of printing a cold figure that is really warm.
"""
from __future__ import annotations

import ctypes
import mmap
import os
import statistics
import time
from pathlib import Path
from typing import Any, Callable

import blake3
import numpy as np
import torch

from common import drop_cache, durable
from gpu_stage import Context
from gpu_stages import build, regions, sync

REPS, DRY_REPS = 3, 1


def reps(ctx: Context) -> int:
    return DRY_REPS if ctx.dry_run else REPS


def timed(ctx: Context, fn: Callable[[], Any]) -> float:
    """Seconds of one call, the device idle before and after."""
    sync(ctx)
    started = time.perf_counter()
    fn()
    sync(ctx)
    return time.perf_counter() - started


def gbps(nbytes: int, samples: dict[str, list[float]]) -> dict[str, float]:
    return {k: round(nbytes / statistics.median(v) / 1e9, 3) for k, v in samples.items() if v}


def resident_fraction(path: Path) -> float | None:
    """Share of the file's pages in the page cache (mincore on a mapping), None if unknown."""
    size = path.stat().st_size
    pages = (size + mmap.PAGESIZE - 1) // mmap.PAGESIZE
    libc = ctypes.CDLL(None, use_errno=True)
    vec = (ctypes.c_ubyte * pages)()
    with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as mm:
        view = np.frombuffer(mm, dtype=np.uint8)
        rc = libc.mincore(ctypes.c_void_p(view.ctypes.data), ctypes.c_size_t(size), vec)
        del view
    return None if rc != 0 else round(float((np.frombuffer(vec, dtype=np.uint8) & 1).mean()), 4)


def eviction(path: Path) -> dict[str, Any]:
    """Does posix_fadvise(DONTNEED) empty the page cache of a file on this kernel?"""
    before = resident_fraction(path)
    drop_cache(str(path))
    after = resident_fraction(path)
    works = after is not None and after < 0.05
    return {"resident_before": before, "resident_after": after, "works": works}


def _param_count(ctx: Context) -> int:
    from ckptfmt.trainer.config import CONFIGS
    from ckptfmt.trainer.model import GPT
    with torch.device("meta"):
        model = GPT(CONFIGS["tiny" if ctx.dry_run else "andrea-120m"])
    return sum(p.numel() for p in model.parameters())


def _write(data: np.ndarray) -> Callable[[str], None]:
    def write(path: str) -> None:
        with open(path, "wb") as f:
            f.write(memoryview(data))
    return write


def throughput_limits(ctx: Context) -> None:
    """Pinned D2H / H2D, blake3 on one core and on all, durable write + fsync, page eviction."""
    n = _param_count(ctx)
    nbytes, samples, skipped = 12 * n, {}, {}
    host = torch.empty(3 * n, dtype=torch.float32, pin_memory=ctx.device == "cuda")
    if ctx.device == "cuda":
        dev = torch.empty(3 * n, dtype=torch.float32, device="cuda").normal_()
        samples["d2h_pinned"] = [timed(ctx, lambda: host.copy_(dev)) for _ in range(reps(ctx))]
        samples["h2d_pinned"] = [timed(ctx, lambda: dev.copy_(host)) for _ in range(reps(ctx))]
        del dev
    else:
        host.normal_()
        skipped = {"d2h_pinned": "needs CUDA", "h2d_pinned": "needs CUDA"}
    ctx.record(n_params=n, bytes=nbytes, gbps=gbps(nbytes, samples), skipped=skipped)
    data = host.numpy().view(np.uint8)
    threads = os.cpu_count() or 1
    samples["blake3_1_thread"] = [timed(ctx, lambda: blake3.blake3(data, max_threads=1).digest()) for _ in range(reps(ctx))]
    samples["blake3_all_cores"] = [timed(ctx, lambda: blake3.blake3(data, max_threads=threads).digest())
                                   for _ in range(reps(ctx))]
    ctx.record(gbps=gbps(nbytes, samples), blake3_threads=threads)
    target = ctx.folder / "write.bin"
    samples["write_fsync"] = []
    for _ in range(reps(ctx)):
        target.unlink(missing_ok=True)
        samples["write_fsync"].append(timed(ctx, lambda: durable(_write(data), str(target))))
    ctx.record(gbps=gbps(nbytes, samples))
    evicted = eviction(target)
    target.unlink()
    ctx.finish("done", gbps=gbps(nbytes, samples), samples_s={k: [round(x, 4) for x in v] for k, v in samples.items()},
               eviction=evicted, line=", ".join(f"{k} {v} GB/s" for k, v in gbps(nbytes, samples).items())
               + f"; page eviction {'works' if evicted['works'] else 'does NOT work'}")


def _peers(ctx: Context, model: torch.nn.Module, opt: torch.optim.Optimizer) -> dict[str, Callable[[Path], Any]]:
    """Durable saves from device memory: ckptfmt, torch.save, safetensors (each into a folder)."""
    import ckptfmt.torch as ct
    from safetensors.torch import save_file
    named = {f"{r}.{i}": t for r, group in regions(model, opt).items() for i, t in enumerate(group)}
    return {"ct.save": lambda d: ct.save(str(d / "step_000001.bin"), model, opt, 1),
            "torch.save": lambda d: durable(lambda p: torch.save({"model": model.state_dict(),
                                                                   "optimizer": opt.state_dict()}, p), str(d / "model.pt")),
            "safetensors": lambda d: durable(lambda p: save_file(named, p), str(d / "model.safetensors"))}


def _stalls(ctx: Context, model: torch.nn.Module, opt: torch.optim.Optimizer, mode: str) -> dict[str, list[float]]:
    """The checkpoint manager's stall (what the trainer's loop waits) and its commit time."""
    from ckptfmt.torch import CheckpointManager
    mgr = CheckpointManager(ctx.folder / f"manager-{mode}", model, opt, every=None, keep_last=1,
                            async_save=mode == "async", handle_signals=False)
    stalls, commits = [], []
    try:
        for step in range(1, reps(ctx) + 1):
            sync(ctx)
            started = time.perf_counter()
            mgr.save(step, "gpu_check")
            stalls.append(mgr.stall_s)
            mgr.wait()
            commits.append(time.perf_counter() - started)
    finally:
        mgr.close()
    return {"stall": stalls, "commit": commits}


def throughput_save(ctx: Context) -> None:
    """ct.save from GPU memory against torch.save and safetensors from CUDA; the manager's stall."""
    import shutil
    model, opt, config = build(ctx)
    n = sum(p.numel() for p in model.parameters())
    nbytes = 8 + 12 * n
    peers, samples = _peers(ctx, model, opt), {}
    for rep in range(reps(ctx)):
        names = list(peers)[rep % len(peers):] + list(peers)[:rep % len(peers)]
        for name in names:
            ctx.check_time(f"{name}, repetition {rep + 1}")
            folder = ctx.folder / name
            folder.mkdir()
            samples.setdefault(name, []).append(timed(ctx, lambda: peers[name](folder)))
            shutil.rmtree(folder)
        ctx.record(model=config, bytes=nbytes, gbps=gbps(nbytes, samples))
    stall_ms, commit_s = {}, {}
    for mode in ("sync", "async"):
        ctx.check_time(f"the manager's {mode} saves")
        got = _stalls(ctx, model, opt, mode)
        stall_ms[mode] = round(statistics.median(got["stall"]) * 1e3, 2)
        commit_s[mode] = round(statistics.median(got["commit"]), 3)
        ctx.record(stall_ms=stall_ms, commit_s=commit_s)
    shown = gbps(nbytes, samples)
    ctx.finish("done", gbps=shown, samples_s={k: [round(x, 4) for x in v] for k, v in samples.items()},
               line=", ".join(f"{k} {v} GB/s" for k, v in shown.items())
               + f"; stall sync {stall_ms['sync']} ms, async {stall_ms['async']} ms")


def _loaders(ctx: Context, model: torch.nn.Module, opt: torch.optim.Optimizer,
             files: dict[str, Path]) -> dict[str, Callable[[], Any]]:
    """Loads into the model + AdamW on the device, from each peer's file."""
    import ckptfmt.torch as ct
    from safetensors.torch import load_file

    def torch_load() -> None:
        state = torch.load(files["torch.load"], map_location=ctx.device, weights_only=True)
        model.load_state_dict(state["model"])
        opt.load_state_dict(state["optimizer"])

    def safetensors_load() -> None:
        loaded = load_file(str(files["safetensors"]), device=ctx.device)
        with torch.no_grad():
            for r, group in regions(model, opt).items():
                for i, t in enumerate(group):
                    t.copy_(loaded[f"{r}.{i}"])

    return {"ct.load verify": lambda: ct.load(str(files["ct.load verify"]), model, opt, verify=True).close(),
            "ct.load no verify": lambda: ct.load(str(files["ct.load verify"]), model, opt, verify=False).close(),
            "torch.load": torch_load, "safetensors": safetensors_load}


def _write_files(ctx: Context, model: torch.nn.Module, opt: torch.optim.Optimizer) -> dict[str, Path]:
    peers = _peers(ctx, model, opt)
    for name in peers:
        peers[name](ctx.folder)
    ckpt = ctx.folder / "step_000001.bin"
    return {"ct.load verify": ckpt, "ct.load no verify": ckpt, "torch.load": ctx.folder / "model.pt",
            "safetensors": ctx.folder / "model.safetensors"}


def throughput_load(ctx: Context) -> None:
    """ct.load to GPU memory, warm and cold, with and without verify, against torch.load and
    safetensors to CUDA."""
    model, opt, config = build(ctx)
    nbytes = 8 + 12 * sum(p.numel() for p in model.parameters())
    files = _write_files(ctx, model, opt)
    loaders = _loaders(ctx, model, opt, files)
    evicted = eviction(files["ct.load verify"])
    ctx.record(model=config, bytes=nbytes, eviction=evicted)
    for fn in loaders.values():          # warm-up: every file in the page cache, every path compiled
        fn()
    warm: dict[str, list[float]] = {}
    cold: dict[str, list[float]] = {}
    for rep in range(reps(ctx)):
        names = list(loaders)[rep % len(loaders):] + list(loaders)[:rep % len(loaders)]
        for name in names:
            ctx.check_time(f"{name}, repetition {rep + 1}")
            warm.setdefault(name, []).append(timed(ctx, loaders[name]))
            if evicted["works"]:
                drop_cache(str(files[name]))
                cold.setdefault(name, []).append(timed(ctx, loaders[name]))
        ctx.record(warm_gbps=gbps(nbytes, warm), cold_gbps=gbps(nbytes, cold) if evicted["works"] else None)
    note = None if evicted["works"] else (f"not measured: page eviction does not work here (posix_fadvise DONTNEED "
                                          f"left {evicted['resident_after']} of the file's pages resident)")
    shown = gbps(nbytes, warm)
    ctx.finish("done", cold_note=note, line="warm: " + ", ".join(f"{k} {v} GB/s" for k, v in shown.items())
               + (f"; cold: {note}" if note else "; cold: " + ", ".join(f"{k} {v} GB/s"
                                                                        for k, v in gbps(nbytes, cold).items())))


STAGES = {"throughput_limits": throughput_limits, "throughput_save": throughput_save,
          "throughput_load": throughput_load}
