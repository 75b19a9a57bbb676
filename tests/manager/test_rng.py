"""One RNG API: ``ct.rng_state`` / ``ct.restore_rng`` are what the manager writes and reads and
what the mini trainer uses; the mini trainer's earlier manifest shape (``rng.numpy``) still
resumes, to the same values."""
from __future__ import annotations

import json
import random
import sys

import numpy as np
import pytest

torch = pytest.importorskip("torch")

import ckptfmt  # noqa: E402
import ckptfmt.torch as ct  # noqa: E402
import warm  # noqa: E402
from ckptfmt.errors import IncompleteResumeStateError  # noqa: E402
from ckptfmt.torch import CheckpointManager  # noqa: E402

PY = sys.executable


def draws(gens):
    return (random.random(), float(np.random.random()), torch.rand(1).item(),
            *(g.random() if isinstance(g, np.random.Generator) else torch.rand(1, generator=g).item()
              for g in gens.values()))


def test_the_manager_writes_what_rng_state_returns(tmp_path):
    model = torch.nn.Linear(2, 1)
    gens = {"noise": np.random.default_rng(0), "drop": torch.Generator().manual_seed(1)}
    with CheckpointManager(tmp_path, model, torch.optim.Adam(model.parameters()), generators=gens,
                           handle_signals=False) as mgr:
        mgr.save(1)
        saved = ckptfmt.open(tmp_path / "step_000001.bin").manifest["rng"]
    assert saved == json.loads(json.dumps(ct.rng_state(gens)))        # nothing drew in between
    assert sorted(saved) == ["generators", "numpy_global", "python", "torch_cpu"]
    assert saved["generators"]["noise"]["kind"] == "numpy" and saved["generators"]["drop"]["kind"] == "torch"


def test_restore_rng_puts_back_every_rng_including_torch_generators_and_skips_what_it_is_told():
    gens = {"noise": np.random.default_rng(0), "drop": torch.Generator().manual_seed(1)}
    state = json.loads(json.dumps(ct.rng_state(gens)))
    want = draws(gens)
    ct.restore_rng(state, gens)
    assert draws(gens) == want
    random.seed(3)
    skipped = random.getstate()
    ct.restore_rng(state, gens, skip={"python"})
    assert random.getstate() == skipped
    with pytest.raises(IncompleteResumeStateError, match=r"manifest lacks rng\.generators\.other"):
        ct.restore_rng(state, {"other": np.random.default_rng(5)})


def test_restore_rng_reads_the_mini_trainers_earlier_shape():
    gen = np.random.default_rng(7)
    new = ct.rng_state({"pcg64": gen})
    old = {"python": new["python"], "numpy": {"pcg64": new["generators"]["pcg64"]["state"]},
           "torch_cpu": new["torch_cpu"]}
    want = (random.random(), gen.random(), torch.rand(1).item())
    np.random.seed(11)
    global_numpy = np.random.random()
    np.random.seed(11)
    ct.restore_rng(old, {"pcg64": gen})
    assert (random.random(), gen.random(), torch.rand(1).item()) == want
    assert np.random.random() == global_numpy             # never recorded in that shape: left alone
    with pytest.raises(IncompleteResumeStateError, match=r"manifest lacks rng\.torch_cpu"):
        ct.restore_rng({k: v for k, v in old.items() if k != "torch_cpu"}, {"pcg64": gen})


OLD_SHAPE = """
import sys
from ckptfmt.trainer import mini
from ckptfmt import torch as ct
m = mini.Mini()
for _ in range(5):
    m.update()
doc = m.manifest()
new = doc["rng"]
doc["rng"] = {"python": new["python"], "numpy": {"pcg64": new["generators"]["pcg64"]["state"]},
              "torch_cpu": new["torch_cpu"]}
ct.save(sys.argv[1], m.model, m.opt, m.step, manifest=doc)
"""


def mini(*args: str) -> None:
    """A run of the mini trainer: a process of its own, forked from the warm parent (tests/warm.py)."""
    proc = warm.run([PY, "-B", "-m", "ckptfmt.trainer.mini", *args], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr


@pytest.mark.timeout(30)
def test_the_mini_trainer_uses_the_same_pair_and_still_resumes_its_earlier_shape(tmp_path):
    mini("--steps", "5", "--output", str(tmp_path / "cut"))
    now = tmp_path / "cut" / "step_000005.bin"
    rng = ckptfmt.open(now).manifest["rng"]
    assert sorted(rng) == ["generators", "numpy_global", "python", "torch_cpu"]
    assert rng["generators"]["pcg64"]["kind"] == "numpy"
    (tmp_path / "old").mkdir()
    before = tmp_path / "old" / "step_000005.bin"
    proc = warm.run([PY, "-B", "-c", OLD_SHAPE, str(before)], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert "numpy" in ckptfmt.open(before).manifest["rng"]
    mini("--steps", "4", "--resume", str(now), "--output", str(tmp_path / "a"))
    mini("--steps", "4", "--resume", str(before), "--output", str(tmp_path / "b"))
    a, b = (json.loads((tmp_path / d / "summary.json").read_text()) for d in ("a", "b"))
    assert a["steps"] == b["steps"] and a["final"] == b["final"]
    mini("--steps", "9", "--output", str(tmp_path / "straight"))
    straight = json.loads((tmp_path / "straight" / "summary.json").read_text())
    assert a["final"] == straight["final"]                 # and both are the unbroken run's
