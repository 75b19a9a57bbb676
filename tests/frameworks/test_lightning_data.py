"""Where the data stands under Lightning (spec/RUN.md §11.4 "Mid-epoch", the Lightning tutorial,
docs/tutorials/lightning.md): a fit with torchdata's shuffling StatefulDataLoader, cut mid-epoch and resumed
through the plugin with fit(ckpt_path=...), ends bit-identical to a straight run, the same batches
in the same order; so does a shuffling DataLoader cut at its epoch's last batch (its resume
begins the next epoch, whose draws come after the RNG states); the resume without the RNG states
diverges (the negative control)."""
from __future__ import annotations

import os

import pytest
from torch.utils.data import DataLoader

pl = pytest.importorskip("pytorch_lightning")
stateful = pytest.importorskip("torchdata.stateful_dataloader")

from test_lightning import differing, state_bytes                            # noqa: E402
from test_lightning_options import example                                    # noqa: E402

from ckptfmt.lightning import CheckpointIO, Checkpointing                     # noqa: E402

STEPS = 20                  # 8 batches an epoch: step 8 is the first epoch's last, 11 inside the second
LOADERS = {"stateful": stateful.StatefulDataLoader, "plain": DataLoader}


def train(root, kind: str, cut: int, ckpt_path=None, **options):
    """The example's module (dropout) on a shuffling loader of ``kind`` to STEPS, a checkpoint
    every ``cut`` steps."""
    pl.seed_everything(0, verbose=False)
    model = example.Net()
    loader = LOADERS[kind](example.data(), batch_size=12, shuffle=True)
    saver = pl.callbacks.ModelCheckpoint(dirpath=root, filename="step={step}", auto_insert_metric_name=False,
                                         every_n_train_steps=cut, save_top_k=-1)
    trainer = pl.Trainer(max_steps=STEPS, deterministic=True, logger=False, enable_progress_bar=False,
                         enable_model_summary=False, accelerator="cpu", default_root_dir=str(root),
                         plugins=[CheckpointIO()], callbacks=[Checkpointing(**options), saver])
    trainer.fit(model, loader, ckpt_path=ckpt_path)
    return model, trainer


@pytest.fixture(scope="module")
def straight(tmp_path_factory):
    """A straight run per (loader, cut), made once: its directory, its bytes, its steps' records."""
    runs = {}

    def run(kind: str, cut: int):
        if (kind, cut) not in runs:
            root = tmp_path_factory.mktemp(f"straight-{kind}")
            model, trainer = train(root, kind, cut)
            runs[kind, cut] = root, state_bytes(model, trainer), model.record.steps
        return runs[kind, cut]
    return run


@pytest.mark.parametrize("kind, cut", [("stateful", 11), ("plain", 8)],
                         ids=["stateful-loader-mid-epoch", "plain-loader-at-the-epochs-last-batch"])
def test_a_shuffling_loader_resumes_bit_identically(straight, tmp_path, kind, cut):
    root, want, steps = straight(kind, cut)
    model, trainer = train(tmp_path, kind, cut, os.path.join(root, f"step={cut}.ckpt"))
    assert trainer.global_step == STEPS
    assert model.record.steps == steps[cut:]                      # the same batches, in the same order
    assert differing(state_bytes(model, trainer), want) == []


def test_the_resume_without_the_rng_states_diverges(straight, tmp_path):
    root, want, _ = straight("stateful", 11)
    model, trainer = train(tmp_path, "stateful", 11, os.path.join(root, "step=11.ckpt"), restore_rng=False)
    assert {"model/net.0.weight", "model/net.4.weight"} <= set(differing(state_bytes(model, trainer), want))
