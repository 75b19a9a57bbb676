"""Runs written straight to object storage: ckptfmt's store save and restore against raw fsspec
puts and gets of the same bytes and against torch DCP's FsspecWriter, on the tests' S3 server.

    python -m benchmarks store --reps 3                 # writes benchmarks/results/store_bench.jsonl
    python -m benchmarks store --table benchmarks/results/store_bench.jsonl

One moto_server (tests/s3server.py: moto's standalone server on 127.0.0.1, one Python process)
serves every contender; the model and AdamW state are run.py's (``build_state``: the trainer's
GPT with the andrea-12m / andrea-120m configs, trained-looking values). At each size:

1. Save, contenders alternating within each repetition (the order flips every other one), each
   to a fresh prefix that is deleted, untimed, right after it:
   - ``fsspec stream (no hash)``: the exact .bin bytes (header + weights + m + v) written through
     ``fs.open(path, "wb", block_size=16 MiB)`` in 8 MiB writes, the client and upload that
     the fsspec file the store used before it cut its own parts, with no hash, no confirmation
     and no manifest;
   - ``fsspec pipe_file (no hash)``: the same bytes as one ``fs.pipe_file`` (s3fs: 50 MiB parts,
     up to 10 concurrent);
   - ``ckptfmt save``: ``store.writing.save`` from the live tensors (``adapter.regions``, the
     manifest fields ``ct.save`` records): the streamed upload (``store.open_part``: its own 16 MiB
     parts, four in flight, each MD5-hashed) hashed by the writer's thread, the confirmation
     (``store.commit``: the size and the ETag S3 computed, by HEADs; a read-back only where the
     ETags vouch for nothing), the manifest; the confirmation is timed inside it (the store's
     ``size``, ``checksum`` and ``digest`` wrapped);
   - ``ckptfmt save, no confirmation``: the same upload (``writer.stream_hashed`` into
     ``store.open_part``) and the same sealed manifest by ``put_bytes``, without the confirmation;
   - ``DCP save``: ``torch.distributed.checkpoint.save({"model": model.state_dict(), "optim":
     opt.state_dict()}, storage_writer=FsspecWriter(url))``, one process, no process group.
   HTTP requests per save: a botocore ``before-send.s3`` handler registered on each client
   (``fs.s3.meta.events``: every attempt that goes out, retries included), by operation.
2. Restore of one committed generation, as ``restore()`` reads it: ``run = open_run(url)``,
   ``gen = run.latest()`` (list, manifest, the .bin read whole into memory, blake3 checked: the
   judge of a generation on a store) and ``run.open_at(run.name_of(gen))`` (that read, handed over) against ``fs.cat_file`` of the same two objects
   with no hash, and ``cat_file`` + blake3 of the bytes (the floor of any reader that checks);
   beside them ``store.digest`` of the .bin alone, the read-back a save confirms with where the
   store's ETags vouch for nothing (16 MiB ranged GETs, four at a time, hashed in order).

moto answers a ranged GET by reading the whole object from its spooled file and slicing it
(``moto/s3/responses.py``, ``_handle_range_header``), so on this server a read in ranges costs
(object size / range size) whole-object reads: the figures at 120M say what this server does, not
what S3 (which serves a range in proportion to its length) would.
3. The loop's stall: two ``CheckpointManager(s3://..., every=2, keep_last=1)``, one with
   ``async_save=False`` and one with ``True``, driven in turn through a small loop (one
   forward/backward/AdamW step on 16 tokens per step): the seconds inside ``mgr.step`` on a save
   step (and ``mgr.stall_s``) and on the step before it; after an async save the next step
   trains while it uploads, then ``mgr.wait()``; recorded: the part the loop would block on and
   the time from the save step's return to the commit. Below 1 GB one untimed save per manager
   first (the async snapshot allocates its buffers then); at 120M none (each save costs minutes
   on this server), so the async figure there includes that allocation.
4. Memory: a sampler thread (every 50 ms) reads /proc/meminfo (MemAvailable, Dirty) and the
   server's VmRSS and the bytes of the files it holds open (moto spools an object's value to an
   unlinked temporary file above ~5 MiB), per contender: before, peak, after the prefix is deleted.
"""
from __future__ import annotations

import contextlib
import datetime
import gc
import json
import os
import platform
import statistics
import subprocess
import sys
import threading
import time
import warnings
from collections import Counter
from pathlib import Path
from typing import Any, Callable

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(HERE))
sys.path.insert(1, str(ROOT / "tests"))
sys.path.insert(2, str(ROOT))      # this checkout's ckptfmt, not another one installed in the environment
from common import size_arguments  # noqa: E402
from harness.record import write_results  # noqa: E402
from harness.render import tables  # noqa: E402
from s3server import S3Server  # noqa: E402

SIZES = {"12.8M": "andrea-12m", "120M": "andrea-120m", "tiny": "tiny"}   # tiny: a smoke test
BUCKET = "store-bench"
CHUNK = 8 << 20
BLOCK = 16 << 20
SAVES = ("fsspec stream (no hash)", "fsspec pipe_file (no hash)", "ckptfmt save", "ckptfmt save, no confirmation",
         "DCP save")
RESTORES = ("fsspec cat_file (no hash)", "fsspec cat_file + blake3", "ckptfmt restore's read: latest() + open_at()",
            "ckptfmt store.digest (a read-back)")
MODES = ("async_save=False", "async_save=True")


# ================================================================ measuring aids
def summary(xs: list[float]) -> dict[str, Any]:
    return {"min": min(xs), "median": statistics.median(xs), "max": max(xs), "n": len(xs), "samples": list(xs)}


def in_turn(names: list[str], rep: int) -> list[str]:
    return names if rep % 2 == 0 else names[::-1]


class Requests:
    """Counts every HTTP request the clients it is attached to send, by S3 operation (a
    ``before-send.s3`` handler: one call per attempt on the wire)."""

    def __init__(self) -> None:
        self.by_op: Counter = Counter()
        self.lock = threading.Lock()
        self.clients: set[int] = set()

    def __call__(self, event_name: str = "", **_: Any) -> None:
        with self.lock:
            self.by_op[event_name.rsplit(".", 1)[-1]] += 1

    def attach(self, fs: Any) -> None:
        client = fs.s3                       # connects the client if need be
        if id(client) not in self.clients:
            self.clients.add(id(client))
            client.meta.events.register("before-send.s3", self)

    def snapshot(self) -> Counter:
        with self.lock:
            return Counter(self.by_op)


def _kib(path: str, key: str) -> int:
    try:
        with open(path) as f:
            for line in f:
                if line.startswith(key + ":"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def open_file_bytes(pid: int) -> int:
    """Bytes of the regular files process ``pid`` holds open (moto's spooled object values:
    unlinked temporary files, invisible to ``ls``)."""
    total = 0
    try:
        fds = os.listdir(f"/proc/{pid}/fd")
    except OSError:
        return 0
    for fd in fds:
        try:
            st = os.stat(f"/proc/{pid}/fd/{fd}")
        except OSError:
            continue
        if (st.st_mode & 0o170000) == 0o100000:
            total += st.st_size
    return total


class Watch:
    """Samples the machine's and the server's memory every ``period`` seconds; ``window()``
    gives what one contender did to them."""

    def __init__(self, server_pid: int, period: float = 0.05):
        self.pid, self.period = server_pid, period
        self.samples: list[tuple[float, int, int, int, int, int]] = []
        self.stop = threading.Event()
        self.lock = threading.Lock()
        self.thread = threading.Thread(target=self._run, daemon=True, name="store-bench-watch")
        self.thread.start()

    def sample(self) -> tuple[float, int, int, int, int, int]:
        return (time.monotonic(), _kib("/proc/meminfo", "MemAvailable"), _kib("/proc/meminfo", "Dirty"),
                _kib(f"/proc/{self.pid}/status", "VmRSS"), open_file_bytes(self.pid), _kib("/proc/self/status", "VmRSS"))

    def _run(self) -> None:
        while not self.stop.wait(self.period):
            s = self.sample()
            with self.lock:
                self.samples.append(s)

    def now(self) -> dict[str, int]:
        _, avail, dirty, srv, files, own = self.sample()
        return {"mem_available": avail, "dirty": dirty, "server_rss": srv, "server_files": files, "own_rss": own}

    @contextlib.contextmanager
    def window(self, out: dict[str, Any]):
        before = self.now()
        t0 = time.monotonic()
        yield
        t1 = time.monotonic()
        with self.lock:
            inside = [s for s in self.samples if t0 <= s[0] <= t1] or [self.sample()]
        end = self.now()
        out.update({"mem_available_before": before["mem_available"],
                    "mem_available_min": min(min(s[1] for s in inside), end["mem_available"]),
                    "dirty_max": max(max(s[2] for s in inside), end["dirty"]),
                    "server_rss_before": before["server_rss"],
                    "server_rss_peak": max(max(s[3] for s in inside), end["server_rss"]),
                    "server_files_peak": max(max(s[4] for s in inside), end["server_files"]),
                    "own_rss_before": before["own_rss"],
                    "own_rss_peak": max(max(s[5] for s in inside), end["own_rss"]),
                    "load_1m_max": os.getloadavg()[0]})

    def close(self) -> None:
        self.stop.set()
        self.thread.join()


def worst(into: dict[str, Any], got: dict[str, Any]) -> None:
    """Fold one window into the contender's record: the largest peaks, the lowest minimum."""
    for key, value in got.items():
        if key not in into:
            into[key] = value
        elif key.endswith("_min"):
            into[key] = min(into[key], value)
        elif key.endswith(("_peak", "_max")):
            into[key] = max(into[key], value)


def counting(requests: Requests) -> None:
    """Every client an ``ObjectStore`` opens from now on counts its requests into ``requests``
    (``open_fs`` wrapped in this process; the client connects there instead of at its first call)."""
    from ckptfmt.store import objects
    opened = getattr(objects.open_fs, "__wrapped__", objects.open_fs)

    def open_fs(url: str) -> tuple[Any, str]:
        fs, root = opened(url)
        if not getattr(fs, "local", False) and "s3" in (fs.protocol if isinstance(fs.protocol, tuple) else (fs.protocol,)):
            requests.attach(fs)
        return fs, root
    open_fs.__wrapped__ = opened
    objects.open_fs = open_fs


# ================================================================ the contenders
class Bench:
    def __init__(self, label: str, watch: Watch, log: Callable[[str], None]):
        import torch

        import ckptfmt
        from ckptfmt.store.objects import ObjectStore
        from run import build_state, flat_bytes
        self.label, self.watch, self.log = label, watch, log
        self.config = SIZES[label]
        t = time.perf_counter()
        self.model, self.opt = build_state(self.config)
        self.n = sum(p.numel() for p in self.model.parameters())
        flat = flat_bytes(self.model, self.opt)
        self.raw = flat.tobytes()             # the exact .bin: header + weights + m + v
        del flat
        self.size = ckptfmt.format.file_size(self.n)
        assert len(self.raw) == self.size, (len(self.raw), self.size)
        self.log(f"{label}: {self.n:,} parameters, {self.size:,} bytes, state built in {time.perf_counter() - t:.1f} s")
        self.requests = Requests()
        counting(self.requests)
        self.fs = ObjectStore(f"s3://{BUCKET}/raw").fs       # the raw contenders' client (ckptfmt's options)
        self.torch = torch

    # ------------------------------------------------------------ helpers
    def url(self, what: str) -> str:
        return f"s3://{BUCKET}/{what}"

    def clear(self, prefix: str) -> None:
        """Delete everything under ``prefix`` (untimed), so the server's memory does not grow."""
        try:
            self.fs.rm(f"{BUCKET}/{prefix}", recursive=True)
        except FileNotFoundError:
            pass
        self.fs.invalidate_cache()
        gc.collect()

    def store(self, prefix: str) -> Any:
        from ckptfmt.store.objects import ObjectStore
        return ObjectStore(self.url(prefix))

    def manifest_fields(self) -> dict[str, Any]:
        from ckptfmt.torch import adapter, optim
        return {"layout": adapter.layout_of(self.model), "optimizer": optim.describe(self.model, self.opt, 1000)}

    def save_unconfirmed(self, store: Any, fields: dict[str, Any]) -> int:
        """``store.writing.save`` minus ``store.commit``'s confirmation: the same streamed upload
        hashed by the writer's thread (facts included), then the same sealed manifest."""
        from ckptfmt import facts as valfacts
        from ckptfmt import format as fmt
        from ckptfmt import manifest as mf
        from ckptfmt import writer
        from ckptfmt.torch import adapter
        name = fmt.checkpoint_name(1000)
        w, m, v, n, _ = adapter.regions(self.model, self.opt)
        where = store.where(name)
        step, n, sources = writer.prepare(where, 1000, w, m, v, n, fields)
        facts = valfacts.ValueFacts()
        with store.open_part(name) as out:
            digest = writer.stream_hashed(out, where, fmt.pack_header(step, n), sources, n, facts)
            out.commit()
        doc = {**fields, valfacts.FIELD: facts.to_dict()}
        doc = mf.sealed(mf.build(file=name, size=fmt.file_size(n), step=step, n_params=n, digest=digest, extra=doc))
        store.put_bytes(fmt.manifest_name(step), mf.dumps(doc))
        self.last_digest = digest
        return out.offset

    # ------------------------------------------------------------ 1. save
    def save_contenders(self, prefix: str) -> dict[str, tuple[Callable[[], Any], Any]]:
        """name -> (the timed call, the client whose requests it sends), made ready untimed."""
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint._fsspec_filesystem import FsspecWriter

        from ckptfmt import format as fmt
        from ckptfmt.store import writing
        from ckptfmt.torch import adapter
        name = fmt.checkpoint_name(1000)
        mv = memoryview(self.raw)
        fields = self.manifest_fields()

        def stream() -> None:
            with self.fs.open(f"{BUCKET}/{prefix}/stream/{name}", "wb", block_size=BLOCK) as out:
                for i in range(0, len(mv), CHUNK):
                    out.write(mv[i:i + CHUNK])

        def pipe() -> None:
            self.fs.pipe_file(f"{BUCKET}/{prefix}/pipe/{name}", self.raw)

        ours = self.store(f"{prefix}/ckptfmt")
        self.confirming: list[float] = []

        def timed(call: Callable[..., Any]) -> Callable[..., Any]:
            def call_timed(*a: Any, **k: Any) -> Any:
                t = time.perf_counter()
                try:
                    return call(*a, **k)
                finally:
                    self.confirming.append(time.perf_counter() - t)
            return call_timed
        ours.size, ours.stat, ours.digest = timed(ours.size), timed(ours.stat), timed(ours.digest)

        def ckptfmt_save() -> None:
            w, m, v, n, _ = adapter.regions(self.model, self.opt)
            done = writing.save(ours, 1000, w, m, v, n_params=n, manifest=fields)
            assert done.size == self.size

        bare = self.store(f"{prefix}/bare")

        def unconfirmed() -> None:
            assert self.save_unconfirmed(bare, fields) == self.size

        storage = FsspecWriter(self.url(f"{prefix}/dcp"))

        def dcp_save() -> None:
            sd = {"model": self.model.state_dict(), "optim": self.opt.state_dict()}
            dcp.save(sd, storage_writer=storage)
        self.requests.attach(storage.fs.fs)
        return {SAVES[0]: (stream, self.fs), SAVES[1]: (pipe, self.fs), SAVES[2]: (ckptfmt_save, ours.fs),
                SAVES[3]: (unconfirmed, bare.fs), SAVES[4]: (dcp_save, storage.fs.fs)}

    def bench_save(self, reps: int) -> dict[str, Any]:
        times: dict[str, list[float]] = {k: [] for k in SAVES}
        reqs: dict[str, list[dict[str, int]]] = {k: [] for k in SAVES}
        mem: dict[str, dict[str, Any]] = {k: {} for k in SAVES}
        confirming: list[float] = []
        stored: dict[str, int] = {}
        failed: dict[str, list[str]] = {}
        for rep in range(reps):
            prefix = f"save-{self.label}-{rep}"
            ready = self.save_contenders(prefix)
            for name in in_turn(list(SAVES), rep):
                fn, _ = ready[name]
                self.confirming = []
                gc.collect()
                before = self.requests.snapshot()
                win: dict[str, Any] = {}
                with self.watch.window(win):
                    t = time.perf_counter()
                    try:
                        fn()
                    except Exception as exc:  # noqa: BLE001 (recorded and reported, the run goes on)
                        failed.setdefault(name, []).append(f"rep {rep}: {cause(exc)}")
                        self.log(f"  save {self.label} rep {rep} {name} FAILED: {failed[name][-1]}")
                    dt = time.perf_counter() - t
                got = self.requests.snapshot() - before
                if name not in failed or not failed[name][-1].startswith(f"rep {rep}:"):
                    times[name].append(dt)
                    reqs[name].append(dict(got))
                    if name == "ckptfmt save":
                        confirming.append(sum(self.confirming))
                sub = {SAVES[0]: "stream", SAVES[1]: "pipe", SAVES[2]: "ckptfmt", SAVES[3]: "bare", SAVES[4]: "dcp"}[name]
                stored[name] = sum(e["size"] for e in self.fs.find(f"{BUCKET}/{prefix}/{sub}", detail=True).values())
                self.clear(f"{prefix}/{sub}")
                win["server_rss_after_delete"] = self.watch.now()["server_rss"]
                worst(mem[name], win)
                self.log(f"  save {self.label} rep {rep} {name}: {dt:.3f} s, {sum(got.values())} requests")
            self.clear(prefix)
        out: dict[str, Any] = {"errors": failed} if failed else {}
        if any(not times[name] for name in SAVES):
            return {**out, "times": times}
        for name in SAVES:
            s = summary(times[name])
            out[name] = {**s, "gbps_median": self.size / s["median"] / 1e9, "gbps_best": self.size / s["min"] / 1e9,
                         "stored_bytes": stored[name], "requests": reqs[name][-1],
                         "requests_total": sorted({sum(r.values()) for r in reqs[name]}), "memory": mem[name]}
        ck, bare = times["ckptfmt save"], times["ckptfmt save, no confirmation"]
        out["confirmation"] = {"confirm_s": summary(confirming),
                               "share_of_save_median": statistics.median(r / t for r, t in zip(confirming, ck)),
                               "save_minus_unconfirmed_s": statistics.median(ck) - statistics.median(bare)}
        out["ratios"] = {f"ckptfmt save vs {name} (throughput)": ratio(times[name], ck)
                         for name in SAVES if name != "ckptfmt save"}
        out["ratios"]["ckptfmt save, no confirmation vs fsspec stream (no hash) (throughput)"] = ratio(times[SAVES[0]], bare)
        return out

    # ------------------------------------------------------------ 2. restore
    def bench_restore(self, reps: int) -> dict[str, Any]:
        import blake3

        from ckptfmt import format as fmt
        from ckptfmt.run.storerun import open_run
        prefix = f"restore-{self.label}"
        store = self.store(prefix)
        self.save_unconfirmed(store, self.manifest_fields())   # committed: its manifest is there
        blake = self.last_digest
        names = [fmt.checkpoint_name(1000), fmt.manifest_name(1000)]
        # moto reads a whole object for each ranged GET: the read-back alone is skipped above 1 GB
        # (a save reads back only where the store's ETags vouch for nothing)
        contenders = [name for name in RESTORES if name != RESTORES[3] or self.size < 1e9]

        def raw() -> Any:
            return [self.fs.cat_file(f"{BUCKET}/{prefix}/{p}") for p in names]

        def raw_hash() -> Any:
            got = raw()
            assert blake3.blake3(got[0], max_threads=blake3.blake3.AUTO).hexdigest() == blake
            return got

        phases: dict[str, list[float]] = {"open_run_s": [], "latest_s": [], "open_at_s": []}

        def ours() -> Any:
            t0 = time.perf_counter()
            run = open_run(self.url(prefix))
            t1 = time.perf_counter()
            gen = run.latest()
            t2 = time.perf_counter()
            ck = run.open_at(run.name_of(gen))     # the read latest() judged by (what a restore loads)
            t3 = time.perf_counter()
            for key, dt in zip(phases, (t1 - t0, t2 - t1, t3 - t2)):
                phases[key].append(dt)
            assert ck.verified and ck.n_params == self.n
            return ck
        def read_back() -> Any:
            assert store.digest(names[0]) == (blake, self.size)
        fns = {RESTORES[0]: raw, RESTORES[1]: raw_hash, RESTORES[2]: ours, RESTORES[3]: read_back}
        times: dict[str, list[float]] = {k: [] for k in contenders}
        reqs: dict[str, dict[str, int]] = {}
        mem: dict[str, dict[str, Any]] = {k: {} for k in contenders}
        for rep in range(reps):
            for name in in_turn(contenders, rep):
                gc.collect()
                before = self.requests.snapshot()
                win: dict[str, Any] = {}
                with self.watch.window(win):
                    t = time.perf_counter()
                    got = fns[name]()
                    dt = time.perf_counter() - t
                del got
                reqs[name] = dict(self.requests.snapshot() - before)
                times[name].append(dt)
                worst(mem[name], win)
                self.log(f"  restore {self.label} rep {rep} {name}: {dt:.3f} s")
        self.clear(prefix)
        out: dict[str, Any] = {}
        for name in contenders:
            s = summary(times[name])
            out[name] = {**s, "gbps_median": self.size / s["median"] / 1e9, "gbps_best": self.size / s["min"] / 1e9,
                         "requests": reqs[name], "memory": mem[name]}
        out[RESTORES[2]]["phases"] = {k: summary(v) for k, v in phases.items()}
        ck = times[RESTORES[2]]
        out["ratios"] = {f"ckptfmt verified read vs {name} (throughput)": ratio(times[name], ck) for name in RESTORES[:2]}
        return out

    # ------------------------------------------------------------ 3. the loop's stall
    def bench_stall(self, saves: int) -> dict[str, Any]:
        torch = self.torch
        from ckptfmt.torch import CheckpointManager
        prefixes = {mode: f"stall-{self.label}-{k}" for k, mode in enumerate(MODES)}
        mgrs = {mode: CheckpointManager(self.url(prefixes[mode]), self.model, self.opt, every=2, keep_last=1,
                                        async_save=mode.endswith("True"), handle_signals=False,
                                        log=lambda msg: self.log(f"  [manager] {msg}"))
                for mode in MODES}
        data = torch.Generator().manual_seed(1)
        steps = {mode: 0 for mode in MODES}
        rec: dict[str, dict[str, list[float]]] = {mode: {"save_step_s": [], "stall_s": [], "plain_step_s": [],
                                                         "wait_after_s": [], "committed_after_s": [], "train_s": [],
                                                         "train_during_save_s": [], "save_requests": []}
                                                  for mode in MODES}
        mem: dict[str, dict[str, Any]] = {mode: {} for mode in MODES}

        def train() -> tuple[float, float]:
            t = time.perf_counter()
            x = torch.randint(0, 256, (1, 17), generator=data)
            _, loss = self.model(x[:, :-1], x[:, 1:])
            self.opt.zero_grad(set_to_none=False)
            loss.backward()
            self.opt.step()
            return time.perf_counter() - t, loss.item()

        pending: dict[str, tuple[float, bool] | None] = {mode: None for mode in MODES}
        by_op: dict[str, dict[str, int]] = {}

        def settle(mode: str) -> None:
            """Wait for an async save in flight: the part the loop would block on, and the time
            from the save step's return to its commit (the loop trained meanwhile)."""
            t = time.perf_counter()
            mgrs[mode].wait()
            done = time.perf_counter()
            if pending[mode] is not None and pending[mode][1]:
                rec[mode]["wait_after_s"].append(done - t)
                rec[mode]["committed_after_s"].append(done - pending[mode][0])
            pending[mode] = None

        def cycle(mode: str, timed: bool) -> None:
            mgr, r = mgrs[mode], rec[mode]
            in_flight = pending[mode] is not None
            dt_train, loss = train()                      # overlaps the previous async save
            steps[mode] += 1
            t = time.perf_counter()
            mgr.step(steps[mode], loss=loss)              # odd: no save
            plain = time.perf_counter() - t
            settle(mode)
            if timed:
                r["train_during_save_s" if in_flight else "train_s"].append(dt_train)
            dt_train, loss = train()
            steps[mode] += 1
            gc.collect()
            before = self.requests.snapshot()
            win: dict[str, Any] = {}
            with self.watch.window(win):
                t = time.perf_counter()
                mgr.step(steps[mode], loss=loss)          # even: a save
                dt = time.perf_counter() - t
            if mode.endswith("True"):
                pending[mode] = (time.perf_counter(), timed)
            if timed:
                r["plain_step_s"].append(plain)
                r["save_step_s"].append(dt)
                r["stall_s"].append(mgr.stall_s)
                r["train_s"].append(dt_train)
                worst(mem[mode], win)
            self.log(f"  stall {self.label} {mode} step {steps[mode]}: step() {dt:.3f} s, stall_s {mgr.stall_s:.3f}"
                     f"{'' if timed else ' (untimed)'}")
            if not mode.endswith("True"):
                got = self.requests.snapshot() - before
                r["save_requests"].append(sum(got.values()))
                by_op[mode] = dict(got)

        warm = self.size < 1e9        # 120M: no untimed save first (each costs minutes on moto)
        errors: list[str] = []
        try:
            for k in range(saves + warm):
                for mode in in_turn(list(MODES), k):
                    cycle(mode, timed=k > 0 or not warm)
            for mode in in_turn(list(MODES), saves + warm):   # the last async save's remainder
                in_flight = pending[mode] is not None
                dt_train, loss = train()
                steps[mode] += 1
                mgrs[mode].step(steps[mode], loss=loss)
                settle(mode)
                if in_flight:
                    rec[mode]["train_during_save_s"].append(dt_train)
        except Exception as exc:  # noqa: BLE001 (recorded and reported, the run goes on)
            errors.append(f"step {steps}: {cause(exc)}")
            self.log(f"  stall {self.label} FAILED: {errors[-1]}")
        for mode in MODES:
            try:
                mgrs[mode].close()
            except Exception as exc:  # noqa: BLE001
                errors.append(f"close {mode}: {cause(exc)}")
                self.log(f"  stall {self.label} close FAILED: {errors[-1]}")
            self.clear(prefixes[mode])
        out: dict[str, Any] = {"errors": errors} if errors else {}
        for mode in MODES:
            out[mode] = {k: summary(v) for k, v in rec[mode].items() if v and k != "save_requests"}
            out[mode]["memory"] = mem[mode]
            if rec[mode]["save_requests"]:
                out[mode]["requests_per_save_step"] = sorted(set(rec[mode]["save_requests"]))
                out[mode]["requests_last_save_step"] = by_op.get(mode, {})
        if all(rec[m]["save_step_s"] for m in MODES):
            s, a = (statistics.median(rec[m]["save_step_s"]) for m in MODES)
            out["async_over_sync_stall"] = a / s
        out["untimed_save_first"] = warm
        return out


def cause(exc: BaseException) -> str:
    """The error and what it was raised from or during (ckptfmt's one-line ``RemoteError`` keeps
    the client's exception as its context): the reason to report, not only the message."""
    chain, seen = [], exc
    while seen is not None and len(chain) < 6:
        chain.append(f"{type(seen).__name__}: {str(seen).splitlines()[0][:300] if str(seen) else ''}")
        seen = seen.__cause__ or seen.__context__
    return " <- ".join(chain)


def ratio(baseline: list[float], ours: list[float]) -> dict[str, float]:
    """Throughput of ours over the baseline's: by medians, by minima, and the median of the
    per-repetition ratios (the pairs measured side by side)."""
    return {"median": statistics.median(baseline) / statistics.median(ours), "best": min(baseline) / min(ours),
            "paired_median": statistics.median(b / o for b, o in zip(baseline, ours))}


# ================================================================ the report
def machine() -> dict[str, Any]:
    import aiobotocore
    import botocore
    import fsspec
    import moto
    import numpy
    import s3fs
    import torch
    return {"cpus": os.cpu_count(), "mem_total_gib": round(_kib("/proc/meminfo", "MemTotal") / 2**30, 1),
            "platform": platform.platform(), "python": platform.python_version(), "torch": torch.__version__,
            "numpy": numpy.__version__, "fsspec": fsspec.__version__, "s3fs": s3fs.__version__,
            "aiobotocore": aiobotocore.__version__, "botocore": botocore.__version__, "moto": moto.__version__,
            "load_avg_at_start": os.getloadavg()}


def git_commit() -> str:
    try:
        head = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "HEAD"], capture_output=True, text=True).stdout.strip()
        dirty = subprocess.run(["git", "-C", str(ROOT), "status", "--porcelain", "ckptfmt"], capture_output=True,
                               text=True).stdout.strip()
        return head + (" (ckptfmt/ modified)" if dirty else "")
    except OSError:
        return "unknown"


def main() -> int:
    ap = size_arguments(__doc__, "12.8M,120M", 3, str(HERE / "results" / "store_bench.jsonl"))
    ap.add_argument("--large-reps", type=int, default=2, help="save repetitions at 120M (default 2)")
    ap.add_argument("--large-restore-reps", type=int, default=1, help="restore repetitions at 120M (default 1)")
    ap.add_argument("--large-stall-saves", type=int, default=1, help="timed saves per mode at 120M (default 1)")
    ap.add_argument("--only", default="save,restore,stall", help="parts to run: save,restore,stall")
    args = ap.parse_args()
    if args.table:
        print(tables(args.table, "store"))
        return 0
    warnings.simplefilter("ignore")          # DCP without a process group says so at each save
    os.environ.setdefault("OMP_NUM_THREADS", "2")
    parts = set(args.only.split(","))
    started = time.time()

    def log(msg: str) -> None:
        print(f"[{time.time() - started:6.1f}s] {msg}", file=sys.stderr, flush=True)
    doc: dict[str, Any] = {"command": " ".join([".venv/bin/python", "benchmarks/store_bench.py", *sys.argv[1:]]),
                           "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
                           "git_commit": git_commit(), "machine": machine(),
                           "ckptfmt_package": str(Path(__import__("ckptfmt").__file__).parent),
                           "server": "moto_server (tests/s3server.py) on 127.0.0.1, one Python process, same machine",
                           "sizes": {}}
    with S3Server() as s3:
        os.environ.update(s3.env)
        s3.bucket(BUCKET)
        watch = Watch(s3.proc.pid)
        try:
            doc["server_idle"] = watch.now()
            for label in args.sizes.split(","):
                large = label == "120M"
                reps = {"save": min(args.reps, args.large_reps) if large else args.reps,
                        "restore": min(args.reps, args.large_restore_reps) if large else args.reps,
                        "stall": min(args.reps, args.large_stall_saves) if large else args.reps}
                bench = Bench(label, watch, log)
                res: dict[str, Any] = {"config": bench.config, "n_params": bench.n, "bin_bytes": bench.size, "reps": reps,
                                       "server_idle": watch.now()}
                if "save" in parts:
                    res["save"] = bench.bench_save(reps["save"])
                if "restore" in parts:
                    res["restore"] = bench.bench_restore(reps["restore"])
                if "stall" in parts:
                    res["stall"] = bench.bench_stall(reps["stall"])
                res["server_end"] = watch.now()
                doc["sizes"][label] = res
                del bench
                gc.collect()
        finally:
            watch.close()
    doc["wall_s"] = time.time() - started
    doc["load_avg_at_end"] = os.getloadavg()
    if args.out:
        print(tables(write_results("store", doc, args.out)))
    else:
        print(json.dumps(doc, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
