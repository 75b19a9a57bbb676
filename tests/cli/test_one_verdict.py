"""One verdict per thing: every command that reads an input (inspect, validate, diff, convert)
knows it as the same kind and judges it alike: a DCP directory that torch itself wrote, one
ckptfmt wrote (verified against the .bin its arrays make) or an older ckptfmt wrote, a foreign
checkpoint whose optimizer has several unnamed param groups, Hugging Face model and
Trainer directories, a directory that holds only foreign checkpoint files, a live run before
its first commit."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import warnings

import pytest
import torch
import numpy as np
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import get_state_dict
from safetensors.torch import save_file

import ckptfmt
from ckptfmt import fingerprint
from ckptfmt import manifest as mf
from ckptfmt import reader
from conftest import cli, without_torch
from models import train_steps, two_layer


def _dcp_save(state, path):
    with warnings.catch_warnings():          # one process: DCP warns that it assumes so
        warnings.simplefilter("ignore")
        dcp.save(state, checkpoint_id=str(path))


def nanogpt_like(seed=0):
    """Two param groups that do not name their parameters (decay: matrices, no decay: the
    rest), as nanoGPT's ``configure_optimizers`` builds them, after a few steps."""
    model = two_layer(seed)
    decay = [p for p in model.parameters() if p.dim() >= 2]
    rest = [p for p in model.parameters() if p.dim() < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1}, {"params": rest, "weight_decay": 0.0}])
    train_steps(model, opt, 3)
    return model, opt


def one_group(seed=0):
    model = two_layer(seed)
    opt = torch.optim.AdamW(model.parameters())
    train_steps(model, opt, 3)
    return model, opt


def verdicts(path):
    """(exit code of inspect, of validate, of convert into a .bin) and validate's status."""
    out = path.parent / f"{path.name}.converted.bin"
    report = cli("validate", "--json", path)
    codes = cli("inspect", path).returncode, report.returncode, cli("convert", path, out).returncode
    return codes, json.loads(report.stdout)["status"] if report.stdout else report.stderr


def test_a_dcp_directory_torch_wrote_is_foreign_and_unverified_in_every_command(tmp_path):
    model, opt = one_group()
    torch.save({"model": model.state_dict(), "optimizer": opt.state_dict()}, tmp_path / "same.pt")
    _dcp_save({"model": model.state_dict()}, tmp_path / "flat")
    _dcp_save({"model": model.state_dict(), "optimizer": opt.state_dict()}, tmp_path / "both")
    _dcp_save({"model": model.state_dict(), "optim": opt.state_dict()}, tmp_path / "optim")      # torchtitan's key
    for name in ("flat", "both", "optim"):
        assert verdicts(tmp_path / name) == ((0, 0, 0), "unverified"), name
        said = cli("inspect", tmp_path / name).stdout
        assert "kind dcp (torch.distributed.checkpoint directory, foreign)" in said and "unverified" in said
        assert "no digest of its own (unverified)" in said
        said = cli("validate", tmp_path / name).stdout
        assert "unverified: no digest of its own" in said and "OK (unverified)" in said, said
        listed = cli("ls", tmp_path / name)                     # the directory's kind, not its data files'
        assert listed.returncode == 0 and f"{tmp_path / name}: torch.distributed.checkpoint directory" in listed.stdout
    for name in ("both", "optim", "both.converted.bin"):       # the moments are the optimizer's, by name
        out = cli("diff", tmp_path / name, tmp_path / "same.pt")
        assert out.returncode == 0 and "bit-identical" in out.stdout, (name, out.stdout)
    weights_only = cli("diff", tmp_path / "flat", tmp_path / "same.pt")
    assert weights_only.returncode == 1 and "weights  identical" in weights_only.stdout


def _ours_dcp(tmp_path):
    """(a .bin with a layout and an optimizer, the DCP directory ``convert --to dcp`` makes of it)."""
    model, opt = one_group()
    torch.save({"model": model.state_dict(), "optimizer": opt.state_dict()}, tmp_path / "same.pt")
    src = tmp_path / "step_000003.bin"
    assert cli("convert", tmp_path / "same.pt", src).returncode == 0
    assert cli("convert", src, tmp_path / "ours", "--to", "dcp").returncode == 0
    return src, tmp_path / "ours"


def _older_dcp(src, dst):
    """The DCP directory ``convert --to dcp`` wrote before its embedded manifest recorded the
    .bin its arrays make: the same keys, the manifest sealed without that record."""
    with ckptfmt.open(src) as ck:
        extra = {k: v for k, v in ck.manifest.items() if k not in mf.REQUIRED}
        weights, m, v = ({name: torch.from_numpy(np.array(ck.tensor(name, r))) for name in ck.names()}
                         for r in ("weights", "m", "v"))
        opt = ck.manifest["optimizer"]
        state = {"model": weights,
                 "optim": {"state": {name: {"exp_avg": m[name], "exp_avg_sq": v[name],
                                            "step": torch.tensor(float(opt["step"]))} for name in weights},
                           "param_groups": [dict(g, params=list(weights)) for g in opt["hyperparams"]]},
                 "ckptfmt": {"step": torch.tensor(ck.step, dtype=torch.int64),
                             "manifest": torch.frombuffer(bytearray(json.dumps(mf.sealed(extra)).encode()),
                                                          dtype=torch.uint8)}}
    assert "dcp" not in extra
    _dcp_save(state, dst)


def test_a_dcp_directory_ckptfmt_wrote_is_verified_against_the_bin_its_arrays_make(tmp_path):
    src, ours = _ours_dcp(tmp_path)
    assert verdicts(ours) == ((0, 0, 0), "verified")
    said = cli("validate", ours)
    assert said.stdout.strip() == f"{ours}: OK (verified)", said.stdout
    digest = fingerprint.of_file(src)
    shown = cli("inspect", ours).stdout
    assert "kind dcp (torch.distributed.checkpoint directory, written by ckptfmt)" in shown
    assert f"recorded blake3 {digest}" in shown and "unverified" not in shown
    from ckptfmt.torch import dcp as ckdcp
    assert ckdcp.read(str(ours)).recorded == {"bin_blake3": digest, "bin_size": src.stat().st_size}
    (tmp_path / "back").mkdir()
    back = cli("convert", ours, tmp_path / "back" / src.name)
    assert back.returncode == 0 and "verified: round-trip (source matched its own digest)" in back.stdout, back.stdout
    assert (tmp_path / "back" / src.name).read_bytes() == src.read_bytes()
    assert "dcp" not in mf.read(tmp_path / "back" / "step_000003.json")      # the .bin's manifest is its own


def test_a_flipped_value_in_a_dcp_data_file_is_a_defect_naming_the_directory(tmp_path):
    src, ours = _ours_dcp(tmp_path)
    with ckptfmt.open(src) as ck:
        value = ck.tensor("0.weight").tobytes()
    (data,) = ours.glob("__0_0.distcp")
    raw = bytearray(data.read_bytes())
    assert raw.count(value) == 1
    raw[raw.index(value) + 1] ^= 0x01                        # a mantissa bit of the first weight: still finite
    data.write_bytes(bytes(raw))
    said = cli("validate", ours)
    assert said.returncode == 1, said.stdout
    assert f"{ours}: DAMAGED" in said.stdout
    assert f"defect: {ours}: its arrays do not match the recorded blake3: its embedded manifest says " \
           f"{fingerprint.of_file(src)}, the .bin of its arrays hashes to " in said.stdout, said.stdout
    assert json.loads(cli("validate", "--json", ours).stdout)["status"] == "damaged"
    (tmp_path / "x").mkdir()
    out = cli("convert", ours, tmp_path / "x" / "step_000003.bin")
    assert out.returncode == 1 and f"{ours}: its arrays do not match the recorded blake3" in out.stderr, out.stderr
    assert list((tmp_path / "x").iterdir()) == []                          # nothing was written
    assert cli("convert", ours, tmp_path / "x" / "w.safetensors").returncode == 1
    assert list((tmp_path / "x").iterdir()) == []


def test_a_dcp_directory_of_an_older_ckptfmt_is_unverified_and_says_why(tmp_path):
    src, _ = _ours_dcp(tmp_path)
    _older_dcp(src, tmp_path / "older")
    assert verdicts(tmp_path / "older") == ((0, 0, 0), "unverified")
    said = cli("validate", tmp_path / "older")
    assert f"{tmp_path / 'older'}: OK (unverified)" in said.stdout
    assert "unverified: written by an older ckptfmt: its arrays carry no digest" in said.stdout, said.stdout
    shown = cli("inspect", tmp_path / "older").stdout
    assert "kind dcp (torch.distributed.checkpoint directory, written by ckptfmt)" in shown
    assert "written by an older ckptfmt: its arrays carry no digest (unverified)" in shown
    (tmp_path / "back").mkdir()
    back = cli("convert", tmp_path / "older", tmp_path / "back" / src.name)
    assert back.returncode == 0 and "source unverified: written by an older ckptfmt" in back.stdout, back.stdout
    assert (tmp_path / "back" / src.name).read_bytes() == src.read_bytes()


def test_a_dcp_directory_of_get_state_dict_is_read_by_parameter_name(tmp_path):
    """torch's documented model + optimizer DCP save: the optimizer's state under each parameter's
    name and param groups that list names, in another order than the model's, with no --groups."""
    model, opt = nanogpt_like()
    msd, osd = get_state_dict(model, opt)
    assert [g["params"] for g in osd["param_groups"]] == [["0.weight", "1.weight"], ["0.bias", "1.bias"]]
    _dcp_save({"model": msd, "optimizer": osd}, tmp_path / "dcp")
    assert verdicts(tmp_path / "dcp") == ((0, 0, 0), "unverified")
    said = cli("inspect", tmp_path / "dcp").stdout
    assert "kind dcp (torch.distributed.checkpoint directory, foreign)" in said and "unverified" in said
    same = cli("diff", tmp_path / "dcp", tmp_path / "dcp")
    assert same.returncode == 0 and "bit-identical" in same.stdout, same.stdout
    with reader.open(tmp_path / "dcp.converted.bin", check_name=False) as ck:
        assert [row["name"] for row in ck.layout] == [n for n, _ in model.named_parameters()]
        for name, state in osd["state"].items():          # each moment on the parameter it is named for
            np.testing.assert_array_equal(ck.tensor(name, "m"), state["exp_avg"].numpy())
            np.testing.assert_array_equal(ck.tensor(name, "v"), state["exp_avg_sq"].numpy())
        assert ck.manifest["optimizer"]["members"] == [["0.weight", "1.weight"], ["0.bias", "1.bias"]]
    back = cli("diff", tmp_path / "dcp", tmp_path / "dcp.converted.bin")
    assert back.returncode == 0 and "bit-identical" in back.stdout, back.stdout


def test_a_dcp_state_keyed_by_names_that_are_all_digits_stays_keyed_by_name(tmp_path):
    torch.manual_seed(0)
    model = torch.nn.ParameterList([torch.nn.Parameter(torch.randn(3)), torch.nn.Parameter(torch.randn(2, 2))])
    opt = torch.optim.Adam(model.parameters())
    (model[0].sum() + model[1].pow(2).sum()).backward()
    opt.step()
    msd, osd = get_state_dict(model, opt)           # a ParameterList's parameters are named "0", "1"
    _dcp_save({"model": msd, "optimizer": osd}, tmp_path / "dcp")
    assert verdicts(tmp_path / "dcp") == ((0, 0, 0), "unverified")
    with reader.open(tmp_path / "dcp.converted.bin", check_name=False) as ck:
        for name, state in osd["state"].items():
            np.testing.assert_array_equal(ck.tensor(name, "m"), state["exp_avg"].numpy())


def test_a_dcp_group_naming_a_parameter_the_model_lacks_is_a_one_line_refusal(tmp_path):
    model, opt = one_group()
    msd, osd = get_state_dict(model, opt)
    osd["state"]["2.weight"] = osd["state"].pop("1.weight")
    osd["param_groups"][0]["params"] = ["2.weight" if n == "1.weight" else n for n in osd["param_groups"][0]["params"]]
    _dcp_save({"model": msd, "optimizer": osd}, tmp_path / "dcp")
    for args in (["inspect", tmp_path / "dcp"], ["validate", tmp_path / "dcp"], ["convert", tmp_path / "dcp", tmp_path / "o.bin"]):
        out = cli(*args)
        said = (out.stdout + out.stderr).strip()
        assert out.returncode == 2 and "Traceback" not in said and len(said.splitlines()) == 1, (args, said)
        assert f"{tmp_path / 'dcp'}: param_groups lists '2.weight', which is not a key of the model state dict" in said
    assert not (tmp_path / "o.bin").exists()


def test_a_torn_dcp_directory_is_one_line_defect_and_converts_to_nothing(tmp_path):
    model, opt = one_group()
    _dcp_save({"model": model.state_dict(), "optimizer": opt.state_dict()}, tmp_path / "torn")
    for data in (tmp_path / "torn").glob("*.distcp"):
        data.unlink()
    for args in (["inspect", tmp_path / "torn"], ["validate", tmp_path / "torn"],
                 ["diff", tmp_path / "torn", tmp_path / "torn"], ["convert", tmp_path / "torn", tmp_path / "o.bin"]):
        out = cli(*args)
        said = (out.stdout + out.stderr).strip().splitlines()
        assert out.returncode == 1 and "Traceback" not in out.stderr, (args, out.stderr)
        assert any(f"{tmp_path / 'torn'}: not a readable DCP directory: FileNotFoundError" in line for line in said)
    assert not (tmp_path / "o.bin").exists()
    (tmp_path / "junk").mkdir()
    (tmp_path / "junk" / ".metadata").write_bytes(b"not a pickle")
    out = cli("validate", tmp_path / "junk")
    assert out.returncode == 1 and "junk: not a readable DCP directory: .metadata: " in out.stdout


def test_several_unnamed_param_groups_are_read_in_the_optimizers_order(tmp_path):
    model, opt = nanogpt_like()
    obj = {"model": model.state_dict(), "optimizer": opt.state_dict(), "iter_num": 3}
    torch.save(obj, tmp_path / "ckpt.pt")
    _dcp_save(obj, tmp_path / "dcp")
    assert cli("validate", tmp_path / "ckpt.pt").returncode == 0
    said = cli("inspect", "--json", "--tensors", tmp_path / "ckpt.pt")
    d = json.loads(said.stdout)
    assert said.returncode == 0 and d["optimizer"] == "AdamW" and "optimizer's order" in d["moments"]
    state = opt.state_dict()["state"]
    moments = torch.cat([state[i]["exp_avg"].reshape(-1) for i in range(4)])
    assert d["regions"]["m"]["max_abs"] == pytest.approx(float(moments.abs().max()))
    assert all(set(rows) == {"weights"} for rows in d["tensors"].values())    # no moment is said to be a parameter's
    same = cli("diff", tmp_path / "ckpt.pt", tmp_path / "dcp")
    assert same.returncode == 0 and "bit-identical" in same.stdout
    torch.save({**obj, "iter_num": 4}, tmp_path / "other.pt")
    state[0]["exp_avg"][0, 0] += 1.0
    torch.save({"model": model.state_dict(), "optimizer": opt.state_dict()}, tmp_path / "moved.pt")
    moved = cli("diff", tmp_path / "ckpt.pt", tmp_path / "moved.pt")
    assert moved.returncode == 1 and "m        1 differ" in moved.stdout and "first at index 0;" not in moved.stdout
    assert "(0.weight" not in moved.stdout.split("m        1 differ")[1]     # no parameter is named for it
    groups = tmp_path / "groups.json"
    groups.write_text(json.dumps([["0.weight", "1.weight"], ["0.bias", "1.bias"]]))
    assert cli("convert", tmp_path / "ckpt.pt", tmp_path / "step_000003.bin").returncode == 2   # which is which: ask
    assert cli("convert", tmp_path / "ckpt.pt", tmp_path / "step_000003.bin", "--groups", groups).returncode == 0
    apart = cli("diff", tmp_path / "ckpt.pt", tmp_path / "step_000003.bin")
    assert apart.returncode == 1 and "compare only with another such file" in apart.stdout


def test_hugging_face_model_directories_of_either_weights_file_read_alike(tmp_path):
    model = two_layer(0)
    (tmp_path / "st").mkdir()
    save_file({k: v.contiguous() for k, v in model.state_dict().items()}, tmp_path / "st" / "model.safetensors")
    (tmp_path / "pt").mkdir()
    torch.save(model.state_dict(), tmp_path / "pt" / "pytorch_model.bin")
    for d in ("st", "pt"):
        (tmp_path / d / "config.json").write_text("{}")
        assert verdicts(tmp_path / d) == ((0, 0, 0), "unverified"), d
        assert "kind hf-model (Hugging Face model directory (save_pretrained), foreign)" in \
            cli("inspect", tmp_path / d).stdout
        assert f"{tmp_path / d}: Hugging Face model directory (save_pretrained)" in cli("ls", tmp_path / d).stdout
    same = cli("diff", tmp_path / "st", tmp_path / "pt")
    assert same.returncode == 0 and "bit-identical" in same.stdout
    for command in ("inspect", "validate"):                     # safetensors need no torch, and say the same
        alone, beside = without_torch(command, tmp_path / "st"), cli(command, tmp_path / "st")
        assert (alone.returncode, alone.stdout) == (beside.returncode, beside.stdout), alone.stderr
    (tmp_path / "compiled").mkdir()                               # torch.compile's names, read as torch reads them
    save_file({"_orig_mod." + k: v.contiguous() for k, v in model.state_dict().items()},
              tmp_path / "compiled" / "model.safetensors")
    (tmp_path / "compiled" / "config.json").write_text("{}")
    same = cli("diff", tmp_path / "compiled", tmp_path / "pt")
    assert same.returncode == 0 and "bit-identical" in same.stdout, same.stdout
    trainer = tmp_path / "out" / "checkpoint-10"                # a Trainer without ckptfmt's callback
    trainer.mkdir(parents=True)
    shutil.copy(tmp_path / "st" / "model.safetensors", trainer)
    (trainer / "trainer_state.json").write_text(json.dumps({"global_step": 10}))
    for path in (tmp_path / "out", trainer):
        assert (cli("inspect", path).returncode, cli("validate", path).returncode) == (0, 0), path
    assert cli("diff", trainer, tmp_path / "pt").returncode == 0


def test_a_directory_of_foreign_checkpoint_files_is_checked_as_those_files(tmp_path):
    model, opt = one_group()
    loose = tmp_path / "loose"
    loose.mkdir()
    torch.save(model.state_dict(), loose / "model.pt")
    torch.save({"model": model.state_dict(), "optimizer": opt.state_dict()}, loose / "ckpt.pt")
    (loose / "notes.txt").write_text("what I tried")
    report = cli("validate", "--json", loose)
    files = json.loads(report.stdout)["details"]["files"]
    assert report.returncode == 0 and [(f["path"].split("/")[-1], f["kind"], f["status"]) for f in files] == \
        [("ckpt.pt", "torch", "unverified"), ("model.pt", "torch", "unverified")]
    shown = cli("inspect", loose)
    assert shown.returncode == 0 and f"{loose / 'ckpt.pt'}\n  kind torch" in shown.stdout
    listed = cli("ls", loose)
    assert listed.returncode == 0 and f"  {loose / 'model.pt'}: torch.save file (zip), not a generation" in listed.stdout
    (loose / "broken.pt").write_bytes((loose / "ckpt.pt").read_bytes()[:300])
    for command in ("validate", "inspect"):
        out = cli(command, loose)
        assert out.returncode == 1 and str(loose / "broken.pt") in out.stdout, (command, out.stdout)
    (tmp_path / "empty").mkdir()
    for command in ("validate", "inspect", "ls"):               # one verdict: ls listed nothing, exit 0
        out = cli(command, tmp_path / "empty")
        assert out.returncode == 1 and "no generation to resume from" in out.stdout, (command, out.stdout)
    assert "NO CHECKPOINT" in cli("ls", tmp_path / "empty").stdout


@pytest.mark.parametrize("saving", [False, True])
def test_a_live_run_before_its_first_commit_is_training_not_a_defect(tmp_path, saving):
    (tmp_path / "run").mkdir()
    first = ("import numpy as np, ckptfmt; from ckptfmt import format as fmt\n"   # its payload, no manifest yet
             "open(sys.argv[1] + '/step_000001.bin', 'wb').write(fmt.pack_header(1, 2) + bytes(24))\n")
    holder = subprocess.Popen([sys.executable, "-c", "import sys, time; from ckptfmt.run import RunLock\n"
                               "RunLock(sys.argv[1], purpose='trainer').acquire()\n" + (first if saving else "") +
                               "print('HELD', flush=True)\ntime.sleep(60)", str(tmp_path / "run")],
                              stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "HELD"
        said = f"no generation yet: training, pid {holder.pid} holds the run"
        for command in ("validate", "inspect", "ls"):
            out = cli(command, tmp_path / "run")
            shown = said if command != "ls" or not saving else "save in progress"    # ls lists the part
            assert out.returncode == 0 and shown in out.stdout, (command, out.stdout)
            assert "latest valid generation" not in out.stdout
    finally:
        holder.kill()
        holder.wait()
    out = cli("validate", tmp_path / "run")                   # the writer went: nothing was committed
    assert (out.returncode, "bare .bin files" in out.stdout) == (0, True) if saving else \
        (out.returncode == 1 and "NO CHECKPOINT" in out.stdout)   # its lone .bin: a bare run (RUN 2.4)


def test_convert_takes_every_weight_file_inspect_takes_into_a_bin(tmp_path):
    model = two_layer(0)
    sd = {k: v.contiguous() for k, v in model.state_dict().items()}
    save_file({k: sd[k] for k in ("0.weight", "0.bias")}, tmp_path / "model-00001-of-00002.safetensors")
    save_file({k: sd[k] for k in ("1.weight", "1.bias")}, tmp_path / "model-00002-of-00002.safetensors")
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": {
        k: f"model-0000{1 + k.startswith('1.')}-of-00002.safetensors" for k in sd}}))
    np.savez(tmp_path / "arrays.npz", **{k: v.numpy() for k, v in sd.items()})
    for source in ("model.safetensors.index.json", "arrays.npz"):
        out = tmp_path / f"{source}.bin"
        assert cli("inspect", tmp_path / source).returncode == 0
        done = cli("convert", tmp_path / source, out)
        assert done.returncode == 0 and "round trip: bytes identical" in done.stdout, done.stderr
        same = cli("diff", out, tmp_path / source)
        assert same.returncode == 0 and "bit-identical" in same.stdout
        refused = cli("convert", tmp_path / source, tmp_path / "x.zst")
        assert refused.returncode == 2 and refused.stderr.count("\n") == 1 and "converts to .bin only" in refused.stderr
    assert not (tmp_path / "x.zst").exists()


def test_optimizer_order_moments_compare_only_in_the_same_order_and_groups(tmp_path):
    model, opt = nanogpt_like()
    sd, osd = model.state_dict(), opt.state_dict()
    torch.save({"model": sd, "optimizer": osd}, tmp_path / "ckpt.pt")
    torch.save({"model": dict(reversed(list(sd.items()))), "optimizer": osd}, tmp_path / "keys_reversed.pt")
    swapped = {"state": {(i + 2) % 4: s for i, s in osd["state"].items()},
               "param_groups": [dict(g, params=[(i + 2) % 4 for i in g["params"]]) for g in reversed(osd["param_groups"])]}
    torch.save({"model": sd, "optimizer": swapped}, tmp_path / "groups_swapped.pt")
    for other in ("keys_reversed.pt", "groups_swapped.pt"):
        out = cli("diff", tmp_path / "ckpt.pt", tmp_path / other)
        assert out.returncode == 1 and "compare only with another such file" in out.stdout, (other, out.stdout)
        assert "m        " not in out.stdout                  # no moment is compared out of its order


def test_a_trainer_checkpoint_saved_without_safetensors_keeps_its_optimizer(tmp_path):
    model, opt = one_group()
    ckpt = tmp_path / "out" / "checkpoint-3"
    ckpt.mkdir(parents=True)
    torch.save(model.state_dict(), ckpt / "pytorch_model.bin")
    torch.save(opt.state_dict(), ckpt / "optimizer.pt")
    (ckpt / "trainer_state.json").write_text(json.dumps({"global_step": 3}))
    torch.save({"model": model.state_dict(), "optimizer": opt.state_dict()}, tmp_path / "same.pt")
    assert (cli("inspect", ckpt).returncode, cli("validate", ckpt).returncode) == (0, 0)
    assert cli("convert", ckpt, tmp_path / "step_000003.bin").returncode == 0
    same = cli("diff", tmp_path / "step_000003.bin", tmp_path / "same.pt")
    assert same.returncode == 0 and "bit-identical" in same.stdout, same.stdout      # step and moments came too


def test_a_torn_or_piped_dcp_directory_of_either_writer_is_a_one_line_defect(tmp_path):
    model, opt = one_group()
    torch.save({"model": model.state_dict(), "optimizer": opt.state_dict()}, tmp_path / "same.pt")
    assert cli("convert", tmp_path / "same.pt", tmp_path / "step_000003.bin").returncode == 0
    assert cli("convert", tmp_path / "step_000003.bin", tmp_path / "ours", "--to", "dcp").returncode == 0
    _dcp_save({"model": model.state_dict()}, tmp_path / "piped")
    (data,) = (tmp_path / "piped").glob("*.distcp")
    data.unlink()
    os.mkfifo(data)                                           # nothing ever writes to it
    for d in ("ours", "piped"):
        if d == "ours":
            for f in (tmp_path / d).glob("*.distcp"):
                f.unlink()
        for args in (["inspect", tmp_path / d], ["validate", tmp_path / d], ["convert", tmp_path / d, tmp_path / "x.bin"]):
            out = cli(*args)
            assert out.returncode == 1 and "Traceback" not in out.stderr, (args, out.stderr)
            said = "not a regular file (a FIFO) in a DCP directory" if d == "piped" else "not a readable DCP directory"
            assert said in out.stdout + out.stderr, (args, out.stdout, out.stderr)
    assert not (tmp_path / "x.bin").exists()


def test_a_dcp_directory_with_unnamed_groups_converts_with_groups(tmp_path):
    model, opt = nanogpt_like()
    _dcp_save({"model": model.state_dict(), "optimizer": opt.state_dict()}, tmp_path / "dcp")
    groups = tmp_path / "groups.json"
    groups.write_text(json.dumps([["0.weight", "1.weight"], ["0.bias", "1.bias"]]))
    assert cli("convert", tmp_path / "dcp", tmp_path / "a.bin").returncode == 2
    assert cli("convert", tmp_path / "dcp", tmp_path / "a.bin", "--groups", groups).returncode == 0


@pytest.mark.parametrize("names", [["step_3.bin"], ["train.bin", "val.bin"], ["training_args.bin", "config.json"]])
def test_what_only_a_name_would_claim_is_no_checkpoint_in_every_command(tmp_path, names):
    rng = np.random.default_rng(0)
    for name in names:                                        # tokens, a misnamed step, a pickle never opened
        (tmp_path / name).write_bytes(rng.integers(0, 50257, 999, dtype=np.uint16).tobytes())
    for command in ("validate", "inspect"):
        out = cli(command, tmp_path)
        assert out.returncode == 1 and "no generation to resume from" in out.stdout + out.stderr, (command, out.stdout)


def test_a_history_beside_foreign_files_is_the_same_verdict_in_validate_and_inspect(tmp_path):
    model, _ = one_group()
    torch.save(model.state_dict(), tmp_path / "model.pt")
    (tmp_path / ".loss.json").write_text(json.dumps({"step": 1, "loss": 2.0, "source": "code"}) + "\n")
    said = "stopped before its first checkpoint: the history holds 1 steps"
    for command in ("validate", "inspect"):
        out = cli(command, tmp_path)
        assert out.returncode == 1 and said in out.stdout, (command, out.stdout)


def test_an_unreadable_record_is_damage_in_inspect_as_in_validate(tmp_path):
    ckpt = tmp_path / "out" / "checkpoint-10"
    ckpt.mkdir(parents=True)
    save_file({k: v.contiguous() for k, v in two_layer(0).state_dict().items()}, ckpt / "model.safetensors")
    (ckpt / "ckptfmt-commit.json").write_text("{garbage")
    for command in ("validate", "inspect"):
        assert cli(command, tmp_path / "out").returncode == 1, command
