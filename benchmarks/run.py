"""ckptfmt against its peers and the machine's limits, in one run.

    python -m benchmarks peers                       # 12.8M and 120M, 3 repetitions
    python -m benchmarks peers --sizes 12.8M --reps 3 --skip-train
    python -m benchmarks peers --stall-only          # the trainer's stall alone

Writes benchmarks/results/latest.jsonl (--stall-only: stall.jsonl); the tables and the plot are
rendered from it by ``python -m benchmarks render``. Contenders alternate within each
repetition; buffers are prewarmed (this VM returns idle memory to the host, and touching it
again runs at 0.5-0.9 GB/s). Scratch files go to a fresh directory under --dir (default
/work/bench, else the temp dir), removed at the end; nothing else in --dir is touched.
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Callable

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import drop_cache, durable, measure, summary, touch  # noqa: E402
from harness.record import write_results  # noqa: E402

import blake3  # noqa: E402
import torch  # noqa: E402

import ckptfmt  # noqa: E402
import ckptfmt.torch as ct  # noqa: E402
from ckptfmt import atomic  # noqa: E402
from ckptfmt import fingerprint  # noqa: E402
from ckptfmt.trainer.config import CONFIGS  # noqa: E402
from ckptfmt.trainer.model import GPT  # noqa: E402

HERE = Path(__file__).resolve().parent
SIZES = {"12.8M": "andrea-12m", "120M": "andrea-120m"}
CHUNK = 8 << 20
LIMIT_WRITER = "durable write, no hash (limit)"


# ---------------------------------------------------------------- realistic state
def build_state(config: str, seed: int = 0) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    """A model and AdamW whose values look trained: weights ~ N(0, 0.02) plus LayerNorm ones,
    m ~ N(0, 1e-3), v ~ (N(0, 1e-3))^2, step 1000 (not zeros, which compress and hash oddly)."""
    torch.manual_seed(seed)
    return trained_looking(GPT(CONFIGS[config]), seed)


def trained_looking(model: torch.nn.Module, seed: int = 0) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    """``model`` with an AdamW state, both filled with trained-looking values (see build_state)."""
    opt = torch.optim.AdamW(model.parameters(), lr=3e-4)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.02, generator=g)
            opt.state[p] = {"step": torch.tensor(1000.0),
                            "exp_avg": torch.empty_like(p).normal_(0, 1e-3, generator=g),
                            "exp_avg_sq": torch.empty_like(p).normal_(0, 1e-3, generator=g).square_()}
    return model, opt


def flat_bytes(model, opt) -> np.ndarray:
    """The exact bytes of the .bin, in memory, prewarmed (the raw-write baseline writes these)."""
    params = list(model.parameters())
    n = sum(p.numel() for p in params)
    out = touch(np.empty(8 + 12 * n, dtype=np.uint8))
    out[:8] = np.frombuffer(ckptfmt.format.pack_header(1000, n), np.uint8)
    f = out[8:].view("<f4")
    ms, vs, _ = ct.moments(model, opt)
    for k, tensors in enumerate((params, ms, vs)):
        torch.cat([t.detach().reshape(-1) for t in tensors], out=torch.from_numpy(f[k * n:(k + 1) * n]))
    return out


# ---------------------------------------------------------------- machine limits
def limits(buf: np.ndarray, d: Path, reps: int) -> dict[str, Any]:
    dst = touch(np.empty_like(buf))
    path = str(d / "limit.bin")
    out: dict[str, list] = {k: [] for k in ("memcpy", "page_cache_write", "write_fsync", "read_cached",
                                            "read_uncached", "blake3_memory", "blake3_1thread")}
    rbuf = touch(np.empty(CHUNK, dtype=np.uint8))

    def write(sync: bool) -> None:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        mv = memoryview(buf)
        for i in range(0, len(mv), CHUNK):
            os.write(fd, mv[i:i + CHUNK])
        if sync:
            os.fsync(fd)
        os.close(fd)

    def read() -> None:
        with open(path, "rb", buffering=0) as f:
            while f.readinto(rbuf):
                pass
    for _ in range(reps):
        out["memcpy"].append(measure(lambda: np.copyto(dst, buf))[0])
        out["page_cache_write"].append(measure(lambda: write(False))[0])
        os.sync()
        out["write_fsync"].append(measure(lambda: write(True))[0])
        out["read_cached"].append(measure(read)[0])
        drop_cache(path)
        out["read_uncached"].append(measure(read)[0])
        out["blake3_memory"].append(measure(lambda: blake3.blake3(buf, max_threads=blake3.blake3.AUTO).digest())[0])
        out["blake3_1thread"].append(measure(lambda: blake3.blake3(buf, max_threads=1).digest())[0])
        os.unlink(path)
    return {k: {**summary(v), "gbps": buf.nbytes / summary(v)["median"] / 1e9} for k, v in out.items()}


# ---------------------------------------------------------------- save
def state_dict_flat(model, opt) -> dict[str, torch.Tensor]:
    ms, vs, _ = ct.moments(model, opt)
    out = {}
    for (name, p), m, v in zip(model.named_parameters(), ms, vs):
        out[f"w.{name}"], out[f"m.{name}"], out[f"v.{name}"] = p.detach(), m, v
    return out


def savers(model, opt, d: Path, buf: np.ndarray) -> dict[str, tuple[str, Callable[[], None]]]:
    """Durable savers of the same state; ``buf`` is the exact .bin in memory, which the limit
    contender writes the way ckptfmt's writer does, minus the hash and the value facts."""
    from safetensors.torch import save_file
    flat = state_dict_flat(model, opt)
    numpy_flat = {k: t.numpy() for k, t in flat.items()}

    def ours():
        ck = d / "step_001000.bin"
        for p in (ck, ck.with_suffix(".json")):
            if p.exists():
                p.unlink()
        ct.save(str(ck), model, opt)
    return {
        "durable write, no hash (limit)": (str(d / "raw.bin"), lambda: durable_write(buf, str(d / "raw.bin"))),
        "ckptfmt": (str(d / "step_001000.bin"), ours),
        "torch.save": (str(d / "ckpt.pt"), lambda: durable(
            lambda t: torch.save({"model": model.state_dict(), "optim": opt.state_dict()}, t), str(d / "ckpt.pt"))),
        "safetensors": (str(d / "ckpt.safetensors"), lambda: durable(
            lambda t: save_file(flat, t), str(d / "ckpt.safetensors"))),
        "numpy.savez": (str(d / "ckpt.npz"), lambda: durable(
            lambda t: np.savez(open(t, "wb"), **numpy_flat), str(d / "ckpt.npz"))),
    }


def durable_write(buf: np.ndarray, final: str) -> None:
    """The best durable writer without a hash on this machine: ckptfmt's own (8 MiB writes,
    writeback started every 64 MiB, fsync, rename, directory fsync) over the same bytes."""
    if os.path.exists(final):            # as the saves do: each replaces its previous file
        os.unlink(final)
    mv = memoryview(buf)
    with atomic.AtomicWriter(final) as out:
        for start in range(0, len(mv), CHUNK):
            out.write(mv[start:start + CHUNK])
        out.commit()


def in_turn(names: list[str], rep: int) -> list[str]:
    """The contenders' order in repetition ``rep``: reversed every other one, so drift in the
    machine's speed hits each contender alike."""
    return names if rep % 2 == 0 else names[::-1]


def bench_save(model, opt, d: Path, reps: int, buf: np.ndarray) -> dict[str, Any]:
    nbytes = buf.nbytes
    contenders = savers(model, opt, d, buf)
    times: dict[str, list[float]] = {k: [] for k in contenders}
    rss: dict[str, int] = {}
    for rep in range(reps):
        for name in in_turn(list(contenders), rep):
            path, fn = contenders[name]
            os.sync()
            t, r = measure(fn)
            times[name].append(t)
            rss[name] = max(rss.get(name, 0), r)
    return {k: {**summary(v), "gbps": nbytes / summary(v)["median"] / 1e9, "peak_rss_mb": rss[k] / 1e6,
                "bytes": os.path.getsize(contenders[k][0])} for k, v in times.items()}


# ---------------------------------------------------------------- open and load
def loaders(config: str, d: Path) -> dict[str, Callable[[torch.nn.Module, torch.optim.Optimizer], None]]:
    from safetensors import safe_open
    from safetensors.torch import load_file
    ck_path = str(d / "step_001000.bin")

    def load_flat(model, opt, get):
        sd = opt.state_dict()
        state = {}
        for i, (name, p) in enumerate(model.named_parameters()):
            p.data.copy_(get(f"w.{name}"))
            state[i] = {"step": torch.tensor(1000.0), "exp_avg": get(f"m.{name}").clone(),
                        "exp_avg_sq": get(f"v.{name}").clone()}
        sd["state"] = state
        opt.load_state_dict(sd)

    def torch_load(model, opt, mmap):
        st = torch.load(d / "ckpt.pt", weights_only=True, mmap=mmap)
        model.load_state_dict(st["model"])
        opt.load_state_dict(st["optim"])

    def mmap_memcpy(model, opt, hashed=False):   # the limit: map the file, copy each region into place
        ck = ckptfmt.open(ck_path, manifest="ignore", copy_on_write=True)
        if hashed:                    # the floor of any verified load: hash every byte, then copy
            fingerprint.of_buffer(ck.buffer())
        for region, tensors in (("weights", list(model.parameters())),
                                ("m", [opt.state[p]["exp_avg"] for p in model.parameters()]),
                                ("v", [opt.state[p]["exp_avg_sq"] for p in model.parameters()])):
            src, off = torch.from_numpy(getattr(ck, region)), 0
            for t in tensors:
                k = t.numel()
                t.data.view(-1).copy_(src[off:off + k])
                off += k

    def safetensors_load(model, opt):
        tensors = load_file(str(d / "ckpt.safetensors"))
        load_flat(model, opt, tensors.__getitem__)

    def safetensors_open(model, opt):
        with safe_open(str(d / "ckpt.safetensors"), framework="pt") as f:
            load_flat(model, opt, f.get_tensor)

    def numpy_load(model, opt):
        z = np.load(d / "ckpt.npz")
        load_flat(model, opt, lambda k: torch.from_numpy(z[k]))

    return {
        "mmap+memcpy (limit)": mmap_memcpy,
        "hash, then mmap+memcpy (floor)": lambda m, o: mmap_memcpy(m, o, hashed=True),
        "ckptfmt (verify blake3)": lambda m, o: ct.load(ck_path, m, o, verify=True).close(),
        "ckptfmt (no verify)": lambda m, o: ct.load(ck_path, m, o, verify=False).close(),
        "torch.load": lambda m, o: torch_load(m, o, False),
        "torch.load(mmap=True)": lambda m, o: torch_load(m, o, True),
        "safetensors load_file": safetensors_load,
        "safetensors safe_open": safetensors_open,
        "numpy.load(npz)": numpy_load,
    }


def bench_load(config: str, d: Path, reps: int, nbytes: int, files: dict[str, str]) -> dict[str, Any]:
    model, opt = build_state(config, seed=1)        # the target: prewarmed tensors, other values
    contenders = loaders(config, d)
    out: dict[str, Any] = {}
    for mode in ("warm", "cold"):
        times: dict[str, list[float]] = {k: [] for k in contenders}
        rss: dict[str, int] = {}
        for rep in range(reps):
            for name in in_turn(list(contenders), rep):
                fn = contenders[name]
                setup = (lambda: [drop_cache(p) for p in files.values()]) if mode == "cold" else None
                t, r = measure(lambda: fn(model, opt), setup)
                times[name].append(t)
                rss[name] = max(rss.get(name, 0), r)
        out[mode] = {k: {**summary(v), "gbps": nbytes / summary(v)["median"] / 1e9, "peak_rss_mb": rss[k] / 1e6}
                     for k, v in times.items()}
    return out


def bench_open(d: Path, reps: int) -> dict[str, Any]:
    from safetensors import safe_open
    ck_path = str(d / "step_001000.bin")
    contenders = {
        "ckptfmt.open": lambda: ckptfmt.open(ck_path).close(),
        "safetensors safe_open": lambda: safe_open(str(d / "ckpt.safetensors"), framework="pt").__enter__(),
        "torch.load(mmap=True)": lambda: torch.load(d / "ckpt.pt", weights_only=True, mmap=True),
        "numpy.load(npz)": lambda: np.load(d / "ckpt.npz").files,
    }
    times: dict[str, list[float]] = {k: [] for k in contenders}
    for _ in range(max(reps, 5)):
        for name, fn in contenders.items():
            times[name].append(measure(fn)[0])
    return {k: {**summary(v), "ms": summary(v)["median"] * 1e3} for k, v in times.items()}


# ---------------------------------------------------------------- validate, diff, convert
def bench_validate_diff(d: Path, reps: int, nbytes: int, model, opt) -> dict[str, Any]:
    from ckptfmt.tools.diff import diff
    from ckptfmt.tools.validate import validate_file
    a = d / "step_001000.bin"
    other = d / "other"
    other.mkdir(exist_ok=True)
    b = other / "step_001000.bin"
    if not b.exists():
        with torch.no_grad():
            for p in list(model.parameters())[::3]:
                p.add_(1e-3)
        ct.save(str(b), model, opt)
    buf = np.frombuffer(open(a, "rb").read(), dtype=np.uint8)
    contenders = {"validate (deep)": lambda: validate_file(a),     # a committed generation: its facts
                  "blake3 in memory": lambda: blake3.blake3(buf, max_threads=blake3.blake3.AUTO).digest(),
                  "validate --scan (as a bare .bin)": lambda: validate_file(a, scan=True),
                  "diff": lambda: diff(a, b), "validate --fast": lambda: validate_file(a, deep=False)}
    times: dict[str, list[float]] = {k: [] for k in contenders}
    rss: dict[str, int] = {}
    for rep in range(reps):
        for name in in_turn(list(contenders), rep):
            t, r = measure(contenders[name])
            times[name].append(t)
            rss[name] = max(rss.get(name, 0), r)
    return {k: {**summary(v), "gbps": (2 if k == "diff" else 1) * nbytes / summary(v)["median"] / 1e9,
                "peak_rss_mb": rss[k] / 1e6} for k, v in times.items()}


def bench_compress(src: str, d: Path) -> dict[str, Any]:
    """Compression choices on a trained checkpoint: level x byte planes, ratio and GB/s."""
    from ckptfmt.tools import convert as cv
    out = {}
    source = cv.load(src)
    size = os.path.getsize(src)
    for planes in (True, False):
        for level in (1, 3, 9):
            target = d / f"c_{planes}_{level}.{'ckz' if planes else 'zst'}"
            if target.exists():
                target.unlink()
            t = time.perf_counter()
            (cv.planes.write if planes else cv.zst.write)(source, str(target), False, None, None, level=level)
            tc = time.perf_counter() - t
            t = time.perf_counter()
            back = cv.load(str(target))
            td = time.perf_counter() - t
            assert back.weights.tobytes() == source.weights.tobytes()
            out[f"zstd-{level}{' planes' if planes else ''}"] = {
                "ratio": size / os.path.getsize(target), "compress_gbps": size / tc / 1e9, "decompress_gbps": size / td / 1e9}
            target.unlink()
    return out


# ---------------------------------------------------------------- trainer
def bench_train(d: Path, steps: int = 8) -> dict[str, Any]:
    """Steps/s per config and the checkpoint stall of andrea-12m, sync vs async."""
    out: dict[str, Any] = {"steps_per_s": {}, "stall": {}}
    ck = [sys.executable, "-m", "ckptfmt.cli", "train", "--sample-every", "0", "--log-every", "100000"]
    for config, n in (("tiny", 200), ("andrea-12m", steps), ("andrea-120m", 3)):
        run = d / f"train-{config}"
        shutil.rmtree(run, ignore_errors=True)
        subprocess.run(ck + ["--run", str(run), "--config", config, "--steps", str(n), "--checkpoint-every", str(10**6)],
                       check=True, capture_output=True)
        recs = [json.loads(x) for x in (run / ".loss.json").read_text().splitlines() if '"loss"' in x]
        walls = [r["wall"] for r in recs]
        per_step = (walls[-1] - walls[0]) / (len(walls) - 1)
        out["steps_per_s"][config] = {"steps_per_s": 1 / per_step, "s_per_step": per_step, "steps": n}
        shutil.rmtree(run, ignore_errors=True)
    out["stall"] = bench_stall(d, steps, out["steps_per_s"]["andrea-12m"]["s_per_step"])
    return out


def bench_stall(d: Path, steps: int, s_per_step: float) -> dict[str, Any]:
    """The trainer's checkpoint stall of andrea-12m, sync vs async (a checkpoint every 2 steps)."""
    out: dict[str, Any] = {}
    ck = [sys.executable, "-m", "ckptfmt.cli", "train", "--sample-every", "0", "--log-every", "100000"]
    for mode in ("sync", "async"):
        run = d / f"stall-{mode}"
        shutil.rmtree(run, ignore_errors=True)
        extra = ["--async-save"] if mode == "async" else []
        subprocess.run(ck + ["--run", str(run), "--config", "andrea-12m", "--steps", str(steps),
                             "--checkpoint-every", "2"] + extra, check=True, capture_output=True)
        events = [json.loads(x) for x in (run / ".loss.json").read_text().splitlines() if '"checkpoint"' in x]
        stalls = [e["stall_ms"] for e in events]
        out[mode] = {**summary(stalls), "ms": summary(stalls)["median"],
                     "fraction_of_step": summary(stalls)["median"] / 1e3 / s_per_step}
        shutil.rmtree(run, ignore_errors=True)
    out["async_over_sync"] = out["async"]["ms"] / out["sync"]["ms"]
    return out


def trained_checkpoint(run: Path, config: str, steps: int, *extra: str) -> str:
    """Train ``config`` to ``steps`` in a fresh run and return its final generation's path."""
    shutil.rmtree(run, ignore_errors=True)
    subprocess.run([sys.executable, "-m", "ckptfmt.cli", "train", "--run", str(run), "--config", config,
                    "--steps", str(steps), "--checkpoint-every", str(steps), "--sample-every", "0",
                    "--log-every", "100000", *extra], check=True, capture_output=True)
    return str(run / f"step_{steps:06d}.bin")


# ---------------------------------------------------------------- driver
def run_size(label: str, d: Path, reps: int) -> dict[str, Any]:
    config = SIZES[label]
    model, opt = build_state(config)
    buf = flat_bytes(model, opt)
    n = (buf.nbytes - 8) // 12
    print(f"[{label}] n_params {n:,}, {buf.nbytes / 1e9:.3f} GB", flush=True)
    res: dict[str, Any] = {"config": config, "n_params": n, "bytes": buf.nbytes}
    res["limits"] = limits(buf, d, reps)
    print(f"[{label}] limits done", flush=True)
    res["save"] = bench_save(model, opt, d, reps, buf)
    print(f"[{label}] save done", flush=True)
    files = {k: p for k, (p, _) in savers(model, opt, d, buf).items()}
    res["open"] = bench_open(d, reps)
    res["load"] = bench_load(config, d, reps, buf.nbytes, files)
    print(f"[{label}] load done", flush=True)
    res["validate_diff"] = bench_validate_diff(d, reps, buf.nbytes, model, opt)
    print(f"[{label}] validate/diff done", flush=True)
    del buf
    for p in list(d.iterdir()):
        shutil.rmtree(p) if p.is_dir() else p.unlink()
    return res


def ratios(res: dict[str, Any]) -> dict[str, Any]:
    """The goal table: each figure against the limit that bounds it and the best peer."""
    out = {}
    for label, r in res["sizes"].items():
        lim, save, load = r["limits"], r["save"], r["load"]
        peers_save = [v["median"] for k, v in save.items() if k not in ("ckptfmt", LIMIT_WRITER)]
        warm, cold = load["warm"], load["cold"]
        ours = "ckptfmt (verify blake3)"
        out[label] = {
            "save_vs_write_fsync": lim["write_fsync"]["median"] / save["ckptfmt"]["median"],
            "save_vs_durable_writer": save[LIMIT_WRITER]["median"] / save["ckptfmt"]["median"],
            "save_vs_best_peer": min(peers_save) / save["ckptfmt"]["median"],
            "open_ms": r["open"]["ckptfmt.open"]["ms"],
            "load_warm_vs_mmap_memcpy": warm["mmap+memcpy (limit)"]["median"] / warm[ours]["median"],
            "load_warm_vs_hash_then_copy": warm["hash, then mmap+memcpy (floor)"]["median"] / warm[ours]["median"],
            "load_warm_vs_safetensors": warm["safetensors load_file"]["median"] / warm[ours]["median"],
            "load_warm_vs_torch_load": warm["torch.load"]["median"] / warm[ours]["median"],
            "load_warm_noverify_vs_mmap_memcpy": warm["mmap+memcpy (limit)"]["median"] / warm["ckptfmt (no verify)"]["median"],
            "load_warm_noverify_vs_safetensors": warm["safetensors load_file"]["median"] / warm["ckptfmt (no verify)"]["median"],
            "load_cold_vs_uncached_read": lim["read_uncached"]["median"] / cold[ours]["median"],
            "validate_vs_blake3_memory": r["validate_diff"]["blake3 in memory"]["median"] / r["validate_diff"]["validate (deep)"]["median"],
            "validate_scan_vs_blake3_memory": (r["validate_diff"]["blake3 in memory"]["median"]
                                               / r["validate_diff"]["validate --scan (as a bare .bin)"]["median"]),
            "diff_peak_rss_mb": r["validate_diff"]["diff"]["peak_rss_mb"],
            "diff_gbps": r["validate_diff"]["diff"]["gbps"],
        }
    if "train" in res:
        out["async_stall_over_sync"] = res["train"]["stall"]["async_over_sync"]
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sizes", default="12.8M,120M")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--dir", default="/work/bench" if os.path.isdir("/work") else None)
    ap.add_argument("--skip-train", action="store_true")
    ap.add_argument("--out", help="the results (JSON lines; default benchmarks/results/latest.jsonl, "
                    "with --stall-only stall.jsonl)")
    ap.add_argument("--stall-only", action="store_true",
                    help="Only the trainer's sync vs async checkpoint stall (andrea-12m), into --out.")
    args = ap.parse_args()
    torch.set_num_threads(2)
    if args.dir:
        Path(args.dir).mkdir(parents=True, exist_ok=True)
    if args.stall_only:
        with tempfile.TemporaryDirectory(dir=args.dir) as tmp:
            stall = {"date": datetime.datetime.now().isoformat(timespec="seconds"),
                     "command": " ".join([".venv/bin/python", "benchmarks/run.py"] + sys.argv[1:]),
                     "stall": bench_stall(Path(tmp), 8, 1.0)}
        for mode in ("sync", "async"):
            del stall["stall"][mode]["fraction_of_step"]      # no step time measured here
        write_results("peers", stall, args.out or HERE / "results" / "stall.jsonl")
        print(json.dumps(stall["stall"], indent=1))
        return 0
    d = Path(tempfile.mkdtemp(prefix="ckptfmt-bench-", dir=args.dir))   # ours alone: emptied per size
    res: dict[str, Any] = {"date": datetime.datetime.now().isoformat(timespec="seconds"),
                           "command": " ".join([".venv/bin/python", "benchmarks/run.py"] + sys.argv[1:]),
                           "machine": {"cpus": os.cpu_count(), "python": platform.python_version(),
                                       "torch": torch.__version__, "numpy": np.__version__,
                                       "platform": platform.platform()},
                           "sizes": {}}
    for label in args.sizes.split(","):
        res["sizes"][label] = run_size(label, d, args.reps)
    res["compression_tiny_trained"] = bench_compress(trained_checkpoint(d / "trained", "tiny", 400), d)
    if not args.skip_train:
        res["train"] = bench_train(d)
        res["compression_andrea12m_20_steps"] = bench_compress(
            trained_checkpoint(d / "a12", "andrea-12m", 20, "--threads", "2"), d)
    res["goals"] = ratios(res)
    write_results("peers", res, args.out or HERE / "results" / "latest.jsonl")
    print(json.dumps(res["goals"], indent=1))
    shutil.rmtree(d, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
