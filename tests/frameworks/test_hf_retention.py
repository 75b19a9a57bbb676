"""Retention and the resume choice over a Trainer's output directory (``ckptfmt.tools.hfrun``,
spec/RUN.md §12.4): the run layer's ``Policy`` decides, and no rule deletes the newest valid
checkpoint, the newest finite one, the Trainer's ``best_model_checkpoint`` or one that does not
verify. Built without a Trainer: checkpoint-N directories of real safetensors files, committed
by ``hfdir.commit`` as the callback commits them."""
from __future__ import annotations

import fcntl
import json
import os
from pathlib import Path

import numpy as np
import pytest
from click.testing import CliRunner

from ckptfmt import fingerprint, generation, hfcheckpoint, kinds, tensorfile
from ckptfmt.cli import main
from ckptfmt.errors import CheckpointError, NoValidGenerationError, UnsupportedSetupError
from ckptfmt.run import Policy
from ckptfmt.tools import hfdir, hfrun


def checkpoint(out: Path, step: int, *, eval_loss: float = 1.0, nan: bool = False, commit: bool = True) -> Path:
    d = out / f"checkpoint-{step}"
    d.mkdir(parents=True)
    w = np.full(4, float(step), dtype="<f4")
    if nan:
        w[1] = np.nan
    tensorfile.write(str(d / "model.safetensors"), [("w", "F32", [4], w)], {"format": "pt"})
    (d / "trainer_state.json").write_text(json.dumps(
        {"global_step": step, "log_history": [{"eval_loss": eval_loss, "step": step}]}))
    if commit:
        hfdir.commit(d, step, [["w"]])
    return d


def cli(*args) -> tuple[int, str]:
    result = CliRunner().invoke(main, [str(a) for a in args])
    return result.exit_code, result.output


def steps(out: Path) -> list[int]:
    return sorted(hfcheckpoint.step_of_dir(p) for p in out.glob("checkpoint-*"))


def test_a_commit_record_edited_after_its_seal_is_damage_and_resume_passes_it_over(tmp_path):
    """The record's own fields decide verdicts (its facts: a diverged checkpoint is passed over):
    one edited after the commit is damage, named, and the resume takes the one before."""
    for s in (5, 10):
        checkpoint(tmp_path, s)
    checkpoint(tmp_path, 15, nan=True)
    path = tmp_path / "checkpoint-15" / hfcheckpoint.RECORD
    doc = json.loads(path.read_text())
    doc["facts"]["weights"] = {"finite": True, "non_finite": 0}      # hides the NaN
    path.write_text(json.dumps(doc))
    assert any("field 'facts' does not match" in p for p in hfcheckpoint.problems(tmp_path / "checkpoint-15"))
    assert hfrun.resume_path(tmp_path) == str(tmp_path / "checkpoint-10")
    code, out = cli("validate", tmp_path / "checkpoint-15")
    assert code == 1 and "field 'facts' does not match the manifest's seal" in out, out


def test_keep_last_1_keeps_the_newest_and_deletes_the_others(tmp_path):
    for s in (5, 10, 15):
        checkpoint(tmp_path, s)
    assert hfrun.retain(tmp_path, Policy(keep_last=1)) == [5, 10]
    assert steps(tmp_path) == [15]


def test_a_diverged_newest_keeps_the_newest_finite_and_resume_passes_it_over(tmp_path):
    for s in (5, 10):
        checkpoint(tmp_path, s)
    checkpoint(tmp_path, 15, nan=True)
    record = hfcheckpoint.read_record(tmp_path / "checkpoint-15")
    assert record["facts"] == {"weights": {"finite": False, "non_finite": 1}, "tensors": {"w": 1}}
    assert hfrun.retain(tmp_path, Policy(keep_last=1)) == [5]
    assert steps(tmp_path) == [10, 15]
    with pytest.warns(UserWarning, match="checkpoint-15: skipped for resume: diverged: its weights hold 1 non-finite"):
        assert hfrun.resume_path(tmp_path) == str(tmp_path / "checkpoint-10")
    assert hfrun.resume_path(tmp_path, allow_nonfinite=True) == str(tmp_path / "checkpoint-15")


def test_best_model_checkpoint_and_the_best_k_by_a_metric_are_kept(tmp_path):
    losses = {5: 0.3, 10: 0.9, 15: 0.5, 20: 0.8, 25: 0.7}
    for s, loss in losses.items():
        checkpoint(tmp_path, s, eval_loss=loss)
    deleted = hfrun.retain(tmp_path, Policy(keep_best=1, metric="eval_loss"),
                           best=str(tmp_path / "checkpoint-15"))
    assert deleted == [10, 20] and steps(tmp_path) == [5, 15, 25]   # best, Trainer's best, newest


def test_checkpoints_that_do_not_verify_are_never_deleted_and_never_the_newest_valid(tmp_path):
    for s in (5, 10):
        checkpoint(tmp_path, s)
    checkpoint(tmp_path, 15, commit=False)                  # torn: no record
    broken = checkpoint(tmp_path, 20)
    (broken / "trainer_state.json").write_text("{}")        # changed after its record
    assert hfrun.retain(tmp_path, Policy(keep_last=1)) == [5]
    assert steps(tmp_path) == [10, 15, 20]                  # 10: the newest valid


def test_no_checkpoint_is_a_fresh_start_and_none_valid_is_refused_naming_each(tmp_path):
    assert hfrun.resume_path(tmp_path / "absent") is None and hfrun.resume_path(tmp_path) is None
    checkpoint(tmp_path, 5, commit=False)
    with pytest.warns(UserWarning), pytest.raises(NoValidGenerationError, match="checkpoint-5: no ckptfmt-commit.json"):
        hfrun.resume_path(tmp_path)


def test_a_file_added_after_the_record_makes_it_stale(tmp_path):
    d = checkpoint(tmp_path, 5)
    (d / "rng_state_1.pth").write_bytes(b"x")
    assert hfcheckpoint.problems(d) == ["rng_state_1.pth: not in ckptfmt-commit.json: written after the record "
                                 "(a second save made it stale)"]


def flip_a_byte(path: Path) -> None:
    """The same size, one bit changed: only the blake3 tells."""
    data = bytearray(path.read_bytes())
    data[-1] ^= 0x01
    path.write_bytes(bytes(data))


def test_a_same_size_corruption_of_the_newest_is_never_the_protected_one(tmp_path):
    for s in (5, 10, 15):
        checkpoint(tmp_path, s)
    flip_a_byte(tmp_path / "checkpoint-15" / "model.safetensors")
    assert hfrun.retain(tmp_path, Policy(keep_last=1)) == [5]
    assert steps(tmp_path) == [10, 15]                      # 10: the newest that verifies; 15 not deleted on a guess


def test_nothing_is_deleted_while_no_checkpoint_verifies(tmp_path):
    for s in (5, 10):
        checkpoint(tmp_path, s)
        flip_a_byte(tmp_path / f"checkpoint-{s}" / "model.safetensors")
    assert hfrun.retain(tmp_path, Policy(keep_last=1)) == [] and steps(tmp_path) == [5, 10]


def test_the_keep_everything_policy_deletes_nothing(tmp_path):
    for s in (5, 10, 15):
        checkpoint(tmp_path, s)
    assert hfrun.retain(tmp_path, Policy.KEEP_ALL) == [] and steps(tmp_path) == [5, 10, 15]


def output_dir_after_save_model(out: Path) -> Path:
    """What ``trainer.save_model()`` and ``save_state()`` leave: the model and trainer_state.json
    at the top, beside the checkpoint-N directories."""
    for s in (5, 10):
        checkpoint(out, s)
    tensorfile.write(str(out / "model.safetensors"), [("w", "F32", [4], np.ones(4, "<f4"))], {"format": "pt"})
    (out / "trainer_state.json").write_text(json.dumps({"global_step": 10, "log_history": []}))
    return out


def test_an_output_directory_with_the_model_at_the_top_is_a_run_and_a_flipped_byte_in_it_a_defect(tmp_path):
    out = output_dir_after_save_model(tmp_path / "out")
    flip_a_byte(out / "checkpoint-10" / "model.safetensors")
    assert kinds.sniff(out).name == "hf-run" and hfcheckpoint.files_of(out) == ["model.safetensors", "trainer_state.json"]
    assert not kinds.get("hf-checkpoint").sniff(kinds.Probe(out))         # whatever the order of the kinds
    code, text = cli("validate", out)
    assert code == 1 and "checkpoint-10/model.safetensors: blake3 mismatch: record says" in text, text
    code, text = cli("ls", out, "--json")
    assert code == 0 and [g["step"] for g in json.loads(text)["generations"]] == [5, 10], text


def test_ls_of_a_checkpoint_directory_named_by_no_step_and_without_a_record_lists_it(tmp_path):
    d = tmp_path / "saved"
    d.mkdir()
    (d / "trainer_state.json").write_text("{}")
    code, text = cli("ls", d)
    assert code == 0 and "incomplete" in text, text


def test_metrics_are_the_newest_at_or_before_the_step_in_the_manifests_shape(tmp_path):
    d = tmp_path / "checkpoint-6"
    d.mkdir()
    (d / "trainer_state.json").write_text(json.dumps({"log_history": [
        {"eval_loss": 0.9, "step": 2}, {"eval_loss": 0.7, "step": 4}, {"loss": 1.5, "step": 6},
        {"eval_loss": 0.1, "step": 8}]}))
    assert hfdir.commit(d, 6)["metrics"] == {"eval_loss": {"value": 0.7, "step": 4}, "loss": {"value": 1.5, "step": 6}}


def test_keep_best_reads_metrics_logged_before_the_save_and_a_bad_value_does_not_crash(tmp_path):
    for s, loss in ((5, 0.3), (10, 0.9), (15, 0.5)):
        d = checkpoint(tmp_path, s, commit=False)
        (d / "trainer_state.json").write_text(json.dumps({"log_history": [{"eval_loss": loss, "step": s - 1}]}))
        hfdir.commit(d, s)
    hfdir.commit(checkpoint(tmp_path, 20, commit=False), 20, metrics={"eval_loss": {"value": "n/a", "step": 20}})
    assert hfrun.retain(tmp_path, Policy(keep_best=1, metric="eval_loss")) == [10, 15]
    assert steps(tmp_path) == [5, 20]


def test_removal_uncommits_first_and_a_leftover_is_listed_then_swept(tmp_path, monkeypatch):
    d = checkpoint(tmp_path, 5)
    checkpoint(tmp_path, 10)

    def refuse(*args):
        raise OSError("simulated crash before the rename")
    monkeypatch.setattr(hfcheckpoint.os, "rename", refuse)
    with pytest.raises(OSError):
        hfcheckpoint.HFCheckpoint.at(d).remove()
    assert not (d / hfcheckpoint.RECORD).exists()                  # the record went first: uncommitted, not half there
    monkeypatch.undo()
    leftover = tmp_path / ".ckptfmt-deleting.checkpoint-3.999"
    leftover.mkdir()
    (leftover / "model.safetensors").write_bytes(b"x")
    assert [t.split(":")[0] for t in hfrun.ls_hf(tmp_path)["leftovers"]] == [str(leftover)]
    hfrun.retain(tmp_path, Policy(keep_last=1))
    assert not leftover.exists()


def test_a_checkpoint_a_reader_leases_is_kept(tmp_path):
    for s in (5, 10):
        checkpoint(tmp_path, s)
    (tmp_path / ".leases").mkdir()
    with open(tmp_path / ".leases" / f"{os.getpid()}.0123abcd.json", "w") as lease:
        fcntl.flock(lease, fcntl.LOCK_EX)                   # held: a live reader
        lease.write(json.dumps({"pid": os.getpid(), "purpose": "test", "steps": [5]}))
        lease.flush()
        assert hfrun.retain(tmp_path, Policy(keep_last=1)) == []
    assert steps(tmp_path) == [5, 10]


def test_inspect_counts_bf16_and_fp16_weights_widened(tmp_path):
    d = tmp_path / "checkpoint-1"
    d.mkdir()
    (d / "trainer_state.json").write_text("{}")
    bf16 = (np.array([1.5, -2.0], "<f4").view("<u4") >> 16).astype("<u2")
    tensorfile.write(str(d / "model.safetensors"), [("a", "BF16", [2], bf16), ("b", "F16", [1], np.array([4.0], "<f2")),
                                                    ("c", "F32", [1], np.array([0.5], "<f4"))], {"format": "pt"})
    weights = hfrun.inspect_hf(d)["regions"]["weights"]
    assert (weights["count"], weights["min"], weights["max"]) == (4, -2.0, 4.0)


def test_a_shard_name_that_leaves_the_directory_is_refused(tmp_path):
    d = tmp_path / "checkpoint-1"
    d.mkdir()
    (d / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {"w": "../outside.safetensors"}}))
    with pytest.raises(CheckpointError, match="shard files beside it"):
        hfdir.weight_files(d)


def test_a_checkpoint_directory_is_a_generation_with_every_file_a_part_and_the_record_last(tmp_path):
    d = checkpoint(tmp_path / "out", 5)
    (d / "sub").mkdir()
    (d / "sub" / "rng_state.pth").write_bytes(b"rng")
    hfdir.commit(d, 5, [["w"]])
    gen = hfcheckpoint.checkpoints(tmp_path / "out")[0]
    assert isinstance(gen, generation.Generation) and gen.step == 5 and gen.committed
    parts = gen.parts()
    assert [p.name for p in parts] == ["checkpoint-5/model.safetensors", "checkpoint-5/sub/rng_state.pth",
                                       "checkpoint-5/trainer_state.json", "checkpoint-5/ckptfmt-commit.json"]
    assert all(p.blake3 == fingerprint.of_file(p.path) and p.size == p.path.stat().st_size for p in parts[:-1])
    assert gen.check(deep=True) is None
    rows = gen.copy_to(tmp_path / "copy")
    copied = hfcheckpoint.HFCheckpoint.at(tmp_path / "copy" / "checkpoint-5")
    assert copied.check(deep=True) is None and [r["file"] for r in rows] == [p.name for p in parts]
    data = bytearray((d / "model.safetensors").read_bytes())
    data[-1] ^= 0x01                                            # same size: only the blake3 sees it
    (d / "model.safetensors").write_bytes(bytes(data))
    assert gen.check() is None and "model.safetensors: blake3" in gen.check(deep=True)
    with pytest.raises(CheckpointError, match="checkpoint-5/model.safetensors: blake3 mismatch"):
        gen.copy_to(tmp_path / "again")
    with pytest.raises(UnsupportedSetupError, match="checkpoint-5"):
        gen.open()


def test_a_checkpoint_without_its_record_is_an_uncommitted_generation(tmp_path):
    d = checkpoint(tmp_path, 7, commit=False)
    gen = hfcheckpoint.HFCheckpoint.at(d)
    assert not gen.committed and gen.leftover()[0] == d and "no ckptfmt-commit.json" in gen.check()
    with pytest.raises(CheckpointError, match="checkpoint-7"):
        gen.parts()


def test_ls_says_damaged_with_the_reason_for_a_record_edited_after_its_seal_and_inspect_says_what_it_skipped(tmp_path):
    for s in (4, 6):
        checkpoint(tmp_path, s)
    path = tmp_path / "checkpoint-6" / hfcheckpoint.RECORD
    path.write_text(path.read_text().replace('"size": ', '"size": 1', 1))       # one field edited
    code, out = cli("ls", tmp_path)
    assert code == 0 and "damaged: " in out and "incomplete" not in out, out
    data = bytearray((tmp_path / "checkpoint-4" / "model.safetensors").read_bytes())
    data[-1] ^= 0x01
    (tmp_path / "checkpoint-4" / "model.safetensors").write_bytes(bytes(data))
    code, out = cli("ls", tmp_path, "--deep")
    assert code == 0 and "damaged: model.safetensors: blake3 mismatch" in out, out
    with pytest.warns(UserWarning, match="checkpoint-6: skipping it: .*seal"):
        hfrun.inspect_hf(tmp_path)
