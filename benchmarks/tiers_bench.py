"""The recovery tiers (spec/RUN.md §13) at 12.8M and 120M parameters with AdamW: what one RAM
save costs the loop, how long a restart takes from each tier, and what the RAM tier holds.

    python -m benchmarks tiers --reps 3      # 12.8M and 120M; writes benchmarks/results/tiers.jsonl
    python -m benchmarks tiers --table benchmarks/results/tiers.jsonl

1. Stall of one RAM save, in this process: the ``CheckpointManager``'s ``step()`` on a step that
   saves to the RAM tier (``memory_every=2``) minus the step before it (no save), beside the
   ``stall_ms`` its history records, without and with ``async_save=True`` (a background RAM
   save is waited for outside the timing); against the memcpy floor (weights, m, v into three
   preallocated float32 buffers, one ``torch.cat(out=)`` each, as the async snapshot does), the
   write of those flat bytes to a new file in /dev/shm (no hash), and DCP's
   ``torch.distributed.checkpoint.async_save`` of the model's and the optimizer's state dicts
   into /dev/shm (the time until it returns; its upload is waited for outside the timing), with
   its default stager and with one caller-owned stager reused across saves (its best case).
   The contenders rotate within each repetition (--stall-reps, default --reps but at least 5);
   each runs once untimed first.
2. Restart: a worker (this file, ``--worker``) builds the model (``GPT`` of the andrea config,
   as benchmarks/run.py does) and AdamW, opens a ``CheckpointManager`` (a durable generation every
   4 steps, a RAM one every 3), restores and trains; a fresh run gets the trained-looking values of
   run.py first, trains steps 1-7 (RAM generations 3 and 6, a durable one at 4) and SIGKILLs
   itself. Each restart is a new process that restores, trains one step and exits; measured from
   just before ``Popen`` to the end of that first step (``mgr.step`` returned), with the worker's
   time stamps for the parts. RAM: the run as left. Disk: the RAM tier's directory renamed away
   (what a reboot does to /dev/shm) and the run's files evicted from the page cache (a reboot
   loses those too). Mirror: ``ckptfmt mirror RUN file://...`` once, then per restart the mirror's
   files evicted, ``ckptfmt import`` into a new run and the worker on it (both timed). Peer: two
   torchrun "nodes" (gloo, one rank each, DDP), node 1's agent and worker SIGKILLed after step 7
   and its RAM directory removed, node 1 relaunched; measured from that relaunch to the end of the
   first step after the resume on both ranks (node 0's agent restarts its own worker when the
   collective fails); then, as the baseline without a fetch, both nodes relaunched with their RAM.
3. RSS (VmHWM, VmRSS of the worker after step 7) and the RAM tier's bytes (``du``) with
   ``memory_every`` on and off, each without and with ``async_save``.

--tree DIR measures the ckptfmt package in DIR (e.g. ``git archive HEAD ckptfmt | tar -x -C DIR``)
instead of this checkout's: it goes first on every process's path, and the JSON records the
sha256 of the files the tiers live in.

The worker trains with one torch thread (as the reference trainer does) on one sequence of 16
tokens a step, so a step is short next to what is measured around it. Scratch goes to a fresh
directory under --dir (runs, mirror) and under /dev/shm (RAM tiers, DCP), removed at the end.
"""
from __future__ import annotations

import time

T_TOP = time.time()   # a worker's first statement after the interpreter's start, before torch

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(HERE))
from common import drop_cache, size_arguments
from harness.record import write_results
from harness.render import tables

PY = sys.executable
TREE = ROOT          # where the measured ckptfmt package lives (--tree)
SIZES = {"12m": "andrea-12m", "120m": "andrea-120m"}
LABELS = {"12m": "12.8M", "120m": "120M"}
DURABLE, MEMORY, LAST, TOKENS = 4, 3, 7, 16      # durable at 4, RAM at 3 and 6, killed after 7
MEMORY_ENV = "CKPTFMT_MEMORY_DIR"
STALL = ("ckptfmt RAM save", "ckptfmt RAM save, async_save=True", "memcpy floor", "write to /dev/shm (no hash)", "DCP async_save",
         "DCP async_save, reused stager")
RESTARTS = ("ram", "disk", "mirror")


# ================================================================ the worker (a training process)
def settle(mgr: Any) -> None:
    """Wait for the manager's saves in flight, durable and RAM (``MemoryTier.settle`` where the
    measured tree's RAM tier saves in the background; a synchronous one has none)."""
    mgr.wait()
    memory = getattr(mgr, "_memory", None)
    if memory is not None and hasattr(memory, "settle"):
        memory.settle()


def status() -> dict[str, int]:
    out = {}
    with open("/proc/self/status") as f:
        for line in f:
            key = line.split(":", 1)[0]
            if key in ("VmHWM", "VmRSS", "RssAnon", "RssFile", "RssShmem"):
                out[key] = int(line.split()[1]) * 1024
    return out


def worker(args: Any) -> None:
    import torch
    import torch.distributed as dist

    from ckptfmt.torch import CheckpointManager
    from ckptfmt.torch.distributed import exit_worker, launched_by_torchrun
    from ckptfmt.trainer.config import CONFIGS
    from ckptfmt.trainer.model import GPT
    stamps = {"t_top": T_TOP, "t_imported": time.time()}
    distributed = launched_by_torchrun()
    if distributed:
        import datetime
        dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=300))
    rank = dist.get_rank() if distributed else 0
    stamps["t_group"] = time.time()
    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = GPT(CONFIGS[SIZES[args.size]])
    stamps["t_model"] = time.time()
    opt = torch.optim.AdamW(model.parameters(), lr=3e-4)     # the first one imports torch._dynamo
    stamps["t_optimizer"] = time.time()
    net = model
    if distributed:
        from torch.nn.parallel import DistributedDataParallel
        net = DistributedDataParallel(model)
    data = torch.Generator().manual_seed(1 + rank)
    mgr = CheckpointManager(args.worker, model, opt, generators={"data": data}, every=DURABLE, keep_last=2,
                            memory_every=args.memory_every or None, async_save=args.async_save, handle_signals=False,
                            log=lambda m: print(f"[rank {rank}] {m}", file=sys.stderr, flush=True))
    stamps["t_built"] = time.time()
    start = mgr.restore()
    stamps["t_restored"] = time.time()

    def report(kind: str) -> None:
        doc = {"kind": kind, "rank": rank, "pid": os.getpid(), "start": start, "tier": mgr.restored_tier,
               **stamps, **status()}
        (Path(args.report) / f"{kind}-{rank}-{os.getpid()}.json").write_text(json.dumps(doc))

    if start == 0:                        # a fresh run: values that look trained (run.py's)
        from run import trained_looking
        _, fresh = trained_looking(model, 0)
        for p, state in fresh.state.items():
            opt.state[p] = state
    for step in range(start + 1, LAST + 1 if start == 0 else start + 2):
        x = torch.randint(0, 256, (1, TOKENS + 1), generator=data)
        _, loss = net(x[:, :-1], x[:, 1:])
        opt.zero_grad(set_to_none=False)
        loss.backward()
        opt.step()
        mgr.step(step, loss=loss.item())
    stamps["t_first_step"] = time.time()
    if start:                             # a restart: one step, then out
        report("resumed")
        mgr.close()
        if distributed:
            dist.barrier()
            dist.destroy_process_group()
        exit_worker(0)
    settle(mgr)                           # a defined state to restart from: RAM 3 and 6 committed
    report("setup")                       # after step 7: the crash
    if not distributed:
        os.kill(os.getpid(), signal.SIGKILL)
    beat = torch.zeros(1)
    while True:                           # the job goes on until a node is lost: the collective fails
        dist.all_reduce(beat)
        time.sleep(0.05)


# ================================================================ helpers of the driver
def du(path: Path) -> int:
    """Bytes the directory takes (st_blocks, as ``du`` counts); 0 if it does not exist."""
    total = 0
    for top, _, files in os.walk(path):
        for name in files:
            try:
                total += os.lstat(os.path.join(top, name)).st_blocks * 512
            except OSError:
                pass
    return total


def evict(path: Path) -> None:
    for top, _, files in os.walk(path):
        for name in files:
            if name != ".lock":
                drop_cache(os.path.join(top, name))


def worker_argv(run: Path, size: str, memory_every: int, report: Path, async_save: bool = False) -> list[str]:
    return [str(HERE / "tiers_bench.py"), "--worker", str(run), "--size", size,
            "--memory-every", str(memory_every), "--report", str(report)] + (["--async-save"] if async_save else [])


def child_env(memory: Path | None = None) -> dict[str, str]:
    """The children's environment: the measured tree first on the path, the RAM tier's root."""
    path = os.pathsep.join(p for p in (str(TREE), os.environ.get("PYTHONPATH", "")) if p)
    env = {**os.environ, "PYTHONPATH": path, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}
    if memory is not None:
        env[MEMORY_ENV] = str(memory)
    return env


def reports(report: Path, kind: str, seen: set[str]) -> list[dict[str, Any]]:
    """The worker reports of ``kind`` not read before (each read once)."""
    out = []
    for p in sorted(report.glob(f"{kind}-*.json")):
        if p.name not in seen:
            seen.add(p.name)
            out.append(json.loads(p.read_text()))
    return out


def run_id(run: Path) -> str:
    return json.loads((run / ".run-id.json").read_text())["id"]


def history_events(run: Path) -> list[dict[str, Any]]:
    from ckptfmt.run import history as hist
    return hist.read(run / hist.NAME).events()


def parts(doc: dict[str, Any], t0: float) -> dict[str, float]:
    """The restart's parts from the worker's time stamps, ``t0`` the launch."""
    return {"total_s": doc["t_first_step"] - t0, "start_s": doc["t_top"] - t0,
            "imports_s": doc["t_imported"] - doc["t_top"], "group_s": doc["t_group"] - doc["t_imported"],
            "model_s": doc["t_model"] - doc["t_group"], "optimizer_s": doc["t_optimizer"] - doc["t_model"],
            "manager_s": doc["t_built"] - doc["t_optimizer"], "restore_s": doc["t_restored"] - doc["t_built"],
            "first_step_s": doc["t_first_step"] - doc["t_restored"]}


class Scratch:
    def __init__(self, base: str | None):
        self.disk = Path(tempfile.mkdtemp(prefix="tiers-", dir=base if base and os.path.isdir(base) else None))
        self.shm = Path(tempfile.mkdtemp(prefix="ckptfmt-tiers-bench-", dir="/dev/shm"))
        self.report = self.disk / "reports"
        self.report.mkdir()
        self.seen: set[str] = set()

    def close(self) -> None:
        shutil.rmtree(self.disk, ignore_errors=True)
        shutil.rmtree(self.shm, ignore_errors=True)


# ================================================================ 1. the stall of one RAM save
def bench_stall(size: str, reps: int, sc: Scratch) -> dict[str, Any]:
    import warnings

    import numpy as np
    import torch
    import torch.distributed.checkpoint as dcp
    from common import peak_rss, reset_peak_rss, touch
    from run import build_state
    from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions

    import ckptfmt.torch as ct
    from ckptfmt.torch import CheckpointManager
    warnings.simplefilter("ignore")               # DCP without a process group says so each save
    os.environ[MEMORY_ENV] = str(sc.shm / "stall-tier")
    model, opt = build_state(SIZES[size])
    params = list(model.parameters())
    ms, vs, _ = ct.moments(model, opt)
    n = sum(p.numel() for p in params)
    bufs = [touch(np.zeros(n, dtype=np.float32)) for _ in range(3)]
    runs = {name: sc.disk / f"stall-{size}-{k}" for k, name in enumerate(STALL[:2])}
    mgrs = {name: CheckpointManager(runs[name], model, opt, every=None, memory_every=2, handle_signals=False,
                                    async_save=name.endswith("async_save=True"),
                                    log=lambda m: print(f"  [manager] {m}", file=sys.stderr)) for name in runs}
    stager = DefaultStager(StagingOptions(False, False, False, False))
    state = {"dcp": 0, **{name: 0 for name in runs}}
    pending: list[Any] = []

    def memcpy() -> None:
        for buf, group in zip(bufs, (params, ms, vs)):
            torch.cat([t.detach().reshape(-1) for t in group], out=torch.from_numpy(buf))

    def shm_write() -> None:
        fd = os.open(sc.shm / "flat.bin", os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        try:
            for buf in bufs:
                mv = memoryview(buf).cast("B")
                for i in range(0, len(mv), 8 << 20):
                    os.write(fd, mv[i:i + (8 << 20)])
        finally:
            os.close(fd)

    def dcp_save(reused: bool) -> None:
        state["dcp"] += 1
        sd = {"model": model.state_dict(), "optim": opt.state_dict()}
        pending.append(dcp.async_save(sd, checkpoint_id=str(sc.shm / f"dcp-{state['dcp']}"),
                                      async_stager=stager if reused else None))

    def after(name: str) -> None:                 # outside the timing: the upload, the file
        while pending:
            pending.pop().result()
        for p in sc.shm.glob("dcp-*"):
            shutil.rmtree(p)
        if (sc.shm / "flat.bin").exists():
            os.unlink(sc.shm / "flat.bin")

    def ram_pair(name: str) -> tuple[float, float, int]:
        """(seconds of step() without a save, with one, the step saved); a RAM save that goes
        on in the background (a tree whose tier saves asynchronously) is waited for after."""
        times = []
        for _ in range(2):
            state[name] += 1
            t = time.perf_counter()
            mgrs[name].step(state[name], loss=1.0)
            times.append(time.perf_counter() - t)
        settle(mgrs[name])
        return times[0], times[1], state[name]

    def timed(fn: Any) -> tuple[float, int]:
        import gc
        gc.collect()
        base = reset_peak_rss()
        t = time.perf_counter()
        fn()
        return time.perf_counter() - t, max(0, peak_rss() - base)

    contenders = {"memcpy floor": memcpy, "write to /dev/shm (no hash)": shm_write,
                  "DCP async_save": lambda: dcp_save(False), "DCP async_save, reused stager": lambda: dcp_save(True)}
    out: dict[str, Any] = {name: {"s": [], "peak_rss": []} for name in STALL}
    for name in mgrs:
        out[name].update(step_nosave_s=[], step_save_s=[], history_stall_s=[], steps=[])
        ram_pair(name)     # one untimed round first: the tier's directory, DCP's plan, the stager's cache
    for name, fn in contenders.items():
        fn()
        after(name)
    for rep in range(reps):
        order = list(STALL[rep % len(STALL):] + STALL[:rep % len(STALL)])
        for name in order:
            if name in mgrs:
                import gc
                gc.collect()
                base = reset_peak_rss()
                nosave, save, step = ram_pair(name)
                rec = out[name]
                rec["peak_rss"].append(max(0, peak_rss() - base))
                rec["step_nosave_s"].append(nosave)
                rec["step_save_s"].append(save)
                rec["s"].append(save - nosave)
                rec["steps"].append(step)
            else:
                s, rss = timed(contenders[name])
                out[name]["s"].append(s)
                out[name]["peak_rss"].append(rss)
                after(name)
    for name, mgr in mgrs.items():
        mgr.close()
        stalls = {e["step"]: e["stall_ms"] / 1e3 for e in history_events(runs[name])
                  if e["event"] == "checkpoint" and e.get("tier") == "memory"}
        out[name]["history_stall_s"] = [stalls[s] for s in out[name]["steps"]]
        shutil.rmtree(runs[name], ignore_errors=True)
    stager.close()
    del os.environ[MEMORY_ENV]
    shutil.rmtree(sc.shm / "stall-tier", ignore_errors=True)
    return {"params": n, "bytes": 12 * n, "torch_threads": torch.get_num_threads(), "contenders": out}


# ================================================================ 2-3. restarts, RSS, shm: one process
def setup_run(run: Path, memory: Path, size: str, memory_every: int, sc: Scratch, log: Path,
              async_save: bool = False) -> dict[str, Any]:
    """Train steps 1-7 in a fresh worker, which then SIGKILLs itself; its report, the RAM tier's
    bytes and the stalls its history records."""
    t0 = time.time()
    with open(log, "a") as f:
        proc = subprocess.run([PY, *worker_argv(run, size, memory_every, sc.report, async_save)],
                              env=child_env(memory),
                              stdout=f, stderr=subprocess.STDOUT, cwd=TREE, timeout=900, check=False)
    if proc.returncode != -signal.SIGKILL:
        raise SystemExit(f"setup worker exited {proc.returncode}: {log.read_text()[-3000:]}")
    (doc,) = reports(sc.report, "setup", sc.seen)
    tier = memory / run_id(run) if memory_every else None
    events = [e for e in history_events(run) if e["event"] == "checkpoint"]
    return {"memory_every": memory_every, "async_save": async_save, "seconds": time.time() - t0,
            "rss": {k: doc[k] for k in status_keys(doc)},
            "shm_bytes": du(tier) if tier else 0,
            "ram_save_stall_s": [e["stall_ms"] / 1e3 for e in events if e.get("tier") == "memory"],
            "durable_save_stall_s": [e["stall_ms"] / 1e3 for e in events if e.get("tier") is None]}


def status_keys(doc: dict[str, Any]) -> list[str]:
    return [k for k in ("VmHWM", "VmRSS", "RssAnon", "RssFile", "RssShmem") if k in doc]


def restart(run: Path, memory: Path, size: str, sc: Scratch, log: Path, expect: tuple[str, int]) -> dict[str, Any]:
    t0 = time.time()
    with open(log, "a") as f:
        proc = subprocess.run([PY, *worker_argv(run, size, MEMORY, sc.report)], env=child_env(memory),
                              stdout=f, stderr=subprocess.STDOUT, cwd=TREE, timeout=900, check=False)
    if proc.returncode:
        raise SystemExit(f"restart worker exited {proc.returncode}: {log.read_text()[-3000:]}")
    (doc,) = reports(sc.report, "resumed", sc.seen)
    if (doc["tier"], doc["start"]) != expect:
        raise SystemExit(f"restart resumed from {doc['tier']} step {doc['start']}, expected {expect}")
    return {**parts(doc, t0), "tier": doc["tier"], "step": doc["start"], "rss": {k: doc[k] for k in status_keys(doc)}}


def cli(*args: str, log: Path) -> float:
    t = time.perf_counter()
    with open(log, "a") as f:
        proc = subprocess.run([PY, "-m", "ckptfmt.cli", *args], stdout=f, stderr=subprocess.STDOUT, cwd=TREE,
                              env=child_env(), timeout=900, check=False)
    if proc.returncode:
        raise SystemExit(f"ckptfmt {' '.join(args)} exited {proc.returncode}: {log.read_text()[-3000:]}")
    return time.perf_counter() - t


def bench_restarts(size: str, reps: int, off_reps: int, sc: Scratch) -> dict[str, Any]:
    out: dict[str, Any] = {"setups": [], "mirror_s": [],
                           **{k: [] for k in RESTARTS}, "import_s": []}
    for rep in range(reps):
        run, memory, log = sc.disk / f"{size}-run-{rep}", sc.shm / f"{size}-ram-{rep}", sc.disk / f"{size}-{rep}.log"
        mirror = sc.disk / f"{size}-mirror-{rep}"
        print(f"  {LABELS[size]} rep {rep + 1}/{reps}: setup (memory_every {MEMORY})", flush=True)
        out["setups"].append(setup_run(run, memory, size, MEMORY, sc, log))
        if rep < off_reps:               # for RSS and shm: off, and both with async_save
            for every, background in ((0, False), (MEMORY, True), (0, True)):
                print(f"  {LABELS[size]} rep {rep + 1}/{reps}: setup (memory_every {every or 'off'}, "
                      f"async_save {background})", flush=True)
                other, shm = sc.disk / f"{size}-other-{rep}", sc.shm / f"{size}-other-{rep}"
                out["setups"].append(setup_run(other, shm, size, every, sc, log, background))
                shutil.rmtree(other)
                shutil.rmtree(shm, ignore_errors=True)
        out["mirror_s"].append(cli("mirror", str(run), mirror.as_uri(), log=log))
        tier = memory / run_id(run)
        order = list(RESTARTS[rep % 3:] + RESTARTS[:rep % 3])
        for kind in order:
            print(f"  {LABELS[size]} rep {rep + 1}/{reps}: restart from {kind}", flush=True)
            if kind == "ram":
                out["ram"].append(restart(run, memory, size, sc, log, ("memory", 6)))
            elif kind == "disk":
                away = tier.with_name(tier.name + ".away")
                tier.rename(away)                 # the RAM tier gone, as after a reboot
                try:
                    evict(run)                     # and the page cache with it
                    out["disk"].append(restart(run, memory, size, sc, log, ("disk", DURABLE)))
                finally:
                    away.rename(tier)
            else:
                copy = sc.disk / f"{size}-imported-{rep}"
                shutil.rmtree(copy, ignore_errors=True)
                evict(mirror)
                imported = cli("import", mirror.as_uri(), str(copy), log=log)
                got = restart(copy, memory, size, sc, log, ("disk", DURABLE))
                out["import_s"].append(imported)
                out["mirror"].append({**got, "import_s": imported, "total_with_import_s": imported + got["total_s"]})
                shutil.rmtree(copy)
        shutil.rmtree(run)
        shutil.rmtree(mirror)
        shutil.rmtree(memory, ignore_errors=True)
    return out


# ================================================================ 2. peer: two torchrun "nodes"
def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _listening(port: int) -> bool:
    with socket.socket() as s:
        return s.connect_ex(("127.0.0.1", port)) == 0


def _worker_of(agent: int) -> int:
    """The PID of a torchrun agent's worker (its child), as tests/tiers/test_peer_tier.py finds it."""
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        for entry in os.listdir("/proc"):
            if entry.isdigit():
                try:
                    stat = Path(f"/proc/{entry}/stat").read_text()
                except OSError:
                    continue
                if int(stat.rsplit(")", 1)[1].split()[1]) == agent:
                    return int(entry)
        time.sleep(0.05)
    raise SystemExit(f"no worker under torchrun agent {agent}")


class Nodes:
    """Two torchrun agents (``--nnodes 2``, one rank each, c10d rendezvous on 127.0.0.1,
    ``--max-restarts 1``), each in a process group of its own, a RAM tier each."""

    def __init__(self, run: Path, root: Path, size: str, sc: Scratch, log: Path):
        self.run, self.root, self.size, self.sc, self.logfile = run, root, size, sc, log
        self.procs: dict[int, subprocess.Popen] = {}
        self.port = free_port()

    def memory(self, node: int) -> Path:
        return self.root / f"node{node}"

    def start(self, node: int) -> None:
        env = {**child_env(self.memory(node)), "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1", "LOGLEVEL": "INFO"}
        argv = [PY, "-m", "torch.distributed.run", "--nnodes", "2", "--nproc-per-node", "1",
                "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{self.port}", "--rdzv-id", "tiers-bench",
                "--max-restarts", "1", *worker_argv(self.run, self.size, MEMORY, self.sc.report)]
        log = open(self.logfile, "a")  # noqa: SIM115 (the agent's output, for as long as it runs)
        self.procs[node] = subprocess.Popen(argv, env=env, stdout=log, stderr=subprocess.STDOUT, cwd=TREE,
                                            start_new_session=True)
        if node == 0:                      # node 0 hosts the rendezvous store: it goes first
            deadline = time.monotonic() + 120
            while not _listening(self.port):
                if self.procs[0].poll() is not None or time.monotonic() > deadline:
                    raise SystemExit(f"node 0 did not start: {self.logfile.read_text()[-3000:]}")
                time.sleep(0.05)

    def kill(self, node: int) -> None:
        worker = _worker_of(self.procs[node].pid)
        os.killpg(self.procs[node].pid, signal.SIGKILL)
        try:
            os.killpg(worker, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self.procs[node].wait()

    def wait(self, timeout: float = 900) -> None:
        for node, proc in self.procs.items():
            if proc.wait(timeout=timeout) != 0:
                raise SystemExit(f"node {node} exited {proc.returncode}: {self.logfile.read_text()[-4000:]}")

    def stop(self) -> None:
        for node, proc in self.procs.items():
            if proc.poll() is None:
                self.kill(node)

    def until(self, kind: str, count: int, timeout: float = 900) -> list[dict[str, Any]]:
        got: list[dict[str, Any]] = []
        deadline = time.monotonic() + timeout
        while len(got) < count:
            got += reports(self.sc.report, kind, self.sc.seen)
            if any(p.poll() not in (None, 0) for p in self.procs.values()) or time.monotonic() > deadline:
                raise SystemExit(f"waiting for {count} {kind} reports: {self.logfile.read_text()[-4000:]}")
            time.sleep(0.05)
        return got


def bench_peer(size: str, reps: int, sc: Scratch) -> dict[str, Any]:
    out: dict[str, Any] = {"setup": [], "peer": [], "own_ram": []}
    for rep in range(reps):
        root = sc.shm / f"{size}-peer-{rep}"
        run, log = sc.disk / f"{size}-peer-run-{rep}", sc.disk / f"{size}-peer-{rep}.log"
        nodes = Nodes(run, root, size, sc, log)
        try:
            print(f"  {LABELS[size]} rep {rep + 1}/{reps}: two nodes, setup", flush=True)
            t = time.time()
            nodes.start(0)
            nodes.start(1)
            docs = nodes.until("setup", 2)
            rid = run_id(run)
            events = [e for e in history_events(run) if e["event"] == "checkpoint"]
            out["setup"].append({
                "seconds": time.time() - t, "rss": {d["rank"]: {k: d[k] for k in status_keys(d)} for d in docs},
                "shm_bytes": {n: du(nodes.memory(n) / rid) for n in (0, 1)},
                "ram_save_stall_s": [e["stall_ms"] / 1e3 for e in events if e.get("tier") == "memory"],
                "durable_save_stall_s": [e["stall_ms"] / 1e3 for e in events if e.get("tier") is None]})
            print(f"  {LABELS[size]} rep {rep + 1}/{reps}: node 1 lost with its RAM, relaunched", flush=True)
            nodes.kill(1)
            shutil.rmtree(nodes.memory(1))
            t0 = time.time()
            nodes.start(1)
            docs = nodes.until("resumed", 2)
            nodes.wait()
            out["peer"].append({**peer_parts(docs, t0, "peer"), **agent_parts(log, nodes.procs[1].pid, t0, docs)})
            print(f"  {LABELS[size]} rep {rep + 1}/{reps}: both nodes relaunched with their RAM", flush=True)
            nodes.port = free_port()
            t0 = time.time()
            nodes.start(0)
            nodes.start(1)
            docs = nodes.until("resumed", 2)
            nodes.wait()
            out["own_ram"].append({**peer_parts(docs, t0, "memory"), **agent_parts(log, nodes.procs[1].pid, t0, docs)})
        finally:
            nodes.stop()
            shutil.rmtree(run, ignore_errors=True)
            shutil.rmtree(root, ignore_errors=True)
    return out


def agent_times(logfile: Path, pid: int) -> dict[str, float]:
    """When torchrun agent ``pid`` logged its start and its completed rendezvous (its INFO lines,
    ``LOGLEVEL=INFO``: ``I1202 14:12:29.345000 PID ...``, local time), as epoch seconds."""
    import datetime
    year = datetime.date.today().year
    out: dict[str, float] = {}
    for line in logfile.read_text(errors="replace").splitlines():
        head = line.split(" ", 3)
        if len(head) < 4 or head[0][:1] != "I" or head[2] != str(pid):
            continue
        for key, text in (("t_agent", "Starting elastic_operator"), ("t_rendezvous", "Rendezvous complete")):
            if key not in out and text in head[3]:
                when = datetime.datetime.strptime(f"{year}{head[0][1:]} {head[1]}", "%Y%m%d %H:%M:%S.%f")
                out[key] = when.timestamp()
    return out


def agent_parts(logfile: Path, pid: int, t0: float, docs: list[dict[str, Any]]) -> dict[str, float]:
    """The launch of node 1's agent until its workers run: the agent's own start (its imports),
    its rendezvous (after a lost node: until the dead node's keep-alive expires), the worker's
    spawn (to the first worker's first statement)."""
    t = agent_times(logfile, pid)
    if len(t) < 2:
        return {}
    first = min(d["t_top"] for d in docs)
    return {"agent_start_s": t["t_agent"] - t0, "rendezvous_s": t["t_rendezvous"] - t["t_agent"],
            "worker_spawn_s": first - t["t_rendezvous"]}


def peer_parts(docs: list[dict[str, Any]], t0: float, expect: str) -> dict[str, Any]:
    tiers = {d["tier"] for d in docs}
    if tiers != {expect} or len({d["start"] for d in docs}) != 1:
        raise SystemExit(f"two-node restart resumed from {tiers}, steps {[d['start'] for d in docs]}; expected {expect}")
    slow = max(docs, key=lambda d: d["t_first_step"])
    return {**parts(slow, t0), "tier": expect, "step": slow["start"],
            "ranks": {d["rank"]: parts(d, t0) for d in docs}}


# ================================================================ main
def tree_identity(tree: Path, hashlib: Any) -> dict[str, Any]:
    """What was measured: the tree, this checkout's commit and its changed package files, and
    the sha256 of the files the RAM tier's behaviour lives in."""
    def git(*a: str) -> str:
        return subprocess.run(["git", *a], cwd=ROOT, capture_output=True, text=True, check=False).stdout.strip()
    files = ("ckptfmt/torch/memtier.py", "ckptfmt/torch/manager.py", "ckptfmt/torch/saver.py", "ckptfmt/torch/peers.py")
    return {"path": str(tree), "checkout_head": git("rev-parse", "HEAD"),
            "checkout_changed": git("status", "--porcelain", "--", "ckptfmt").splitlines(),
            "sha256": {f: hashlib.sha256((tree / f).read_bytes()).hexdigest()[:16] for f in files if (tree / f).exists()},
            "same_as_checkout_head": {f: (tree / f).read_bytes() == subprocess.run(
                ["git", "show", f"HEAD:{f}"], cwd=ROOT, capture_output=True, check=False).stdout for f in files if (tree / f).exists()}}


def main() -> None:
    ap = size_arguments(__doc__, "12m,120m", 3, str(HERE / "results" / "tiers.jsonl"))
    ap.add_argument("--peer-reps", type=int, help="repetitions of the two-node restarts at every size (default: "
                    "--reps at 12.8M, 1 at 120M: one takes about 3 minutes here)")
    ap.add_argument("--stall-reps", type=int, help="repetitions of the stall contenders (default: --reps, at least 5)")
    ap.add_argument("--off-reps", type=int, default=1,
                    help="setup runs with memory_every off and with async_save, for RSS (default 1 of each per size)")
    ap.add_argument("--tree", default=str(ROOT),
                    help="the directory whose ckptfmt package is measured, e.g. a `git archive` of a commit "
                         "(default: this checkout)")
    ap.add_argument("--only", action="append", choices=("stall", "restarts", "peer"),
                    help="only these parts (repeatable; default all)")
    ap.add_argument("--keep-scratch", action="store_true", help="leave the scratch directories (logs) in place")
    ap.add_argument("--worker", help=__import__("argparse").SUPPRESS)
    ap.add_argument("--size", help=__import__("argparse").SUPPRESS)
    ap.add_argument("--memory-every", type=int, default=MEMORY, help=__import__("argparse").SUPPRESS)
    ap.add_argument("--async-save", action="store_true", help=__import__("argparse").SUPPRESS)
    ap.add_argument("--report", help=__import__("argparse").SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        worker(args)
        return
    if args.table:
        print(tables(args.table, "tiers"))
        return
    global TREE
    TREE = Path(args.tree).resolve()
    sys.path.insert(0, str(TREE))
    import hashlib
    import platform

    import torch

    import ckptfmt
    if Path(ckptfmt.__file__).resolve().parent != TREE / "ckptfmt":
        raise SystemExit(f"ckptfmt imported from {ckptfmt.__file__}, not from --tree {TREE}")
    parts_ = args.only or ["stall", "restarts", "peer"]
    def peer_reps(size: str) -> int:
        if args.peer_reps is not None:
            return args.peer_reps
        return min(args.reps, 1) if size == "120m" else args.reps
    started = time.time()
    doc: dict[str, Any] = {
        "command": " ".join(["benchmarks/tiers_bench.py", *sys.argv[1:]]),
        "date": time.strftime("%Y-%m-%dT%H:%M:%S"), "reps": args.reps,
        "peer_reps": {size: peer_reps(size) for size in args.sizes.split(",")},
        "machine": {"cores": os.cpu_count(), "python": platform.python_version(), "torch": torch.__version__,
                    "mem_total_gb": round(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30, 1)},
        "tree": tree_identity(TREE, hashlib), "load_before": os.getloadavg(), "sizes": {}}
    sc = Scratch(args.dir)
    try:
        for size in args.sizes.split(","):
            res: dict[str, Any] = {}
            doc["sizes"][size] = res
            t = time.time()
            if "stall" in parts_:
                print(f"{LABELS[size]}: stall of one save", flush=True)
                res["stall"] = bench_stall(size, args.stall_reps or max(args.reps, 5), sc)
            if "restarts" in parts_:
                res["restarts"] = bench_restarts(size, args.reps, args.off_reps, sc)
            if "peer" in parts_ and peer_reps(size):
                res["peer"] = bench_peer(size, peer_reps(size), sc)
            res["seconds"] = time.time() - t
            res["load_after"] = os.getloadavg()
            print(f"{LABELS[size]}: {res['seconds']:.0f} s, load {res['load_after']}", flush=True)
    finally:
        if args.keep_scratch:
            print(f"scratch kept: {sc.disk} {sc.shm}")
        else:
            sc.close()
    doc.update(load_after=os.getloadavg(), seconds=time.time() - started)
    print(tables(write_results("tiers", doc, args.out)))


if __name__ == "__main__":
    main()
