"""Every kind of file through every file command (spec/FORMAT.md §8.6): a corpus generated here
of ckptfmt's own conversions of a seed .bin and of foreign files (a real torch.save of a tiny
model + AdamW in zip and legacy form as .pt, .ckpt and pytorch_model.bin; safetensors, a sharded
safetensors with its index.json, np.savez, a DCP directory), each run through inspect, validate,
diff (against itself and against its source) and convert, exit code and message asserted."""
from __future__ import annotations

import json
import warnings

import numpy as np
import pytest
import torch
from safetensors.torch import save_file

from ckptfmt.cli import main
from ckptfmt.run import active_leases
from ckptfmt.tools.convert import convert
from ckptfmt.tools.diff import leased
from models import train_steps, two_layer_adamw

B = "step_000003.bin"


def run(runner, *args):
    return runner.invoke(main, list(map(str, args)), catch_exceptions=False)


def _foreign(root):
    """name -> (path, the .bin it converts into, or None where convert cannot read it)."""
    model, opt = two_layer_adamw()
    train_steps(model, opt, 3)
    obj = {"model": model.state_dict(), "optimizer": opt.state_dict(), "iter_num": 3}
    (root / "hf").mkdir()
    files = {"torch-zip.pt": root / "ck.pt", "torch-zip.ckpt": root / "lightning.ckpt",
             "pytorch_model.bin": root / "hf" / "pytorch_model.bin"}
    for path in files.values():
        torch.save(obj, path)
    files["torch-legacy.pt"] = root / "legacy.pt"
    torch.save(obj, files["torch-legacy.pt"], _use_new_zipfile_serialization=False)
    sd = {k: v.contiguous() for k, v in model.state_dict().items()}
    save_file(sd, root / "w.safetensors")
    (root / "sharded").mkdir()
    names = sorted(sd)
    parts = {"model-00001-of-00002.safetensors": names[::2], "model-00002-of-00002.safetensors": names[1::2]}
    for fname, keys in parts.items():
        save_file({k: sd[k] for k in keys}, root / "sharded" / fname)
    index = {"metadata": {"total_size": 0}, "weight_map": {k: f for f, ks in parts.items() for k in ks}}
    (root / "sharded" / "model.safetensors.index.json").write_text(json.dumps(index))
    np.savez(root / "arrays.npz", **{k: v.numpy() for k, v in sd.items()})
    out = {name: (path, 3) for name, path in files.items()}
    out.update({"safetensors": (root / "w.safetensors", 0), "npz": (root / "arrays.npz", None),
                "safetensors-index": (root / "sharded" / "model.safetensors.index.json", None)})
    return out


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    """(the seed .bin, {name: path} of ckptfmt's forms, {name: (path, its .bin or None)} foreign)."""
    root = tmp_path_factory.mktemp("kinds")
    foreign = _foreign(root)
    (root / "src").mkdir()
    seed = root / "src" / B
    convert(str(root / "ck.pt"), str(seed))                      # a .bin with layout and optimizer
    ours = {}
    for ext in ("zst", "ckz", "safetensors", "pt", "npz"):
        ours[ext] = root / f"ours.{ext}"
        convert(str(seed), str(ours[ext]))
    convert(str(seed), str(root / "sh"), to="shards")
    ours["shards"] = root / "sh" / "step_000003.json"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        convert(str(seed), str(root / "dcp"), to="dcp")
    ours["dcp"] = root / "dcp"
    converted = {}
    for name, (path, step) in foreign.items():
        if step is not None:
            converted[name] = root / "conv" / name / f"step_{step:06d}.bin"
            converted[name].parent.mkdir(parents=True)
            convert(str(path), str(converted[name]))
    return root, seed, ours, foreign, converted


OURS = ("zst", "ckz", "safetensors", "pt", "npz", "shards", "dcp")
FOREIGN = ("torch-zip.pt", "torch-zip.ckpt", "pytorch_model.bin", "torch-legacy.pt", "safetensors", "npz",
           "safetensors-index")
KIND_OF = {"zst": "zst", "ckz": "planes", "safetensors": "safetensors", "pt": "torch", "npz": "npz",
           "shards": "shards", "dcp": "dcp"}


@pytest.mark.parametrize("name", OURS)
def test_ours_inspect_validate_diff_convert(runner, corpus, tmp_path, name):
    _, seed, ours, _, _ = corpus
    path = ours[name]
    r = run(runner, "inspect", path)
    assert r.exit_code == 0, r.output
    assert f"kind {KIND_OF[name]}" in r.output and "step 3" in r.output
    r = run(runner, "validate", path)
    assert r.exit_code == 0, r.output
    assert f"{path}: OK (verified)" in r.output
    for other in (path, seed):
        r = run(runner, "diff", path, other)
        assert r.exit_code == 0 and "bit-identical" in r.output, r.output
    r = run(runner, "convert", path, tmp_path / B)
    assert r.exit_code == 0, r.output
    assert "verified:" in r.output


@pytest.mark.parametrize("name", FOREIGN)
def test_foreign_inspect_validate_diff_convert(runner, corpus, tmp_path, name):
    _, _, _, foreign, converted = corpus
    path, step = foreign[name]
    r = run(runner, "inspect", path)
    assert r.exit_code == 0, r.output
    assert "foreign" in r.output and "no digest of its own" in r.output
    r = run(runner, "validate", path)
    assert r.exit_code == 0, r.output
    assert f"{path}: OK (unverified)" in r.output and "unverified: no digest of its own" in r.output
    r = run(runner, "diff", path, path)
    assert r.exit_code == 0 and "bit-identical" in r.output, r.output
    source = converted.get(name) or converted["safetensors"]      # the same tensors, converted
    r = run(runner, "diff", path, source)
    assert r.exit_code == 0 and "bit-identical" in r.output, r.output
    out = tmp_path / f"step_{step or 0:06d}.bin"           # every kind inspect takes, convert takes
    r = run(runner, "convert", path, out)
    assert r.exit_code == 0 and "source unverified" in r.output, r.output
    r = run(runner, "diff", out, path)
    assert r.exit_code == 0 and "bit-identical" in r.output, r.output


def test_foreign_torch_diff_against_another_step_differs(runner, corpus):
    _, seed, _, foreign, _ = corpus
    r = run(runner, "diff", foreign["torch-zip.pt"][0], foreign["safetensors"][0])
    assert r.exit_code == 1 and "different" in r.output       # same weights, m and v differ
    r = run(runner, "diff", "--json", foreign["pytorch_model.bin"][0], seed)
    assert r.exit_code == 0 and json.loads(r.output)["kinds"] == ["torch", "bin"]


def test_truncated_generation_stays_damaged(runner, corpus, tmp_path):
    _, seed, _, _, _ = corpus
    torn = tmp_path / B
    torn.write_bytes(seed.read_bytes()[:-100])
    r = run(runner, "validate", torn)
    assert r.exit_code == 1 and "DAMAGED" in r.output and "truncated" in r.output
    for cmd in (["inspect", torn], ["diff", torn, seed]):
        r = run(runner, *cmd)
        assert r.exit_code == 1 and "truncated" in r.stderr


def test_random_bytes_named_bin_are_a_defect_and_unnamed_are_unknown(runner, tmp_path, corpus):
    _, seed, _, _, _ = corpus
    data = np.random.default_rng(3).integers(0, 256, 5000, dtype=np.uint8).tobytes()
    (tmp_path / "x.bin").write_bytes(data)
    (tmp_path / "blob").write_bytes(data)
    r = run(runner, "validate", tmp_path / "x.bin")
    assert r.exit_code == 1 and "DAMAGED" in r.output
    for cmd in (["validate", tmp_path / "blob"], ["inspect", tmp_path / "blob"], ["diff", tmp_path / "blob", seed],
                ["convert", tmp_path / "blob", tmp_path / "out.npz"]):
        r = run(runner, *cmd)
        assert r.exit_code == 2, (cmd, r.output)
        assert "unknown kind" in r.stderr and str(tmp_path / "blob") in r.stderr and r.stderr.count("\n") == 1
    assert not (tmp_path / "out.npz").exists()


def test_damaged_own_conversion_is_a_defect(runner, corpus, tmp_path):
    _, _, ours, _, _ = corpus
    data = ours["zst"].read_bytes()
    bad = tmp_path / "bad.zst"
    bad.write_bytes(data[:len(data) // 2])
    r = run(runner, "validate", bad)
    assert r.exit_code == 1 and "DAMAGED" in r.output


def test_a_command_that_cannot_read_a_kind_says_which(runner, corpus, tmp_path):
    root, seed, _, _, _ = corpus
    r = run(runner, "diff", root / "src", seed)
    assert r.exit_code == 2 and "run directory" in r.stderr and str(root / "src") in r.stderr
    r = run(runner, "inspect", seed.with_suffix(".json"))
    assert r.exit_code == 2 and "generation manifest" in r.stderr


def test_diff_leases_the_generations_it_reads(corpus, tmp_path):
    _, seed, _, _, _ = corpus
    b = tmp_path / "step_000003.bin"
    convert(str(seed), str(b))
    with leased(b, tmp_path / "other" / "step_000009.bin"):
        (lease,) = active_leases(tmp_path)
        assert lease["purpose"] == "diff" and lease["steps"] == [3]
    assert not active_leases(tmp_path) and not (tmp_path / ".leases").exists()


def test_a_run_holding_files_of_every_kind_goes_through_every_run_command(runner, corpus, tmp_path):
    """Files of other kinds beside the generations (a conversion named like one, a foreign
    torch.save, an index) are named by ls, never taken for damaged generations by validate,
    never deleted by gc, and left out of an export and a fork, each byte unchanged."""
    import shutil
    from conftest import make
    root, seed, ours, foreign, _ = corpus
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    for step in (1, 2, 3):
        make(run_dir, step, seed=step)
    others = {"step_000002.safetensors": ours["safetensors"], "step_000003.zst": ours["zst"],
              "pytorch_model.bin": foreign["pytorch_model.bin"][0], "lightning.ckpt": foreign["torch-zip.ckpt"][0]}
    for name, path in others.items():
        shutil.copyfile(path, run_dir / name)
    before = {name: (run_dir / name).read_bytes() for name in others}
    listed = json.loads(run(runner, "ls", run_dir, "--json").output)
    assert [g["step"] for g in listed["generations"]] == [1, 2, 3]
    assert sorted(listed["foreign"]) == sorted([
        f"{run_dir / 'step_000002.safetensors'}: a safetensors file, not a generation (convert it into a step_N.bin "
        "to make it one)",
        f"{run_dir / 'step_000003.zst'}: a ckptfmt zstd stream (.zst), not a generation (convert it into a "
        "step_N.bin to make it one)"])
    for args in (["validate", run_dir], ["inspect", run_dir], ["gc", run_dir, "--keep-last", "1"],
                 ["export", run_dir, tmp_path / "exported"], ["fork", run_dir, tmp_path / "forked", "--step", "3"]):
        result = run(runner, *args)
        assert result.exit_code == 0, (args, result.output)
    assert {name: (run_dir / name).read_bytes() for name in others} == before
    assert sorted(p.name for p in run_dir.glob("step_*.bin")) == ["step_000003.bin"]
    for copy in ("exported", "forked"):
        assert not set(others) & {p.name for p in (tmp_path / copy).iterdir()}
