"""The RAM tier on two "nodes" (spec/RUN.md §13.9): two torchrun launches (``--nnodes 2``, one
rank each, c10d rendezvous on 127.0.0.1, ``--max-restarts`` so a survivor waits for a new round),
one shared run directory, a RAM tier (``CKPTFMT_MEMORY_DIR``) per node, gloo on the CPU. Each
rank's shard is copied to its partner on the other node; a node killed with its RAM tier gone
comes back from its peer's copies, bit-identical to a run never interrupted.

Three failures that leave a survivor happen one after another in one run (``failures``), each
once the previous resume has saved to RAM again, the last one's fallback to disk to a generation
the resumed timeline wrote (so the final generation still depends on every restore); runs whose
two nodes die at once start from copies of one run killed that way (``both_killed``)."""
import json
import os
import shutil
import signal
import time
from pathlib import Path

import pytest

pytest.importorskip("torch")

from ckptfmt.run import Run, tiers  # noqa: E402
from ckptfmt.run import history as hist  # noqa: E402
from ckptfmt.tools.validate import validate_run  # noqa: E402

from conftest import last_step, small_tmpfs  # noqa: E402
from torchrun import FAST_RDZV, TORCHRUN, Job, free_port, kill_tree, workers_of  # noqa: E402

# 2 ranks: never beside another torchrun job; a hang fails in a minute or two, not at the suite's
# 10 (a test takes 6-15 s with the run it copies)
pytestmark = [pytest.mark.xdist_group("torchrun"), pytest.mark.timeout(60)]
N, DURABLE, RAM, KILL = 90, 25, 5, 63
ON_DISK = KILL // DURABLE * DURABLE           # the newest durable generation when a run is killed at KILL


class Nodes:
    """Two torchrun agents on one machine, node 0 hosting the rendezvous store, each agent with
    its worker a process tree of its own (a node's processes die together)."""

    def __init__(self, root: Path):
        self.root, self.run, self.port = root, root / "run", free_port()
        self.jobs: dict[int, Job] = {}

    def memory(self, node: int) -> Path:
        return self.root / f"shm{node}"

    def start(self, node: int, launch: tuple = ()) -> None:
        env = {tiers.MEMORY_ENV: str(self.memory(node)), "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1",
               "OMP_NUM_THREADS": "1"}
        argv_launch = launch or ("--nnodes", "2", "--nproc-per-node", "1", "--rdzv-backend", "c10d", "--rdzv-endpoint",
                                 f"127.0.0.1:{self.port}", "--rdzv-id", "peer-tier", "--max-restarts", "3",
                                 "--rdzv-conf", f"{FAST_RDZV},is_host={int(node == 0)}")
        argv = [*TORCHRUN, *argv_launch, "-m", "ckptfmt.cli", "train", "--run-dir", str(self.run),
                "--config", "tiny", "--steps", str(N), "--checkpoint-every", str(DURABLE), "--memory-every", str(RAM),
                "--sample-every", "0", "--log-every", "100000", "--dist-timeout", "30"]
        self.jobs[node] = Job(argv, self.root / f"node{node}.log", env=env)

    def both(self) -> "Nodes":
        self.start(0)                            # node 0 hosts the store (is_host=1); node 1 connects to it
        self.start(1)
        return self

    def kill(self, node: int) -> None:
        """SIGKILL the node's agent and its worker, as a lost machine."""
        kill_tree(self.jobs[node].pid)
        self.jobs[node].proc.wait()

    def wait(self, timeout: float = 240) -> None:
        for node, job in self.jobs.items():
            assert job.finish(timeout) == 0, self.logs()

    def log(self, node: int) -> str:
        return (self.root / f"node{node}.log").read_text()[-3000:]

    def logs(self) -> str:
        return "".join(f"--- node {node}\n{self.log(node)}\n" for node in self.jobs)

    def wait_for(self, condition, what: str, timeout: float = 120) -> None:
        """Poll ``condition``; fail (with the nodes' logs) if a node's job ends first or ``timeout`` passes."""
        deadline = time.monotonic() + timeout
        while not condition():
            assert all(job.returncode is None for job in self.jobs.values()), self.logs()
            assert time.monotonic() < deadline, f"no {what} in {timeout} s\n{self.logs()}"
            time.sleep(0.01)

    def until(self, step: int) -> int:
        self.wait_for(lambda: last_step(self.run) >= step, f"step {step}")
        return last_step(self.run)

    def resumed(self, count: int) -> dict:
        """The run's ``count``-th resume (waiting until it is in the history)."""
        self.wait_for(lambda: len(resumes(self.run)) >= count, f"resume {count}")
        return resumes(self.run)[count - 1]

    def saved_to_ram_after(self, step: int) -> int:
        """Wait until both nodes hold a RAM generation newer than ``step`` and training is 3 steps
        past it (a kill then falls between two RAM saves, after the tiers' retention); that step."""
        def newest() -> int:                          # the newest RAM step both nodes hold
            return min(max(ram_steps(self, node), default=0) for node in (0, 1))
        self.wait_for(lambda: newest() > step, f"a RAM save after step {step}")
        return self.until(newest() + 3)

    def mark(self) -> dict[int, int]:
        """Where each node's log ends now (``since``: what the nodes logged after)."""
        return {node: (self.root / f"node{node}.log").stat().st_size for node in (0, 1)}

    def since(self, mark: dict[int, int]) -> str:
        return "".join((self.root / f"node{node}.log").read_bytes()[mark[node]:].decode(errors="replace")
                       for node in (0, 1))

    def copy_of(self, other: "Nodes") -> "Nodes":
        """This run directory and these RAM tiers as ``other``'s (its jobs ended)."""
        shutil.copytree(other.run, self.run, symlinks=True)
        for node in (0, 1):
            shutil.copytree(other.memory(node), self.memory(node), symlinks=True)
        return self

    def stop(self) -> None:
        for job in self.jobs.values():
            job.kill()


@pytest.fixture
def nodes(tmp_path):
    made = Nodes(tmp_path)
    yield made
    made.stop()


def durable(run: Path) -> int:
    """The newest committed generation of the run directory (0 before the first)."""
    return max((g.step for g in Run(run).generations() if g.committed), default=0)


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
    made = Nodes(tmp_path_factory.mktemp("straight"))
    try:
        made.both().wait()
    finally:
        made.stop()
    return made.run


@pytest.fixture(scope="module")
def both_killed(tmp_path_factory):
    """A two-node run whose two nodes were killed at once after step KILL: its run directory and
    both RAM tiers as they were left (each test restarts a copy)."""
    made = Nodes(tmp_path_factory.mktemp("both-killed"))
    try:
        made.both().until(KILL)
        made.kill(1)
        made.kill(0)
    finally:
        made.stop()
    return made


@pytest.fixture(scope="module")
def failures(tmp_path_factory):
    """One two-node run through three failures, each after the previous resume saved to RAM
    again: after step KILL one rank's process killed (both agents restart their workers); then
    node 1 lost with its RAM (a replacement joins the survivor's new round); then, once a durable
    generation and a newer RAM one follow that resume, node 1 lost again, its replacement's RAM
    full. Per failure: the resume, what the nodes logged after it, and for the lost node the RAM
    steps it held and the step it was killed at; for the last, the newest durable step then."""
    made = Nodes(tmp_path_factory.mktemp("failures"))
    seen = {}
    try:
        made.both().until(KILL)
        os.kill(workers_of(made.jobs[1].pid)[0], signal.SIGKILL)   # one process, not the node
        seen["rank"] = {"resume": made.resumed(1)}

        killed_at = made.saved_to_ram_after(seen["rank"]["resume"]["step"])
        held, node_0_held, mark = ram_steps(made, 1), ram_steps(made, 0), made.mark()
        made.kill(1)
        shutil.rmtree(made.memory(1))                      # the node's /dev/shm is gone with it
        made.start(1)                                      # the replacement joins the survivor's new round
        seen["node"] = {"resume": made.resumed(2), "held": held, "node_0_held": node_0_held, "killed_at": killed_at}

        made.wait_for(lambda: durable(made.run) > seen["node"]["resume"]["step"], "a durable save after the resume")
        on_disk = durable(made.run)
        made.saved_to_ram_after(on_disk)                   # a RAM generation newer than the disk's: tried first
        seen["node"]["log"], mark = made.since(mark), made.mark()
        made.kill(1)
        shutil.rmtree(made.memory(1))
        with small_tmpfs(made.memory(1)):                  # 64 KiB: no shard fits on node 1
            try:
                made.start(1)
                seen["full"] = {"resume": made.resumed(3), "on_disk": on_disk}
                made.wait()
            finally:
                made.stop()
        seen["full"]["log"] = made.since(mark)
    finally:
        made.stop()
    seen["run"] = made.run
    return seen


@pytest.mark.timeout(150)     # the first of the three makes the straight and the failures' runs (30-40 s)
def test_a_killed_rank_resumes_from_its_own_nodes_ram(failures, straight):
    resume = failures["rank"]["resume"]
    assert resume["tier"] == "memory" and resume["step"] >= KILL - RAM
    assert failures["full"]["resume"]["step"] > resume["step"]    # the final generation descends from this restore
    assert final(failures["run"]) == final(straight)


@pytest.mark.timeout(150)     # the first of the three makes the straight and the failures' runs (30-40 s)
def test_a_node_lost_with_its_ram_comes_back_from_its_peers_copies_bit_identical(failures, straight):
    lost = failures["node"]
    held, resume, killed_at = lost["held"], lost["resume"], lost["killed_at"]
    assert held and held == lost["node_0_held"]          # each node holds every shard: its own and its partner's
    assert resume["tier"] == "peer" and max(held) <= resume["step"] <= killed_at and resume["step"] % RAM == 0
    assert killed_at - resume["step"] <= RAM
    assert "(RAM tier, fetched from a peer node)" in lost["log"], lost["log"][-3000:]
    assert failures["full"]["resume"]["step"] > resume["step"]    # the final generation descends from this restore
    run = failures["run"]
    assert final(run) == final(straight)
    assert canonical(run) == canonical(straight)
    assert validate_run(run).ok


@pytest.mark.timeout(150)     # the first of the three makes the straight and the failures' runs (30-40 s)
def test_a_replacement_whose_ram_is_full_falls_back_to_disk_and_all_ranks_skip_ram_saves_together(failures,
                                                                                                  straight):
    logs, run = failures["full"]["log"], failures["run"]
    assert "not restored, falling back" in logs and "No space left" in logs, logs[-3000:]
    resume, on_disk = failures["full"]["resume"], failures["full"]["on_disk"]
    assert (resume["step"], resume["tier"]) == (on_disk, "disk") and resumes(run)[-1] == resume
    assert f"skipped the save of step {on_disk + RAM}: another rank could not write its shard" in logs, logs[-3000:]
    after = hist.read(run / ".loss.json").events()
    after = after[max(i for i, e in enumerate(after) if e["event"] == "resume"):]
    assert not [e for e in after if e.get("tier") == "memory"]      # no rank saved alone
    assert final(run) == final(straight)


def test_with_every_ram_tier_wiped_the_run_resumes_from_disk(nodes, straight, both_killed):
    nodes.copy_of(both_killed)
    for node in (0, 1):
        shutil.rmtree(nodes.memory(node))                  # what a reboot of both does
    nodes.both()
    nodes.wait()
    assert [(r["step"], r["tier"]) for r in resumes(nodes.run)][-1] == (ON_DISK, "disk")
    assert final(nodes.run) == final(straight)


def test_a_ram_generation_damaged_on_every_node_is_skipped_with_its_reason(nodes, straight, both_killed):
    nodes.copy_of(both_killed)
    newest, older = ram_steps(nodes, 0)[-1], ram_steps(nodes, 0)[0]
    assert ON_DISK < older < newest and ram_steps(nodes, 1) == [older, newest]     # the older one only in RAM
    for node in (0, 1):                                    # shard 0, one flipped bit, on both nodes
        shard = nodes.memory(node) / tiers.run_id(nodes.run) / f"step_{newest:06d}.shards" / "00000-of-00002.bin"
        data = bytearray(shard.read_bytes())
        data[1000] ^= 1
        shard.write_bytes(bytes(data))
    nodes.both()
    nodes.wait()
    logs = nodes.log(0) + nodes.log(1)
    assert f"skipping RAM generation {newest}: step_{newest:06d}.shards/00000-of-00002.bin fails blake3" in logs, \
        nodes.logs()
    assert (resumes(nodes.run)[-1]["step"], resumes(nodes.run)[-1]["tier"]) == (older, "memory")
    assert final(nodes.run) == final(straight)


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
