"""The Lightning plugin writing straight to object storage (spec/RUN.md §11.10): with
``ModelCheckpoint(dirpath="s3://...")`` against a real S3-protocol server (moto's, on
127.0.0.1) and real Lightning on the CPU, each checkpoint is one generation under its own
prefix, written through the store run's save, nothing staged on local disk; a fit resumes from
a checkpoint's URL bit-exactly, mid-epoch too (SIGUSR1's last.ckpt); a damaged part is refused
before training, naming blake3; top-k and last.ckpt replace and remove on the store, manifest
first; the callback's retention removes there; the history is written as segments; mirror= is
refused in one line before the first step; ``validate``, ``ls`` and ``inspect`` read the
ModelCheckpoint prefix."""
from __future__ import annotations

import json
import os
import signal

import pytest

pl = pytest.importorskip("pytorch_lightning")
pytest.importorskip("s3fs")

from s3server import fixtures                                                 # noqa: E402
from test_lightning import differing, state_bytes                            # noqa: E402
from test_lightning_options import STEPS, At, example, kill                   # noqa: E402

from ckptfmt.errors import FingerprintMismatchError, NoValidGenerationError, SaveError, UnsupportedSetupError  # noqa: E402
from ckptfmt.lightning import CheckpointIO, Checkpointing, stored            # noqa: E402
from ckptfmt.run import Policy                                              # noqa: E402
from ckptfmt.run.segments import SegmentedHistory                           # noqa: E402
from ckptfmt.store.objects import ObjectStore                               # noqa: E402
from conftest import cli                                                    # noqa: E402

s3, bucket = fixtures("lstore")


def train(url, local, ckpt_path=None, *, at=None, io=None, checkpoint=None, **options):
    """The example's module and resumable loader to STEPS, ModelCheckpoint(dirpath=url) every 5
    steps (``checkpoint``: other settings); ``local`` is the Trainer's default_root_dir."""
    pl.seed_everything(0, verbose=False)
    model, dataset = example.Net(), example.data()
    loader = example.ResumableLoader(dataset, 12, example.ShuffleSampler(len(dataset)))
    saver = pl.callbacks.ModelCheckpoint(dirpath=url, filename="step={step}", auto_insert_metric_name=False,
                                         **(checkpoint or {"every_n_train_steps": 5, "save_top_k": -1}))
    trainer = pl.Trainer(max_steps=STEPS, deterministic=True, logger=False, enable_progress_bar=False,
                         enable_model_summary=False, accelerator="cpu", default_root_dir=str(local),
                         plugins=[io or CheckpointIO()], callbacks=[*([at] if at else []), Checkpointing(**options), saver])
    trainer.fit(model, loader, ckpt_path=ckpt_path)
    return model, trainer


def keys(s3, bucket: str, prefix: str) -> list[str]:
    listed = s3.client().list_objects_v2(Bucket=bucket, Prefix=prefix + "/").get("Contents", [])
    return sorted(o["Key"][len(prefix) + 1:] for o in listed)


@pytest.fixture(scope="module")
def straight(s3, tmp_path_factory):
    """One run to STEPS on the store: checkpoints every 5 steps, SIGUSR1 at step 7 (last.ckpt,
    mid-epoch); (bucket, its state, its default_root_dir and working directory)."""
    name, local = s3.bucket("lstore-straight"), tmp_path_factory.mktemp("straight")
    here = os.getcwd()
    os.chdir(local)              # a URL taken for a local path would show here (s3:/lstore-straight/...)
    try:
        got = state_bytes(*train(f"s3://{name}/run", local, at=At(7, kill(signal.SIGUSR1)), signals=True))
    finally:
        os.chdir(here)
    return name, got, local


def test_each_checkpoint_is_one_generation_on_the_store_and_nothing_is_staged_locally(s3, straight):
    name, _, local = straight
    found = keys(s3, name, "run")
    checkpoints = sorted({k.split("/")[0] for k in found if not k.startswith(".")})
    assert checkpoints == ["last.ckpt", "step=10.ckpt", "step=15.ckpt", "step=20.ckpt", "step=5.ckpt"]
    assert [k for k in found if k.startswith("step=10.ckpt/")] == [
        "step=10.ckpt/step_000010.bin", "step=10.ckpt/step_000010.extra.safetensors", "step=10.ckpt/step_000010.json"]
    assert [k for k in found if k.startswith("last.ckpt/")] == [        # SIGUSR1's, at step 7
        "last.ckpt/step_000007.bin", "last.ckpt/step_000007.extra.safetensors", "last.ckpt/step_000007.json"]
    assert list(local.iterdir()) == []                  # nothing written on local disk, nor in the cwd
    doc = json.loads(s3.client().get_object(Bucket=name, Key="run/step=10.ckpt/step_000010.json")["Body"].read())
    assert doc["lightning"]["global_step"] == 10 and doc["rng"] and doc["imported"]["file"] == "step=10.ckpt"


@pytest.mark.parametrize("resume", ["step=5.ckpt", "last.ckpt"])
def test_a_fit_resumed_from_a_checkpoints_url_is_bit_exact(s3, straight, bucket, tmp_path, resume):
    """From step 5 (mid-epoch: 8 steps an epoch) and from the last.ckpt SIGUSR1 wrote at step 7."""
    name, want, _ = straight
    model, trainer = train(f"s3://{bucket}/resumed", tmp_path, f"s3://{name}/run/{resume}")
    assert trainer.global_step == STEPS
    assert differing(state_bytes(model, trainer), want) == []
    assert keys(s3, bucket, "resumed/step=20.ckpt")[0] == "step_000020.bin"


def copy(s3, src: str, dst: str) -> None:
    """The objects under bucket/prefix ``src`` again under ``dst`` (same bucket form)."""
    client = s3.client()
    sb, sp = src.split("/", 1)
    db, dp = dst.split("/", 1)
    for key in keys(s3, sb, sp):
        client.put_object(Bucket=db, Key=f"{dp}/{key}", Body=client.get_object(Bucket=sb, Key=f"{sp}/{key}")["Body"].read())


@pytest.mark.parametrize("damaged", ["step_000010.bin", "step_000010.extra.safetensors"])
def test_a_damaged_part_is_refused_before_training_naming_blake3(s3, straight, bucket, tmp_path, damaged):
    name, _, _ = straight
    copy(s3, f"{name}/run/step=10.ckpt", f"{bucket}/copy/step=10.ckpt")
    client = s3.client()
    blob = bytearray(client.get_object(Bucket=bucket, Key=f"copy/step=10.ckpt/{damaged}")["Body"].read())
    blob[-5] ^= 0x01
    client.put_object(Bucket=bucket, Key=f"copy/step=10.ckpt/{damaged}", Body=bytes(blob))
    with pytest.raises(FingerprintMismatchError, match="blake3 mismatch") as caught:
        train(f"s3://{bucket}/resumed", tmp_path, f"s3://{bucket}/copy/step=10.ckpt")
    assert "\n" not in str(caught.value) and f"s3://{bucket}/copy/step=10.ckpt/{damaged}" in str(caught.value)
    assert keys(s3, bucket, "resumed") == [] and list(tmp_path.iterdir()) == []     # no step trained


def test_top_k_and_last_replace_and_remove_on_the_store_with_async_saves_and_the_history(s3, bucket, tmp_path):
    """Every 4 steps, top-2 by loss and last.ckpt, each save on the plugin's thread: the store
    ends holding exactly those three checkpoints, each one generation, each valid; the history
    is there as segments; validate, ls and inspect read the ModelCheckpoint prefix."""
    url, io = f"s3://{bucket}/run", CheckpointIO(async_save=True)
    train(url, tmp_path, io=io, history=True,
          checkpoint={"every_n_train_steps": 4, "save_top_k": 2, "monitor": "loss", "save_last": True})
    found = keys(s3, bucket, "run")
    names = sorted({k.split("/")[0] for k in found if not k.startswith(".")})
    assert len(names) == 3 and "last.ckpt" in names, names
    for name in names:
        parts = [k.split("/")[1] for k in found if k.startswith(name + "/")]
        assert [p.rsplit(".", 1)[-1] for p in parts] == ["bin", "safetensors", "json"], parts     # one generation
        assert io.load_checkpoint(f"{url}/{name}")["global_step"] == int(parts[0][5:11])
    assert [k for k in found if k.startswith("last.ckpt/")][0] == "last.ckpt/step_000020.bin"
    steps = [r["step"] for r in SegmentedHistory(ObjectStore(url)).read().canonical()]
    assert steps == list(range(1, STEPS + 1))
    assert list(tmp_path.iterdir()) == []
    result = cli("validate", url)
    assert result.returncode == 0, result.stdout + result.stderr
    assert all(name in result.stdout for name in names), result.stdout
    listed = cli("ls", url)
    assert listed.returncode == 0 and all(name in listed.stdout for name in names), listed.stdout
    inspected = cli("inspect", url)                     # the newest checkpoint, read and verified
    assert inspected.returncode == 0 and f"latest valid generation:\n{url}/" in inspected.stdout, inspected.stdout
    assert "step_000020.bin" in inspected.stdout and "fingerprint verified" in inspected.stdout


def tiny(step: int) -> dict:
    import torch
    net = torch.nn.Linear(3, 2)
    return {"global_step": step, "state_dict": net.state_dict()}          # weights only: no callback needed


def test_a_removal_cut_after_its_manifest_leaves_no_committed_checkpoint(s3, bucket, monkeypatch):
    """Lightning's top-k removes a checkpoint: its manifest goes first, so a removal that stops
    after that one delete (the process killed) leaves a leftover, never a committed checkpoint
    missing a part; the next removal takes the rest."""
    url, io = f"s3://{bucket}/run/step=3.ckpt", stored.Checkpoints()
    io.write(tiny(3), url)
    deleted, real = [], ObjectStore.remove

    def remove_once(store, name, **how):
        if deleted:
            raise KeyboardInterrupt("killed")
        deleted.append(name)
        return real(store, name, **how)
    monkeypatch.setattr(ObjectStore, "remove", remove_once)
    with pytest.raises(KeyboardInterrupt):
        io.remove(url)
    monkeypatch.setattr(ObjectStore, "remove", real)
    assert deleted == ["step_000003.json"]
    assert keys(s3, bucket, "run/step=3.ckpt") == ["step_000003.bin"]
    with pytest.raises(NoValidGenerationError, match="holds no committed ckptfmt generation"):
        io.read(url)
    io.remove(url)
    assert keys(s3, bucket, "run") == []


def test_saved_again_at_its_url_the_checkpoint_is_replaced_and_a_foreign_prefix_is_never_deleted(s3, bucket):
    url, io = f"s3://{bucket}/run/last.ckpt", stored.Checkpoints()
    io.write(tiny(3), url)
    io.write(tiny(7), url)
    assert keys(s3, bucket, "run/last.ckpt") == ["step_000007.bin", "step_000007.json"]
    assert io.read(url)["global_step"] == 7
    s3.client().put_object(Bucket=bucket, Key="run/notes.ckpt/notes.txt", Body=b"keep")
    with pytest.raises(SaveError, match="refusing to delete"):
        io.remove(f"s3://{bucket}/run/notes.ckpt")
    assert keys(s3, bucket, "run/notes.ckpt") == ["notes.txt"]


def test_mirror_with_a_url_dirpath_is_refused_in_one_line_before_the_first_step(s3, bucket, tmp_path):
    with pytest.raises(UnsupportedSetupError, match=r"Checkpointing\(mirror=\) with a URL dirpath") as caught:
        train(f"s3://{bucket}/run", tmp_path, mirror=f"s3://{bucket}/elsewhere")
    assert "\n" not in str(caught.value) and f"s3://{bucket}/run" in str(caught.value)
    assert keys(s3, bucket, "") == [] and list(tmp_path.iterdir()) == []


def test_retention_removes_on_the_store_what_its_policy_does_not_keep(s3, bucket, tmp_path):
    """Checkpointing(retention=Policy(keep_last=2)) over the checkpoints at the URL: after each
    save, the run layer's rules and guards (the newest valid one hashed first, read back from
    the store) and the removal manifest first; last.ckpt is never one it removes."""
    url = f"s3://{bucket}/run"
    train(url, tmp_path, retention=Policy(keep_last=2),
          checkpoint={"every_n_train_steps": 4, "save_top_k": -1, "save_last": True})
    found = keys(s3, bucket, "run")
    assert sorted({k.split("/")[0] for k in found}) == ["last.ckpt", "step=16.ckpt", "step=20.ckpt"]
    assert len(found) == 9 and list(tmp_path.iterdir()) == []           # each a whole generation
