"""The fault matrix: each tier x each part of the newest generation x each fault, with what must
follow (spec/RELIABILITY.md "Fault matrix").

A run of a checkpoint manager (a model with BatchNorm buffers, so each generation has a companion;
AdamW; a StepLR schedule) commits generations 10, 20 and 30. One part of generation 30 (in the RAM
tier: RAM generation 25) gets one fault: one bit flipped at a random offset, truncated to a random
length (one that changes the content: a manifest without its last newline is the same JSON
document), deleted, replaced by the same part of generation 20 ("another generation of the same
run"), or by the same part of a step 30 that a lost timeline committed (the run resumed at 20 and
trained on other data). Then:

- ``validate`` exits 1 naming the damaged generation's file, except where the fault leaves what a
  crash leaves (a deleted manifest: an uncommitted generation, as an interrupted retention leaves
  it; a warning naming it);
- a restore passes over it to the newest intact generation (20 on disk), never loads it, and the
  run, trained on from there, commits a step 30 whose payload is byte-identical to the true one;
- at a mirror: ``validate URL`` exits 1 naming the step, ``import`` restores the newest intact
  generation and the run goes on from it bit-exactly, and a mirror pass from the intact run
  repairs the destination.

CI runs a sample (each fault once per tier, the parts taken in turn, one offset); the long tier
(RELIABILITY_SCALE=long) runs every combination at several offsets and prints the counts.
"""
from __future__ import annotations

import json
import random
import shutil
import warnings
from pathlib import Path
from types import SimpleNamespace

import pytest

torch = pytest.importorskip("torch")

from ckptfmt.run import Policy, tiers  # noqa: E402
from ckptfmt.tools.convert import convert  # noqa: E402
from ckptfmt.torch import CheckpointManager  # noqa: E402
from ckptfmt.run.mirror import mirror  # noqa: E402
from ckptfmt.tools.remote_check import validate_url  # noqa: E402
from ckptfmt.tools.restore import restore  # noqa: E402
from ckptfmt.tools.validate import validate_run  # noqa: E402
from conftest import cli  # noqa: E402
from faults import LONG, scale  # noqa: E402
from s3server import fixtures  # noqa: E402

SUFFIX = {"payload": ".bin", "shard": ".shards/00001-of-00002.bin", "manifest": ".json",
          "companion": ".extra.safetensors"}
PARTS = ("payload", "manifest", "companion")          # of a generation as one .bin
SHARDED = ("shard", "manifest", "companion")          # of a sharded generation (two shards)
FAULTS = ("flip", "truncate", "delete", "other_generation", "lost_timeline")
WHOLE = ("other_generation", "lost_timeline")   # faults of the whole generation: every file replaced
OFFSETS = scale(1, 8)                       # random offsets (or lengths) per flip and truncation


def cases(tier: str) -> list[tuple[str, str]]:
    """(part, fault) of ``tier``: all of them in the long tier; in CI each fault once, the parts
    taken in turn (a different part first in each tier), and a whole generation of a lost
    timeline (each file matches its own digests: only the history's root digest tells)."""
    parts = SHARDED if tier == "sharded" else PARTS
    everything = [(part, fault) for part in parts for fault in FAULTS] + [("generation", f) for f in WHOLE]
    if LONG:
        return everything
    shift = {"disk": 0, "sharded": 0, "memory": 1, "mirror": 2}[tier]
    return [(parts[(i + shift) % len(parts)], fault) for i, fault in enumerate(FAULTS)] + \
        [("generation", "lost_timeline")]


def files(part: str, layout: tuple[str, ...] = PARTS) -> list[str]:
    """The parts a fault of ``part`` touches: one, or every part of the generation."""
    return list(layout) if part == "generation" else [part]


def model_and_optimizer():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.BatchNorm1d(4), torch.nn.Linear(4, 1))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    return model, opt, torch.optim.lr_scheduler.StepLR(opt, 7, gamma=0.5)


def batch(step: int, timeline: int = 0) -> torch.Tensor:
    return torch.randn(8, 3, generator=torch.Generator().manual_seed(step + 1000 * timeline))


def train(run: Path, last: int, *, timeline: int = 0, memory_every: int | None = None,
          async_save: bool = False, keep_ram: Path | None = None) -> int:
    """Restore the run (latest-valid) and train it to step ``last``, committing every 10 steps
    under a retention that keeps every 20th step, so the newest generation is kept only as the
    newest valid one (a step 30 committed again after a fallback must survive its retention);
    the step it resumed from. ``keep_ram``: the RAM tier copied there (merged) before the close,
    which removes the RAM generations the durable step covers, as a run killed at ``last``
    would have left it."""
    model, opt, sched = model_and_optimizer()
    with CheckpointManager(run, model, opt, sched, every=10, retention=Policy(keep_every=20), handle_signals=False,
                           memory_every=memory_every, async_save=async_save, log=lambda message: None) as mgr:
        start = mgr.restore()
        for step in range(start + 1, last + 1):
            loss = model(batch(step, timeline)).square().mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
            sched.step()
            mgr.step(step, loss=loss.item())
        if keep_ram is not None:
            shutil.copytree(tiers.memory_dir(run), keep_ram, dirs_exist_ok=True)
    return start


def name(step: int, part: str) -> str:
    return f"step_{step:06d}{SUFFIX[part]}"


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """The true run (generations 10, 20, 30; RAM generations 15 and 25 between them, as the two
    trainings killed at their last step leave them) and a lost timeline (resumed at 20, trained on
    other data, its own RAM tier), each RAM tier in its own root."""
    root = tmp_path_factory.mktemp("matrix")
    base, lost = root / "base", root / "lost"
    with pytest.MonkeyPatch.context() as env:
        env.setenv(tiers.MEMORY_ENV, str(root / "live-ram"))
        train(base, 20, memory_every=5, keep_ram=root / "kept")
        shutil.copytree(base, lost)
        train(base, 30, memory_every=5, keep_ram=root / "kept")
        env.setenv(tiers.MEMORY_ENV, str(root / "live-ram-lost"))
        train(lost, 30, timeline=1, memory_every=5, keep_ram=root / "kept-lost")
    run_id = tiers.run_id(base)
    for kept, ram in ((root / "kept", root / "ram" / run_id), (root / "kept-lost", root / "ram-lost" / run_id)):
        for older in kept.glob("step_000005*"):      # the RAM tier's own retention keeps two
            older.unlink()
        shutil.copytree(kept, ram)
    sharded, lost_sharded = root / "sharded", root / "lost-sharded"   # 20 and 30 as two shards each
    shutil.copytree(base, sharded)
    lost_sharded.mkdir()
    for step in (20, 30):
        as_shards(sharded, base, step)
    as_shards(lost_sharded, lost, 30)
    return SimpleNamespace(base=base, lost=lost, ram=root / "ram" / run_id, lost_ram=root / "ram-lost" / run_id,
                           sharded=sharded, lost_sharded=lost_sharded)


def as_shards(run: Path, source: Path, step: int) -> None:
    """Generation ``step`` of ``source`` in ``run`` as a sharded generation (``convert --to
    shards``: two shards, the companion beside them), in place of its ``.bin``."""
    for part in PARTS:
        (run / name(step, part)).unlink(missing_ok=True)
    convert(str(source / name(step, "payload")), str(run), to="shards")


def fault_file(target: Path, fault: str, rng: random.Random, *, same_run: Path, lost: Path) -> None:
    """Apply ``fault`` to the file ``target`` (``same_run``: generation 20's part of the same
    kind; ``lost``: the lost timeline's step 30 part of the same kind)."""
    if fault == "flip":
        data = bytearray(target.read_bytes())
        data[rng.randrange(len(data))] ^= 1 << rng.randrange(8)
        target.write_bytes(bytes(data))
    elif fault == "truncate":
        data = target.read_bytes()
        cut = len(data) - 1 if data.endswith(b"\n") else len(data)
        target.write_bytes(data[:rng.randrange(cut)])
    elif fault == "delete":
        target.unlink()
    elif fault == "other_generation":
        target.write_bytes(same_run.read_bytes())
    else:
        target.write_bytes(lost.read_bytes())


def base_payload(base: Path) -> bytes:
    return (base / name(30, "payload")).read_bytes()


def run_cases(tier: str):
    return [pytest.param(part, fault, id=f"{part}-{fault}") for part, fault in cases(tier)]


@pytest.mark.parametrize("layout, part, fault", [pytest.param("bin", *c.values, id=f"bin-{c.id}")
                                                 for c in run_cases("disk")]
                         + [pytest.param("sharded", *c.values, id=f"sharded-{c.id}") for c in run_cases("sharded")])
def test_a_fault_in_a_part_of_the_newest_generation_on_disk(runs, tmp_path, monkeypatch, layout, part, fault):
    """On disk, a generation as one ``.bin`` or as two shards: validate names the damage, the
    restore passes it over to 20 and the run ends bit-exact (and validates: the damaged
    generation is replaced)."""
    monkeypatch.setenv(tiers.MEMORY_ENV, str(tmp_path / "no-ram"))        # the disk tier alone
    source, lost, parts = ((runs.base, runs.lost, PARTS) if layout == "bin"
                           else (runs.sharded, runs.lost_sharded, SHARDED))
    for offset in range(OFFSETS if fault in ("flip", "truncate") else 1):
        run = tmp_path / f"run{offset}"
        shutil.copytree(source, run)
        for p in files(part, parts):
            fault_file(run / name(30, p), fault, random.Random(offset), same_run=source / name(20, p),
                       lost=lost / name(30, p))
        report = validate_run(run)
        said = [f.message for f in report.findings if f.level in ("defect", "warning")]
        if (part, fault) == ("manifest", "delete"):         # an uncommitted generation, as a crash leaves it
            assert report.ok and any("step_000030." in m and ("uncommitted" in m or "without a manifest" in m)
                                     for m in said), said
        else:
            assert not report.ok and any("step_000030." in m for m in said), said
        assert train(run, 30, async_save=True) == 20, (part, fault, offset)    # passed over, never loaded
        assert (run / name(30, "payload")).read_bytes() == base_payload(runs.base), (part, fault, offset)
        assert validate_run(run).ok and not (run / "step_000030.shards").exists()
        assert train(run, 30) == 30, (part, fault, offset)                 # and the next start takes it
        if LONG:
            print(f"FIGURE fault matrix disk {layout} {part} {fault} offset {offset}: detected, resumed from 20, "
                  "bit-exact")


@pytest.mark.parametrize("part, fault", run_cases("memory"))
def test_a_fault_in_a_part_of_the_newest_ram_generation(runs, tmp_path, monkeypatch, part, fault):
    """The durable step 30 gone and RAM generation 25, the newest in any tier, damaged: ``ls``
    shows it not valid (--deep: hashed), ``validate`` names it (exit 1), the restore takes disk generation 20 (the newest intact one in any tier,
    RAM 15 being older) and the run ends bit-exact."""
    monkeypatch.setenv(tiers.MEMORY_ENV, str(tmp_path / "ram"))
    for offset in range(OFFSETS if fault in ("flip", "truncate") else 1):
        run = tmp_path / f"run{offset}"
        shutil.copytree(runs.base, run)
        for p in PARTS:
            (run / name(30, p)).unlink()
        ram = tiers.memory_dir(run)
        shutil.rmtree(ram, ignore_errors=True)
        shutil.copytree(runs.ram, ram)
        for p in files(part):
            fault_file(ram / name(25, p), fault, random.Random(offset), same_run=ram / name(15, p),
                       lost=runs.lost_ram / name(25, p))
        proc = cli("ls", str(run), "--json", "--deep")
        assert proc.returncode == 0, proc.stderr
        row = {g["step"]: g for g in json.loads(proc.stdout)["tiers"]["memory"]["generations"]}[25]
        assert not row["valid"], row
        done = cli("validate", str(run))                 # the tier a restore reads: its damage is the run's
        if row["status"].startswith("damaged"):          # a deleted manifest: an uncommitted leftover, no damage
            assert done.returncode == 1 and f"{ram}/step_000025" in done.stdout and "(the RAM tier)" in done.stdout, \
                done.stdout
        assert train(run, 30, memory_every=5) == 20, (part, fault, offset)
        assert (run / name(30, "payload")).read_bytes() == base_payload(runs.base), (part, fault, offset)
        if LONG:
            print(f"FIGURE fault matrix memory {part} {fault} offset {offset}: passed over, resumed from 20, bit-exact")


s3, bucket = fixtures("matrix")


def fault_object(s3, bucket: str, key: str, fault: str, rng: random.Random, tmp: Path, *, same_run: Path,
                 lost: Path) -> None:
    """``fault_file`` on an object at the mirror: read with boto3, damaged, written back."""
    client = s3.client()
    if fault == "delete":
        client.delete_object(Bucket=bucket, Key=key)
        return
    local = tmp / "object"
    local.write_bytes(client.get_object(Bucket=bucket, Key=key)["Body"].read())
    fault_file(local, fault, rng, same_run=same_run, lost=lost)
    client.put_object(Bucket=bucket, Key=key, Body=local.read_bytes())


@pytest.mark.parametrize("part, fault", run_cases("mirror"))
def test_a_fault_in_a_part_of_the_newest_mirrored_generation(runs, s3, bucket, tmp_path, monkeypatch, part, fault):
    """At the mirror: validate URL exits 1 naming step 30 (a deleted manifest leaves an
    uncommitted upload: a warning), import restores generation 20 and the run goes on from it
    bit-exactly, and a mirror pass from the intact run repairs the destination."""
    monkeypatch.setenv(tiers.MEMORY_ENV, str(tmp_path / "no-ram"))
    source = tmp_path / "source"                   # mirroring records itself in the run (.mirrors.json)
    shutil.copytree(runs.base, source)
    for offset in range(OFFSETS if fault in ("flip", "truncate") else 1):
        url = f"s3://{bucket}/m{offset}"
        assert mirror(source, url)["at_destination"] == [20, 30]
        for p in files(part):
            fault_object(s3, bucket, f"m{offset}/{name(30, p)}", fault, random.Random(offset), tmp_path,
                         same_run=runs.base / name(20, p), lost=runs.lost / name(30, p))
        checked = {g["step"]: g for g in validate_url(url)["generations"]}
        if (part, fault) == ("manifest", "delete"):
            assert checked[30]["ok"] and checked[30].get("warning"), checked[30]
        else:
            assert not checked[30]["ok"], checked[30]
        dest = tmp_path / f"back{offset}"
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")          # "skipping generation 30: ..."
            assert restore(url, dest)["step"] == 20, (part, fault, offset)
        assert train(dest, 30) == 20
        assert (dest / name(30, "payload")).read_bytes() == base_payload(runs.base), (part, fault, offset)
        mirror(source, url, recheck=True)
        assert validate_url(url)["ok"], (part, fault, offset)
        if LONG:
            print(f"FIGURE fault matrix mirror {part} {fault} offset {offset}: detected, imported 20, bit-exact, repaired")
