"""The RAM tier on two "nodes" (spec/RUN.md §13.9): two torchrun launches (``--nnodes 2``, one
rank each, c10d rendezvous on 127.0.0.1, ``--max-restarts 1`` so a survivor waits for a new
round), one shared run directory, a RAM tier (``CKPTFMT_MEMORY_DIR``) per node, gloo on the CPU.
Each rank's shard is copied to its partner on the other node; a node killed with its RAM tier
gone comes back from its peer's copies, bit-identical to a run never interrupted."""
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytest.importorskip("torch")

from ckptfmt.run import Run, tiers  # noqa: E402
from ckptfmt.run import history as hist  # noqa: E402
from ckptfmt.tools.validate import validate_run  # noqa: E402

from conftest import last_step, small_tmpfs  # noqa: E402

pytestmark = pytest.mark.xdist_group("torchrun")   # 2 ranks: never beside another torchrun job
PY = sys.executable
N, DURABLE, RAM, KILL = 120, 50, 5, 73


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Nodes:
    """Two torchrun agents, each a process group of its own (a node's processes die together)."""

    def __init__(self, run: Path, root: Path):
        self.run, self.root, self.port = run, root, free_port()
        self.procs: dict[int, subprocess.Popen] = {}

    def memory(self, node: int) -> Path:
        return self.root / f"shm{node}"

    def start(self, node: int, launch: tuple = ()) -> None:
        env = {**os.environ, tiers.MEMORY_ENV: str(self.memory(node)), "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1",
               "OMP_NUM_THREADS": "1"}
        argv_launch = launch or ("--nnodes", "2", "--nproc-per-node", "1", "--rdzv-backend", "c10d", "--rdzv-endpoint",
                            f"127.0.0.1:{self.port}", "--rdzv-id", "peer-tier", "--max-restarts", "1")
        argv = [PY, "-m", "torch.distributed.run", *argv_launch, "-m", "ckptfmt.cli", "train", "--run-dir", str(self.run),
                "--config", "tiny", "--steps", str(N), "--checkpoint-every", str(DURABLE), "--memory-every", str(RAM),
                "--sample-every", "0", "--log-every", "100000"]
        log = open(self.root / f"node{node}.log", "a")
        self.procs[node] = subprocess.Popen(argv, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        if node == 0 and not launch:            # node 0 hosts the rendezvous store: it goes first
            deadline = time.monotonic() + 60
            while not _listening(self.port):
                assert self.procs[0].poll() is None and time.monotonic() < deadline, self.log(0)
                time.sleep(0.1)

    def both(self) -> "Nodes":
        self.start(0)
        self.start(1)
        return self

    def kill(self, node: int) -> None:
        """SIGKILL the node's agent and its worker, as a lost machine (torchrun starts each
        worker in a session of its own)."""
        workers = _workers_of(self.procs[node].pid)
        os.killpg(self.procs[node].pid, signal.SIGKILL)
        for worker in workers:
            os.killpg(worker, signal.SIGKILL)
        self.procs[node].wait()

    def wait(self, timeout: float = 400) -> None:
        for node, proc in self.procs.items():
            assert proc.wait(timeout=timeout) == 0, self.log(node)

    def log(self, node: int) -> str:
        return (self.root / f"node{node}.log").read_text()[-3000:]

    def until(self, step: int, timeout: float = 300) -> int:
        deadline = time.monotonic() + timeout
        while last_step(self.run) < step:
            assert all(p.poll() is None for p in self.procs.values()), self.log(0) + self.log(1)
            assert time.monotonic() < deadline
            time.sleep(0.01)
        return last_step(self.run)

    def stop(self) -> None:
        for node, proc in self.procs.items():
            if proc.poll() is None:
                self.kill(node)


def _listening(port: int) -> bool:
    with socket.socket() as s:
        return s.connect_ex(("127.0.0.1", port)) == 0


@pytest.fixture
def nodes(tmp_path):
    made = Nodes(tmp_path / "run", tmp_path)
    yield made
    made.stop()


def ram_steps(nodes: Nodes, node: int) -> list[int]:
    where = nodes.memory(node) / tiers.run_id(nodes.run)
    return sorted(g.step for g in Run(where).generations() if g.committed) if where.is_dir() else []


def resumes(run: Path) -> list[dict]:
    return [e for e in hist.read(run / ".loss.json").events() if e["event"] == "resume"]


def final(run: Path) -> list[str]:
    doc = json.loads((run / f"step_{N:06d}.json").read_text())
    return [doc["blake3"]] + [r["blake3"] for r in doc["shards"]]


def canonical(run: Path) -> list[dict]:
    keep = ("step", "loss", "loss_ema", "lr")
    return [{k: r[k] for k in keep} for r in hist.read(run / ".loss.json").canonical()]


@pytest.fixture(scope="module")
def straight(tmp_path_factory):
    """The same two-node run, never interrupted."""
    root = tmp_path_factory.mktemp("straight")
    made = Nodes(root / "run", root).both()
    try:
        made.wait()
    finally:
        made.stop()
    return made.run


def test_a_node_lost_with_its_ram_comes_back_from_its_peers_copies_bit_identical(nodes, straight):
    nodes.both()
    killed_at = nodes.until(KILL)
    held = ram_steps(nodes, 1)
    assert held and held == ram_steps(nodes, 0)           # each node holds every shard: its own and its partner's
    nodes.kill(1)
    shutil.rmtree(nodes.memory(1))                         # the node's /dev/shm is gone with it
    nodes.start(1)                                         # the replacement joins the survivor's new round
    nodes.wait()
    resume = resumes(nodes.run)[-1]
    assert resume["tier"] == "peer" and max(held) <= resume["step"] <= killed_at and resume["step"] % RAM == 0
    assert killed_at - resume["step"] <= RAM
    assert "(RAM tier, fetched from a peer node)" in nodes.log(0) + nodes.log(1)
    assert final(nodes.run) == final(straight)
    assert canonical(nodes.run) == canonical(straight)
    assert validate_run(nodes.run).ok


def test_a_replacement_whose_ram_is_full_falls_back_to_disk_and_all_ranks_skip_ram_saves_together(nodes, straight):
    nodes.both()
    nodes.until(KILL)
    nodes.kill(1)
    shutil.rmtree(nodes.memory(1))
    with small_tmpfs(nodes.memory(1)):                     # 64 KiB: no shard fits on node 1
        nodes.start(1)
        nodes.wait()
    logs = nodes.log(0) + nodes.log(1)
    assert "not restored, falling back" in logs and "No space left" in logs
    assert [(r["step"], r["tier"]) for r in resumes(nodes.run)][-1] == (DURABLE, "disk")
    assert "skipped the save of step 55: another rank could not write its shard" in nodes.log(0) + nodes.log(1)
    after = hist.read(nodes.run / ".loss.json").events()
    after = after[max(i for i, e in enumerate(after) if e["event"] == "resume"):]
    assert not [e for e in after if e.get("tier") == "memory"]      # no rank saved alone
    assert final(nodes.run) == final(straight)


def test_a_killed_rank_resumes_from_its_own_nodes_ram(nodes, straight):
    nodes.both()
    nodes.until(KILL)
    os.kill(_workers_of(nodes.procs[1].pid)[0], signal.SIGKILL)                        # one process, not the node: both agents restart
    nodes.wait()
    resume = resumes(nodes.run)[-1]
    assert resume["tier"] == "memory" and resume["step"] >= KILL - RAM
    assert final(nodes.run) == final(straight)


def test_with_every_ram_tier_wiped_the_run_resumes_from_disk(nodes, straight):
    nodes.both()
    nodes.until(KILL)
    nodes.kill(1)
    nodes.kill(0)
    for node in (0, 1):
        shutil.rmtree(nodes.memory(node))                  # what a reboot of both does
    nodes.both()
    nodes.wait()
    assert [(r["step"], r["tier"]) for r in resumes(nodes.run)][-1] == (DURABLE, "disk")
    assert final(nodes.run) == final(straight)


def test_a_ram_generation_damaged_on_every_node_is_skipped_with_its_reason(nodes, straight):
    nodes.both()
    nodes.until(KILL)
    nodes.kill(1)
    nodes.kill(0)
    newest, older = ram_steps(nodes, 0)[-1], ram_steps(nodes, 0)[0]
    for node in (0, 1):                                    # shard 0, one flipped bit, on both nodes
        shard = nodes.memory(node) / tiers.run_id(nodes.run) / f"step_{newest:06d}.shards" / "00000-of-00002.bin"
        data = bytearray(shard.read_bytes())
        data[1000] ^= 1
        shard.write_bytes(bytes(data))
    nodes.both()
    nodes.wait()
    logs = nodes.log(0) + nodes.log(1)
    assert f"skipping RAM generation {newest}: step_{newest:06d}.shards/00000-of-00002.bin fails blake3" in logs
    assert (resumes(nodes.run)[-1]["step"], resumes(nodes.run)[-1]["tier"]) == (older, "memory")
    assert final(nodes.run) == final(straight)


def _workers_of(agent: int) -> list[int]:
    """The PIDs of the torchrun agent's workers (its children running the trainer)."""
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        found = []
        for entry in os.listdir("/proc"):
            if entry.isdigit():
                try:
                    stat = open(f"/proc/{entry}/stat").read()
                except OSError:
                    continue
                if int(stat.rsplit(")", 1)[1].split()[1]) == agent:
                    found.append(int(entry))
        if found:
            return found
        time.sleep(0.05)
    raise AssertionError(f"no worker under agent {agent}")


def test_one_node_of_two_ranks_shares_its_ram_tier_and_resumes_from_it(nodes, straight):
    """Both ranks on one node: both shards in one tier, no partner; the same trajectory as on two nodes."""
    one_node = ("--standalone", "--nproc-per-node", "2")
    nodes.start(0, one_node)
    nodes.until(KILL)
    held = ram_steps(nodes, 0)
    nodes.kill(0)
    nodes.start(0, one_node)
    nodes.wait()
    resume = resumes(nodes.run)[-1]
    assert resume["tier"] == "memory" and resume["step"] == max(held) >= KILL - RAM
    assert final(nodes.run) == final(straight)
