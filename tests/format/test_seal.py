"""The manifest's seal (spec/FORMAT.md §4.7): every byte of a manifest a resume depends on is
covered. A flipped bit anywhere in a real manifest (the manager's, with its scheduler and RNG
states; a sharded generation's) is damage that validate names and a restore passes over, unless
the flipped file still holds the very same JSON values; equal values seal the same whatever their
spelling; manifests written before the seal, or rewritten by a released ckptfmt, are not damaged
and say what is not self-checked."""
from __future__ import annotations

import json
import random
import shutil
from pathlib import Path

import pytest

import ckptfmt
from ckptfmt import manifest as mf
from ckptfmt import kinds, seal
from ckptfmt.errors import ManifestError, ManifestSealError, UnsupportedVersionError
from conftest import cli, make
from faults import scale

GOLDEN = Path(__file__).resolve().parents[1] / "golden"


@pytest.fixture(scope="module")
def manager_run(tmp_path_factory):
    """Two generations of the manager with a scheduler and RNG states (steps 3 and 6)."""
    torch = pytest.importorskip("torch")
    from ckptfmt.torch import CheckpointManager
    from models import tiny_adamw, train_steps
    path = tmp_path_factory.mktemp("manager") / "run"
    model, opt = tiny_adamw()
    sched = torch.optim.lr_scheduler.StepLR(opt, 2, gamma=0.5)
    with CheckpointManager(path, model, opt, scheduler=sched, every=3, handle_signals=False,
                           config={"weight_decay": 0.1}) as m:
        m.restore()
        for step in range(1, 7):
            train_steps(model, opt, 1)
            sched.step()
            m.step(step)
    return path


def flipped(data: bytes, bit: int) -> bytes:
    out = bytearray(data)
    out[bit // 8] ^= 1 << (bit % 8)
    return bytes(out)


def same_values(a: bytes, b: bytes) -> bool:
    """The flipped file holds the same JSON values as the original (a flip from 'e' to 'E' in an
    exponent, say): nothing a reader could be told differs."""
    try:
        return json.loads(a) == json.loads(b)
    except ValueError:
        return False


def parses(data: bytes) -> bool:
    try:
        json.loads(data)
        return True
    except ValueError:
        return False


def bits_to_try(data: bytes, count: int) -> list[int]:
    """Every bit of the seal's own name, the version field, the payload's name (and, sharded, the
    first shard's row: its name and a count of its facts), and ``count`` more at random."""
    text = data.decode()
    aimed = []
    needles = ['"seal"', '"format_version": 1', '"file": "step_']
    if '"shards"' in text:                             # a shard's row: its name and its facts
        needles += ['"file": "00000-of', '"non_finite": 0']
    for needle in needles:
        at = text.index(needle, text.index('"shards"') if needle == '"non_finite": 0' else 0)
        aimed += range(at * 8, (at + len(needle) + 12) * 8)
    return aimed + random.Random(len(data)).sample(range(len(data) * 8), min(count, len(data) * 8))


@pytest.mark.parametrize("kind", ["manager", "sharded"])
def test_a_flipped_bit_anywhere_in_a_manifest_is_damage_that_validate_names(manager_run, tmp_path, kind):
    run = tmp_path / "run"
    if kind == "manager":
        shutil.copytree(manager_run, run)
    else:
        assert cli("convert", manager_run / "step_000006.bin", run, "--to", "shards").returncode == 0
    path = run / "step_000006.json"
    good = path.read_bytes()
    assert json.loads(good)["seal"]["fields"]
    tried = caught = 0
    for bit in bits_to_try(good, scale(300, 20_000)):
        bad = flipped(good, bit)
        path.write_bytes(bad)
        report = ckptfmt.validate(run)
        if same_values(good, bad):
            continue
        tried += 1
        assert not report.ok, f"bit {bit} ({bad[bit // 8 - 10:bit // 8 + 10]!r}) passed validate"
        assert any(str(path) in f.message for f in report.findings), (bit, [f.message for f in report.findings])
        caught += 1
    path.write_bytes(good)
    assert ckptfmt.validate(run).ok
    print(f"FIGURE manifest bit flips ({kind}): {tried} tried, {caught} detected")
    assert tried > 250 or tried > scale(0, 15_000)


def test_a_restore_never_resumes_from_a_flipped_manifest(manager_run, tmp_path):
    torch = pytest.importorskip("torch")
    from ckptfmt.torch import CheckpointManager
    from models import tiny_adamw
    run = tmp_path / "run"
    shutil.copytree(manager_run, run)
    path = run / "step_000006.json"
    good = path.read_bytes()
    for bit in random.Random(7).sample(range(len(good) * 8), scale(12, 400)):
        bad = flipped(good, bit)
        if same_values(good, bad):
            continue
        path.write_bytes(bad)
        model, opt = tiny_adamw()
        sched = torch.optim.lr_scheduler.StepLR(opt, 2, gamma=0.5)
        with pytest.warns(UserWarning, match="step_000006|skipping generation 6"):
            with CheckpointManager(run, model, opt, scheduler=sched, every=3, handle_signals=False,
                                   config={"weight_decay": 0.1}) as m:
                assert m.restore() == 3, f"bit {bit}: resumed from the flipped generation"
                assert sched.last_epoch == 3
                m.close()
    path.write_bytes(good)


def test_a_flipped_format_version_is_damage_not_a_newer_format(manager_run, tmp_path):
    run = tmp_path / "run"
    shutil.copytree(manager_run, run)
    path = run / "step_000006.json"
    path.write_text(path.read_text().replace('"format_version": 1', '"format_version": 3'))
    with pytest.raises(ManifestSealError):
        mf.read(path)
    result = cli("validate", path.with_suffix(".bin"))
    assert result.returncode == 1 and "field 'format_version' does not match the manifest's seal" in result.stdout + result.stderr
    genuinely_newer = mf.sealed({**json.loads((manager_run / "step_000006.json").read_text()), "format_version": 3})
    path.write_text(json.dumps(genuinely_newer))
    with pytest.raises(UnsupportedVersionError):
        mf.read(path)


def test_a_seal_renamed_by_one_bit_is_damage_not_an_older_manifest(manager_run, tmp_path):
    path = tmp_path / "step_000006.json"
    shutil.copy(manager_run / "step_000006.json", path)
    path.write_text(path.read_text().replace('"seal"', '"seam"'))
    with pytest.raises(ManifestSealError, match="'seam' holds a manifest seal"):
        mf.read(path)


def test_equal_values_seal_alike_whatever_their_spelling():
    doc = seal.apply({"format": "ckptfmt", "lr": 0.001, "betas": [0.9, 0.999], "n": 3, "x": 1.0, "s": "é"})
    respelled = ('{"x": 1, "s": "\\u00e9", "seal": %s, "n": 3.0,\n\t"betas": [9e-1, 0.999],\r\n'
                 '"lr": 1E-3, "format": "ckptfmt"}' % json.dumps(doc["seal"]))
    assert seal.check("m.json", json.loads(respelled)) is None
    with pytest.raises(ManifestSealError, match="field 'lr' does not match"):
        seal.check("m.json", {**json.loads(respelled), "lr": 0.0010000000000000002})


def test_a_manifest_written_before_the_seal_loads_and_says_it_is_not_self_checked():
    bin_path = GOLDEN / "v1" / "bin" / "step_000007.bin"
    with ckptfmt.open(bin_path, verify=True) as ck:
        assert ck.step == 7
    result = cli("validate", bin_path)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "manifest not self-checked (written by an older ckptfmt)" in result.stdout


@pytest.mark.parametrize("rewrite, note", [
    ("fork", "self-checked but for provenance, added later by a writer that did not know the seal"),
    ("shards", "self-checked but for its payload fields, rewritten for a new payload by a writer that did "
               "not know the seal"),
    ("joined", "self-checked but for consolidated_from, added later by a writer that did not know the seal"),
])
def test_a_manifest_rewritten_by_the_released_ckptfmt_is_not_damaged(rewrite, note):
    """tests/golden/sealed: a sealed generation forked, converted to shards and joined again by
    ckptfmt 0.1.0, which copied the seal without knowing it (make_sealed.py)."""
    run = GOLDEN / "sealed" / rewrite
    doc = mf.read(run / "step_000009.json")
    assert doc["seal"] == mf.read(GOLDEN / "sealed" / "run" / "step_000009.json")["seal"]
    assert mf.self_checked("m", doc) == (None if note is None else "manifest " + note + " (not covered)")
    result = cli("validate", run)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "OK (verified)" in result.stdout
    assert (note in result.stdout) if note else "warning" not in result.stdout


def test_the_shard_rows_of_a_released_split_are_bound_by_the_sealed_facts(tmp_path):
    """A released split wrote its rows outside the seal; each row's facts must add up to the
    generation's sealed facts, so a flipped count in a row is damage there too."""
    run = tmp_path / "shards"
    shutil.copytree(GOLDEN / "sealed" / "shards", run)
    path = run / "step_000009.json"
    doc = json.loads(path.read_text())
    doc["shards"][0]["facts"]["m"]["non_finite"] = 1
    path.write_text(json.dumps(doc))
    with pytest.raises(ManifestError, match="do not add up"):
        mf.read(path)
    assert not ckptfmt.validate(run).ok


def test_a_field_added_outside_the_seal_is_damage_and_named(manager_run):
    """Only what a released writer adds to a copied seal may stand outside it: a field slipped in
    later (a scheduler would be resumed) is damage, named; so is a payload field changed while
    ``file`` stays (a flip in a shard's row, say), where a released split or join changes ``file``."""
    doc = mf.read(manager_run / "step_000006.json")
    without = {k: v for k, v in doc.items() if k != "scheduler"}
    slipped_in = {**without, "seal": seal.apply(without)["seal"], "scheduler": doc["scheduler"]}
    with pytest.raises(ManifestSealError, match="field 'scheduler' is not covered by the manifest's seal"):
        seal.check("m.json", slipped_in)
    with pytest.raises(ManifestSealError, match="field 'size' does not match the manifest's seal"):
        seal.check("m.json", {**doc, "size": doc["size"] + 1})
    with pytest.raises(ManifestSealError, match="field 'seal' does not match its own digest"):
        seal.check("m.json", {**doc, "seal": {**doc["seal"], "writer": "ckptfmt 9"}})


def test_the_manifest_a_dcp_directory_embeds_is_checked_before_it_is_used():
    pytest.importorskip("torch")
    from ckptfmt.errors import CheckpointError
    from ckptfmt.torch.dcp import _checked
    extra = {"layout": [{"name": "w", "shape": [2], "offset": 0}], "config": {"lr": 0.1}}
    sealed = mf.sealed(extra)
    assert _checked("d", json.dumps(sealed).encode()) == extra
    with pytest.raises(ManifestSealError, match="field 'config'"):
        _checked("d", json.dumps({**sealed, "config": {"lr": 0.2}}).encode())
    released = {**extra, "seal": mf.sealed({**extra, "file": "step_000001.bin", "step": 1})["seal"]}
    assert _checked("d", json.dumps(released).encode()) == extra     # a copied seal: cannot be checked
    with pytest.raises(CheckpointError, match="not valid JSON"):
        _checked("d", b"{")
    recorded = {**extra, "dcp": {"bin_blake3": "0" * 64, "bin_size": 32}}     # the .bin the arrays make
    sealed = mf.sealed(recorded)
    assert _checked("d", json.dumps(sealed).encode()) == recorded
    with pytest.raises(ManifestSealError, match="field 'dcp' does not match"):
        _checked("d", json.dumps({**sealed, "dcp": {"bin_blake3": "1" * 64, "bin_size": 32}}).encode())
    with pytest.raises(ManifestSealError, match="field 'dcp' is not covered by the embedded manifest's seal"):
        _checked("d", json.dumps({**released, "dcp": recorded["dcp"]}).encode())


def test_every_writer_seals_what_it_writes(tmp_path):
    make(tmp_path, 5, manifest={"config": {"a": 1}})
    doc = mf.read(tmp_path / "step_000005.json")
    assert mf.self_checked("m", doc) is None
    assert set(doc["seal"]["fields"]) == set(doc) - {"seal"}


@pytest.mark.parametrize("field", ["shards", "format", "lightning"])
def test_a_flipped_bit_in_a_field_name_does_not_change_what_the_file_is(tmp_path, field):
    """What a path is (a sharded generation, a manifest, a Lightning checkpoint directory) is
    read from its manifest before the seal is checked: every bit of that field's name flipped
    (in the field itself and in the seal's list of fields), the path given to validate and
    inspect is still damage naming the manifest (exit 1), never another kind (exit 2), never OK."""
    if field == "lightning":
        target = tmp_path / "epoch=0-step=4.ckpt"
        target.mkdir()
        make(target, 4, n=12, manifest={"lightning": {"epoch": 0, "global_step": 4}})
        path = target / "step_000004.json"
    else:
        (tmp_path / "src").mkdir()
        make(tmp_path / "src", 4, n=12)
        assert cli("convert", tmp_path / "src" / "step_000004.bin", tmp_path / "run", "--to", "shards").returncode == 0
        target = path = tmp_path / "run" / "step_000004.json"
    good = path.read_bytes()
    assert cli("validate", target).returncode == 0
    first = good.index(f'"{field}"'.encode()) + 1
    second = good.index(f'"{field}"'.encode(), first) + 1
    for bit in [*range(first * 8, (first + len(field)) * 8), *range(second * 8, (second + len(field)) * 8)]:
        path.write_bytes(flipped(good, bit))
        if field != "lightning" or parses(flipped(good, bit)):     # a name and a place decide the others
            assert kinds.sniff(target).name == ("lightning" if field == "lightning" else "shards"), bit
        for command in ("validate", "inspect"):
            r = cli(command, target)
            assert r.returncode == 1 and str(target) in r.stdout + r.stderr, (bit, command, r.stdout, r.stderr)
