"""Where the data stands, as users hold it: a torchdata ``StatefulDataLoader`` given in ``state=``
saves its position (its state is JSON plus the shuffling generator's bytes, in the companion) and
a run cut mid-epoch and resumed draws the exact next batches, ending bit-identical to a straight
run (the manager tutorial's recipe too, run as written); a loader whose position cannot be saved is
refused when the manager is built, naming the fix."""
from __future__ import annotations

import json
import warnings

import pytest

torch = pytest.importorskip("torch")
stateful = pytest.importorskip("torchdata.stateful_dataloader")
from ckptfmt.torch import CheckpointManager  # noqa: E402

TOTAL = 23          # 7 batches an epoch: the cut (a generation at 15, steps 16-17 lost) is mid-epoch 3


def leg(run, stop: int, make_loader) -> tuple[list, list]:
    """One process's life: built from scratch, restored, trained to ``stop``, left without a save
    (what a SIGKILL leaves); the parameters and the batches it drew."""
    torch.manual_seed(0)
    x = torch.randn(40, 4)
    data = torch.utils.data.TensorDataset(torch.arange(40), x, x.sum(1, keepdim=True))
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Dropout(0.1), torch.nn.Linear(8, 1))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    loader = make_loader(data)
    drawn = []
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        mgr = CheckpointManager(run, model, opt, state={"data": loader}, every=5, handle_signals=False)
        step = mgr.restore()
        while step < stop:
            for ids, xb, yb in loader:
                step += 1
                drawn.append(ids.tolist())
                loss = torch.nn.functional.mse_loss(model(xb), yb)
                opt.zero_grad()
                loss.backward()
                opt.step()
                mgr.step(step, loss=loss.item())
                if step == stop:
                    break
        mgr.close()                      # no save: the steps after the last generation are lost
    return [p.detach().clone() for p in model.parameters()], drawn


def shuffling(data):
    return stateful.StatefulDataLoader(data, batch_size=6, shuffle=True)


def test_a_stateful_dataloader_resumes_mid_epoch_with_the_exact_next_batches(tmp_path):
    straight, batches = leg(tmp_path / "straight", TOTAL, shuffling)
    leg(tmp_path / "cut", 17, shuffling)
    doc = json.loads((tmp_path / "cut" / "step_000015.json").read_text())
    saved = doc["state"]["data"]
    assert saved["_num_yielded"] == 1                          # one batch into the third epoch
    generator = saved["_sampler_iter_state"]["sampler_iter_state"]["generator"]
    assert generator["__tensor__"] == "state.data/_sampler_iter_state/sampler_iter_state/generator"   # companion
    resumed, after = leg(tmp_path / "cut", TOTAL, shuffling)
    assert after == batches[15:]                               # the rest of the epoch, then the next ones
    assert all(torch.equal(a, b) for a, b in zip(straight, resumed))


def test_a_plain_dataloader_in_state_is_refused_when_the_manager_is_built_naming_the_fix(tmp_path):
    data = torch.utils.data.TensorDataset(torch.arange(8))
    model = torch.nn.Linear(2, 1)
    with pytest.raises(TypeError, match=r"state\['data'\]: a DataLoader cannot save its position in the epoch.*"
                                        r"StatefulDataLoader.*use_stateful_dataloader=True"):
        CheckpointManager(tmp_path / "run", model, torch.optim.AdamW(model.parameters()),
                          state={"data": torch.utils.data.DataLoader(data, shuffle=True)}, handle_signals=False)
    assert not (tmp_path / "run" / "step_000000.json").exists()
    shuffled_by_torch = stateful.StatefulDataLoader(data, sampler=torch.utils.data.RandomSampler(data))
    with pytest.raises(TypeError, match=r"state\['data'\]: its BatchSampler around a shuffling RandomSampler "
                                        r"cannot save the epoch's order"):
        CheckpointManager(tmp_path / "run", model, torch.optim.AdamW(model.parameters()),
                          state={"data": shuffled_by_torch}, handle_signals=False)


def test_the_tutorials_loader_recipe_cut_mid_epoch_resumes_bit_exactly(tmp_path, monkeypatch):
    """The manager tutorial's block, as written, run straight to step 10 in one directory; in
    another, run to step 7 (mid-epoch 3: three batches an epoch; its close commits 7) and then run
    again to 10, as a second process would: the two step-10 generations are byte-identical."""
    import re
    from pathlib import Path
    text = (Path(__file__).parents[2] / "docs" / "tutorials" / "manager.md").read_text()
    block = next(b for b in re.findall(r"```python\n(.*?)```", text, re.S) if "StatefulDataLoader(" in b)
    assert "total = 10" in block

    def run(where, total: int) -> None:
        monkeypatch.chdir(where)
        exec(compile(block.replace("total = 10", f"total = {total}"), "manager.md", "exec"), {})

    for where in ("straight", "cut"):
        (tmp_path / where).mkdir()
    run(tmp_path / "straight", 10)
    run(tmp_path / "cut", 7)
    run(tmp_path / "cut", 10)
    final = [(tmp_path / w / "runs" / "data" / "step_000010.bin").read_bytes() for w in ("straight", "cut")]
    assert final[0] == final[1]
