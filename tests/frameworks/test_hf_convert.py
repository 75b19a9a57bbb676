"""``ckptfmt convert`` of Hugging Face directories (spec/RUN.md §12.5): a Trainer's
``checkpoint-N`` into a ``.bin`` that loads into the model and its optimizer (weights from
``model.safetensors``, moments from ``optimizer.pt`` by the record's group names, or ``--groups``
without a record; ``training_args.bin`` never unpickled), and a sharded ``save_pretrained``
directory converted whole or refused in one line, nothing written."""
from __future__ import annotations

import json
import pickle
import sys
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")
from click.testing import CliRunner  # noqa: E402

import ckptfmt.torch as ct  # noqa: E402
from ckptfmt.cli import main  # noqa: E402
from ckptfmt.tools import hfdir  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "examples"))
from hf_trainer import tiny_gpt2  # noqa: E402


class Planted:
    """A pickle that, unpickled, creates the file ``path``: proof that nothing unpickles it."""

    def __init__(self, path: str):
        self.path = path

    def __reduce__(self):
        return (open, (self.path, "w"))


def cli(*args) -> tuple[int, str]:
    result = CliRunner().invoke(main, [str(a) for a in args])
    return result.exit_code, result.output


def trained() -> tuple[torch.nn.Module, torch.optim.Optimizer, list[list[str]]]:
    """A tiny GPT-2 and an AdamW with the Trainer's two groups (decay, no decay), 3 steps in."""
    model = tiny_gpt2()
    named = dict(model.named_parameters())
    groups = [[n for n in named if "bias" not in n and "ln" not in n], [n for n in named if "bias" in n or "ln" in n]]
    opt = torch.optim.AdamW([{"params": [named[n] for n in g], "weight_decay": wd}
                             for g, wd in zip(groups, (0.01, 0.0))], lr=1e-3)
    ids = torch.randint(0, 64, (4, 16), generator=torch.Generator().manual_seed(2))
    for _ in range(3):
        opt.zero_grad()
        model(input_ids=ids, labels=ids).loss.backward()
        opt.step()
    return model, opt, groups


def checkpoint_dir(tmp_path: Path, *, commit: bool = True, shard: str | None = None) -> tuple[Path, tuple]:
    """checkpoint-3 as the Trainer writes it: save_pretrained, optimizer.pt, trainer_state.json
    and a training_args.bin (here a planted pickle); committed as the callback commits it."""
    model, opt, groups = trained()
    d = tmp_path / "out" / "checkpoint-3"
    model.save_pretrained(d, **({"max_shard_size": shard} if shard else {}))
    torch.save(opt.state_dict(), d / "optimizer.pt")
    (d / "trainer_state.json").write_text(json.dumps({"global_step": 3, "log_history": [{"loss": 3.9, "step": 3}]}))
    (d / "training_args.bin").write_bytes(pickle.dumps(Planted(str(tmp_path / "UNPICKLED"))))
    if commit:
        hfdir.commit(d, 3, groups, parameters=[n for n, _ in model.named_parameters()])
    return d, (model, opt, groups)


def loaded(bin_path: Path, groups: list[list[str]]) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    model = tiny_gpt2()
    named = dict(model.named_parameters())
    opt = torch.optim.AdamW([{"params": [named[n] for n in g]} for g in groups], lr=1.0)
    ct.load(str(bin_path), model, opt)
    return model, opt


def same_training_state(a: tuple, b: tuple) -> bool:
    (ma, oa), (mb, ob) = a, b
    pairs = list(zip(ma.parameters(), mb.parameters()))
    return all(torch.equal(x, y) for x, y in pairs) and \
        all(torch.equal(oa.state[x][k], ob.state[y][k]) for x, y in pairs for k in ("exp_avg", "exp_avg_sq")) and \
        [g["weight_decay"] for g in oa.param_groups] == [g["weight_decay"] for g in ob.param_groups]


def test_a_committed_checkpoint_converts_into_a_bin_that_loads_into_the_model_and_optimizer(tmp_path):
    src, (model, opt, groups) = checkpoint_dir(tmp_path)
    dst = tmp_path / "run" / "step_000003.bin"
    dst.parent.mkdir()
    code, text = cli("convert", src, dst)
    assert code == 0 and "verified: round-trip" in text, text
    assert cli("validate", dst)[0] == 0
    assert same_training_state(loaded(dst, groups), (model, opt))
    assert not (tmp_path / "UNPICKLED").exists()                 # training_args.bin never unpickled


def test_a_checkpoint_that_differs_from_its_record_is_refused_before_anything_is_written(tmp_path):
    src, _ = checkpoint_dir(tmp_path)
    data = bytearray((src / "optimizer.pt").read_bytes())
    data[-100] ^= 1
    (src / "optimizer.pt").write_bytes(bytes(data))
    code, text = cli("convert", src, tmp_path / "step_000003.bin")
    assert code == 1 and "does not match its ckptfmt-commit.json: optimizer.pt: blake3 mismatch" in text
    assert not (tmp_path / "step_000003.bin").exists()


def test_without_a_record_the_groups_come_from_the_groups_option(tmp_path):
    src, (model, opt, groups) = checkpoint_dir(tmp_path, commit=False)
    dst = tmp_path / "step_000003.bin"
    code, text = cli("convert", src, dst)
    assert code != 0 and "--groups FILE" in text and not dst.exists()
    (tmp_path / "groups.json").write_text(json.dumps(groups))
    code, text = cli("convert", src, dst, "--groups", tmp_path / "groups.json")
    assert code == 0, text
    named = dict(model.named_parameters())
    from ckptfmt import reader
    with reader.open(str(dst)) as ck:                       # file order without the record: by name
        for row in ck.manifest["layout"]:
            span = slice(row["offset"], row["offset"] + named[row["name"]].numel())
            assert torch.equal(torch.from_numpy(ck.m[span].copy()).view(row["shape"]),
                               opt.state[named[row["name"]]]["exp_avg"]), row["name"]
    assert not (tmp_path / "UNPICKLED").exists()


def test_a_sharded_model_directory_converts_whole_or_is_refused_in_one_line(tmp_path):
    model = tiny_gpt2()
    d = tmp_path / "pretrained"
    model.save_pretrained(d, max_shard_size="40KB")
    shards = sorted(d.glob("model-*-of-*.safetensors"))
    assert len(shards) >= 3 and (d / "model.safetensors.index.json").is_file()
    dst = tmp_path / "step_000000.bin"
    code, text = cli("convert", d, dst)
    assert code == 0, text
    from ckptfmt import reader
    with reader.open(str(dst)) as ck:
        names = [row["name"] for row in ck.manifest["layout"]]
        assert set(names) == set(dict(model.named_parameters())) and ck.n_params == sum(
            p.numel() for p in model.parameters())
    dst.unlink()
    dst.with_suffix(".json").unlink()
    shards[1].unlink()
    code, text = cli("convert", d, dst)
    assert code == 2 and f"{shards[1]}: missing: model.safetensors.index.json names it" in text
    assert "refusing half a model" in text and len(text.strip().splitlines()) == 1
    assert not dst.exists() and not dst.with_suffix(".json").exists()
