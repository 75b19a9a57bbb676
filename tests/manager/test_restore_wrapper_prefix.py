"""A run saved through a DataParallel/DDP or torch.compile wrapper, restored into the bare model
(or the reverse), is refused with the prefix that differs and the fix; the fix then resumes."""
from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from ckptfmt.errors import LayoutMismatchError  # noqa: E402
from ckptfmt.torch import CheckpointManager  # noqa: E402
from models import two_layer  # noqa: E402


def saved(run, model) -> None:
    with CheckpointManager(run, model, torch.optim.AdamW(model.parameters()), handle_signals=False) as mgr:
        mgr.save(3)


def restore(run, model) -> int:
    with CheckpointManager(run, model, torch.optim.AdamW(model.parameters()), handle_signals=False) as mgr:
        return mgr.restore()


def test_a_data_parallel_run_restored_into_the_bare_model_names_the_prefix_and_the_fix(tmp_path):
    saved(tmp_path / "r", torch.nn.DataParallel(two_layer()))
    with pytest.raises(LayoutMismatchError) as err:
        restore(tmp_path / "r", two_layer())
    assert "the checkpoint has 'module.0.weight' (and 3 more), which the model lacks; the model has '0.weight'" \
        in str(err.value)
    assert ("every name in the checkpoint starts with 'module.' (a DataParallel/DDP wrapper), the model's "
            "do not: pass the wrapped model, not model.module") in str(err.value)
    assert restore(tmp_path / "r", torch.nn.DataParallel(two_layer())) == 3


def test_a_bare_run_restored_into_a_data_parallel_model_says_pass_model_module(tmp_path):
    saved(tmp_path / "r", two_layer())
    wrapped = torch.nn.DataParallel(two_layer())
    with pytest.raises(LayoutMismatchError, match=r"every name of the model starts with 'module\.' \(a "
                                                  r"DataParallel/DDP wrapper\), the checkpoint's do not: "
                                                  r"pass model\.module$"):
        restore(tmp_path / "r", wrapped)
    assert restore(tmp_path / "r", wrapped.module) == 3


def test_a_compiled_run_restored_into_the_bare_model_names_orig_mod(tmp_path):
    saved(tmp_path / "r", torch.compile(two_layer()))
    with pytest.raises(LayoutMismatchError, match=r"every name in the checkpoint starts with '_orig_mod\.' "
                                                  r"\(a torch\.compile wrapper\), the model's do not: pass "
                                                  r"the wrapped model, not model\._orig_mod$"):
        restore(tmp_path / "r", two_layer())
    compiled = torch.compile(two_layer())
    saved(tmp_path / "s", two_layer())
    with pytest.raises(LayoutMismatchError, match=r"starts with '_orig_mod\.' .*pass model\._orig_mod$"):
        restore(tmp_path / "s", compiled)
    assert restore(tmp_path / "s", compiled._orig_mod) == 3


def test_names_that_differ_otherwise_get_no_wrapper_hint(tmp_path):
    saved(tmp_path / "r", torch.nn.DataParallel(two_layer()))
    other = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.ReLU(), torch.nn.Linear(4, 1))
    with pytest.raises(LayoutMismatchError) as err:
        restore(tmp_path / "r", torch.nn.DataParallel(other))
    assert "'module.2.weight'" in str(err.value) and "wrapper" not in str(err.value)
