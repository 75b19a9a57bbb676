"""A generation whose manifest has no ``rng`` (written by ``ckptfmt.torch.save``, or converted
from a foreign ``.pt``) lacks every RNG piece: ``restore()`` refuses it by name like any other
missing piece; ``strict=False`` goes on and lists them in ``fresh``; ``restore_rng=False`` says
nothing about RNGs."""
from __future__ import annotations

import random
import warnings

import numpy as np
import pytest

torch = pytest.importorskip("torch")

import ckptfmt  # noqa: E402
import ckptfmt.torch as ct  # noqa: E402
from ckptfmt.errors import IncompleteResumeStateError  # noqa: E402
from ckptfmt.torch import CheckpointManager  # noqa: E402
from models import train_steps, two_layer  # noqa: E402

RNG_PIECES = ["rng.python", "rng.numpy_global", "rng.torch_cpu"]


def trained():
    model = two_layer()
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    train_steps(model, opt, 3)
    return model, opt


def manager(run, generators=None):
    model = two_layer(seed=1)
    return model, CheckpointManager(run, model, torch.optim.Adam(model.parameters(), lr=1e-2),
                                    generators=generators, handle_signals=False)


@pytest.fixture
def saved_by_ct_save(tmp_path):
    model, opt = trained()
    (tmp_path / "run").mkdir()
    ct.save(str(tmp_path / "run" / "step_000003.bin"), model, opt, 3)
    assert "rng" not in ckptfmt.open(tmp_path / "run" / "step_000003.bin").manifest
    return tmp_path / "run", model


def test_strict_refuses_a_generation_without_rng_naming_every_rng_piece(saved_by_ct_save):
    run, _ = saved_by_ct_save
    model, mgr = manager(run, {"noise": np.random.default_rng(0)})
    before = [p.detach().clone() for p in model.parameters()]
    with mgr, pytest.raises(IncompleteResumeStateError) as err:
        mgr.restore()
    assert ("cannot resume: the checkpoint lacks rng.python, rng.numpy_global, rng.torch_cpu, "
            "rng.generators.noise (CheckpointManager.restore(strict=False) would go on without them)") \
        in str(err.value)
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))     # nothing copied


def test_not_strict_goes_on_lists_the_rng_pieces_and_leaves_the_rngs_as_they_were(saved_by_ct_save):
    run, original = saved_by_ct_save
    model, mgr = manager(run)
    random.seed(9)
    state = random.getstate()
    with mgr:
        with pytest.warns(UserWarning, match="rng.python starts fresh"):
            assert mgr.restore(strict=False) == 3
        assert mgr.fresh == RNG_PIECES
        assert random.getstate() == state
    assert all(torch.equal(a, b) for a, b in zip(original.parameters(), model.parameters()))


def test_without_rng_restore_nothing_about_rngs_is_said(saved_by_ct_save):
    run, _ = saved_by_ct_save
    _, mgr = manager(run)
    with mgr, warnings.catch_warnings():
        warnings.simplefilter("error")
        assert mgr.restore(restore_rng=False) == 3
        assert mgr.fresh == []


def test_a_converted_foreign_pt_is_refused_the_same_way(tmp_path):
    from ckptfmt.tools.convert import convert
    model, opt = trained()
    torch.save({"model": model.state_dict(), "optimizer": opt.state_dict()}, tmp_path / "foreign.pt")
    (tmp_path / "run").mkdir()
    convert(str(tmp_path / "foreign.pt"), str(tmp_path / "run" / "step_000003.bin"))
    _, mgr = manager(tmp_path / "run")
    with mgr:
        with pytest.raises(IncompleteResumeStateError, match="the checkpoint lacks " + ", ".join(RNG_PIECES)):
            mgr.restore()
        with pytest.warns(UserWarning, match="starts fresh"):
            assert mgr.restore(strict=False) == 3
        assert mgr.fresh == RNG_PIECES
