"""Checkpointing(mirror=URL) (spec/RUN.md §11.8): with real Lightning and a real file:// (and S3)
destination, the URL ends holding exactly the checkpoint directories ModelCheckpoint kept (top-k,
last.ckpt replaced in place, the callback's retention), each restorable by `ckptfmt mirror URL/NAME
DEST` and valid there; a damaged checkpoint is never uploaded and holds removals back; a failed
pass is logged and retried, never a failed fit; the training loop never waits for the mirror."""
from __future__ import annotations

import os
import signal
import threading
import time

import pytest
import torch

pl = pytest.importorskip("pytorch_lightning")

from s3server import fixtures                                                 # noqa: E402
from test_lightning import invoke                                             # noqa: E402
from test_lightning_options import STEPS, At, example, kill                   # noqa: E402

from ckptfmt.errors import UnsupportedSetupError                              # noqa: E402
from ckptfmt.lightning import CheckpointIO, Checkpointing, files                # noqa: E402
from ckptfmt.run import mirror_thread as mirroring                             # noqa: E402
from ckptfmt.run import Policy                                                # noqa: E402
from ckptfmt.run.mirror import mirror_runs                                    # noqa: E402
from models import tiny_linear                                                # noqa: E402

s3, bucket = fixtures("lmirror")
TOP_K = {"every_n_train_steps": 2, "save_top_k": 2, "monitor": "loss", "save_last": True}


def train(root, *, checkpoint, io=None, at=None, **options):
    """The example's module and resumable loader to STEPS, ModelCheckpoint(**checkpoint) in root."""
    pl.seed_everything(0, verbose=False)
    model, dataset = example.Net(), example.data()
    loader = example.ResumableLoader(dataset, 12, example.ShuffleSampler(len(dataset)))
    saver = pl.callbacks.ModelCheckpoint(dirpath=root, filename="step={step}", auto_insert_metric_name=False,
                                         **checkpoint)
    ours = Checkpointing(**options)
    trainer = pl.Trainer(max_steps=STEPS, deterministic=True, logger=False, enable_progress_bar=False,
                         enable_model_summary=False, accelerator="cpu", default_root_dir=str(root),
                         plugins=[io or CheckpointIO()], callbacks=[*([at] if at else []), ours, saver])
    trainer.fit(model, loader)
    return ours


def kept(root) -> list[str]:
    return sorted(n for n in os.listdir(root) if not n.startswith("."))


def same_checkpoint(a, b) -> bool:
    x, y = files.read(a), files.read(b)
    return x["global_step"] == y["global_step"] and x["state_dict"].keys() == y["state_dict"].keys() and \
        all(torch.equal(x["state_dict"][k], y["state_dict"][k]) for k in x["state_dict"])


def test_the_url_holds_exactly_the_kept_checkpoints_and_last_each_restorable_and_valid(tmp_path):
    root, there = tmp_path / "ckpt", tmp_path / "bucket" / "run"
    ours = train(root, checkpoint=TOP_K, mirror=f"file://{there}")
    assert len(kept(root)) == 3 and "last.ckpt" in kept(root)                 # top-2 by loss, and last
    assert sorted(os.listdir(there)) == kept(root)                            # the removed ones gone there too
    assert not os.path.exists(root / mirroring.AREA)
    assert sorted(os.listdir(there / "last.ckpt")) == [".mirror-index.json", "step_000020.bin",   # replaced in
                                                       "step_000020.extra.safetensors", "step_000020.json"]  # place
    for name in kept(root):
        assert invoke("validate", f"file://{there}/{name}").exit_code == 0
        assert invoke("mirror", f"file://{there}/{name}", tmp_path / "back" / name).exit_code == 0
        assert invoke("validate", tmp_path / "back" / name).exit_code == 0
        assert same_checkpoint(root / name, tmp_path / "back" / name)
    assert ours.mirroring.report["errors"] == [] and not ours.mirroring.report["failed"]


def test_what_retention_prunes_is_removed_at_the_url_too_with_async_saves(tmp_path):
    root, there = tmp_path / "ckpt", tmp_path / "bucket"
    train(root, checkpoint={"every_n_train_steps": 2, "save_top_k": -1}, io=CheckpointIO(async_save=True),
          retention=Policy(keep_last=2, keep_every=8), mirror=f"file://{there}")
    assert kept(root) == ["step=16.ckpt", "step=18.ckpt", "step=20.ckpt", "step=8.ckpt"]
    assert sorted(os.listdir(there)) == kept(root)


def test_the_training_loop_never_waits_for_the_mirror(tmp_path, monkeypatch):
    """The first pass is held until the loop reaches its last step: a loop that waited for it
    would never get there (and the pass would give up after 60 s)."""
    released, waited, real = threading.Event(), [], mirroring.mirror_runs

    def held(*args, **kwargs):
        waited.append(released.wait(60))
        return real(*args, **kwargs)
    monkeypatch.setattr(mirroring, "mirror_runs", held)
    root, there = tmp_path / "ckpt", tmp_path / "bucket"
    train(root, checkpoint={"every_n_train_steps": 4, "save_top_k": -1}, at=At(STEPS - 1, lambda m: released.set()),
          mirror=f"file://{there}")
    assert waited[0] is True and len(waited) >= 2
    assert sorted(os.listdir(there)) == kept(root) == ["step=12.ckpt", "step=16.ckpt", "step=20.ckpt",
                                                      "step=4.ckpt", "step=8.ckpt"]


def test_after_sigterm_the_url_holds_the_last_checkpoint_before_the_process_ends(tmp_path):
    root, there = tmp_path / "ckpt", tmp_path / "bucket"
    with pytest.raises(SystemExit):                                          # Lightning's SIGTERMException
        train(root, checkpoint={"every_n_train_steps": 4, "save_top_k": -1}, io=CheckpointIO(async_save=True),
              at=At(11, kill(signal.SIGTERM)), signals=True, mirror=f"file://{there}")
    assert sorted(os.listdir(there)) == kept(root) == ["last.ckpt", "step=4.ckpt", "step=8.ckpt"]
    assert invoke("validate", f"file://{there}/last.ckpt").exit_code == 0
    assert invoke("mirror", f"file://{there}/last.ckpt", tmp_path / "back").exit_code == 0
    assert same_checkpoint(root / "last.ckpt", tmp_path / "back") and files.read(tmp_path / "back")["global_step"] == 11


def test_a_failed_pass_is_logged_and_retried_never_a_failed_fit(tmp_path):
    root, blocker = tmp_path / "ckpt", tmp_path / "bucket"
    blocker.write_text("a file where the URL's folder should be")
    with pytest.warns(UserWarning, match="failed, retried at the next commit") as record:
        def heal(_):
            deadline = time.monotonic() + 30             # a pass has failed (logged) before the URL heals
            while not any("failed, retried" in str(w.message) for w in record) and time.monotonic() < deadline:
                time.sleep(0.01)
            blocker.unlink()
        ours = train(root, checkpoint={"every_n_train_steps": 4, "save_top_k": -1}, at=At(10, heal),
                     mirror=f"file://{blocker}/run")
    report = ours.mirroring.report
    assert report["errors"] and not report["failed"]
    assert sorted(os.listdir(blocker / "run")) == kept(root)


def write(root, step: int) -> str:
    net = tiny_linear()
    return files.write({"epoch": 0, "global_step": step, "state_dict": net.state_dict()}, root / f"step={step}.ckpt")


def flip(path: str) -> None:
    with open(path, "r+b") as f:
        f.seek(8)
        byte = f.read(1)
        f.seek(8)
        f.write(bytes([byte[0] ^ 1]))


def committed(there) -> list[str]:
    """The checkpoint directories at the URL that hold a committed generation (a manifest)."""
    return sorted(n for n in os.listdir(there) if any(f.endswith(".json") and f.startswith("step_")
                                                      for f in os.listdir(there / n)))


def test_a_damaged_checkpoint_is_never_uploaded_and_holds_removals_back(tmp_path):
    root, there = tmp_path / "ckpt", tmp_path / "bucket"
    write(root, 1)
    flip(write(root, 2))
    with pytest.warns(UserWarning, match=r"step=2\.ckpt/step_000002\.bin: hashes to .* not uploaded"):
        ours = mirroring.Mirroring(root, f"file://{there}", lock=threading.Lock())
        report = ours.close()
    assert committed(there) == ["step=1.ckpt"] and report["last"]["behind"] == ["step=2.ckpt"]
    assert os.listdir(there / "step=2.ckpt") == [".mirror-index.json"]      # no payload either
    files.remove(root / "step=1.ckpt")                  # removed here while the newer one is damaged
    with pytest.warns(UserWarning, match="not uploaded"):
        result = mirror_runs(mirroring.snapshot(root), f"file://{there}", owned=lambda name: True)
    assert result["removed"] == [] and committed(there) == ["step=1.ckpt"]             # kept there
    write(root, 2)                                      # a good one at the same path
    result = mirror_runs(mirroring.snapshot(root), f"file://{there}", owned=lambda name: True)
    assert result["removed"] == ["step=1.ckpt"] and sorted(os.listdir(there)) == ["step=2.ckpt"]


def test_refused_in_one_line(tmp_path):
    with pytest.raises(UnsupportedSetupError, match="mirror= needs a URL"):
        Checkpointing(mirror=str(tmp_path))
    with pytest.raises(UnsupportedSetupError, match="lies in the checkpoint directory"):
        mirroring.Mirroring(tmp_path, f"file://{tmp_path}/mirror", lock=threading.Lock())
    with pytest.raises(UnsupportedSetupError, match="mirror=.*the Trainer has no ModelCheckpoint"):
        pl.Trainer(max_steps=1, logger=False, enable_checkpointing=False, plugins=[CheckpointIO()],
                   callbacks=[Checkpointing(mirror=f"file://{tmp_path}/m")],
                   accelerator="cpu").fit(example.Net(), example.ResumableLoader(
                       example.data(), 12, example.ShuffleSampler(len(example.data()))))


def test_mirrors_to_s3_what_top_k_kept(s3, bucket, tmp_path):
    root, url = tmp_path / "ckpt", f"s3://{bucket}/lightning/run"
    train(root, checkpoint={**TOP_K, "every_n_train_steps": 5}, mirror=url)
    names = {key["Key"].split("/")[2] for key in s3.client().list_objects_v2(Bucket=bucket)["Contents"]}
    assert sorted(names) == kept(root)
    for name in kept(root):
        assert invoke("validate", f"{url}/{name}").exit_code == 0
