"""Every command: exit codes 0/1/2, --json shapes, one-line errors and no tracebacks."""
import json
import struct

import numpy as np
import pytest

import ckptfmt
from ckptfmt.cli import main
from conftest import arrays, cli, make

LAYOUT = [{"name": "x", "shape": [60], "offset": 0}, {"name": "y", "shape": [40], "offset": 60}]


def run(runner, *args):
    result = runner.invoke(main, list(map(str, args)), catch_exceptions=False)
    return result.exit_code, result.output


@pytest.fixture
def bad(tmp_path):
    """Named malformed inputs."""
    good = make(tmp_path, 1, n=10)
    data = good.read_bytes()
    files = {
        "truncated": data[:-3],
        "trailing": data + b"\0",
        "negative_step": struct.pack("<ii", -1, 0),
        "negative_n": struct.pack("<ii", 1, -1),
        "not_a_checkpoint": b"hello, this is a text file\n",
        "empty": b"",
    }
    out = {}
    for name, content in files.items():
        p = tmp_path / f"{name}.bin"
        p.write_bytes(content)
        out[name] = p
    corrupt = tmp_path / "cm"
    corrupt.mkdir()
    cm = make(corrupt, 1, n=10)
    (corrupt / "step_000001.json").write_text("{broken")
    out["corrupt_manifest"] = cm
    return out


def test_help_lists_every_command(runner):
    code, out = run(runner, "--help")
    for cmd in ("inspect", "validate", "diff", "convert", "ls", "gc", "pin", "pivot", "fork", "bisect",
                "plot", "train", "verify-resume", "export", "import", "mirror"):
        assert cmd in out
    assert code == 0


def test_inspect_json_shape(runner, tmp_path):
    w, m, v = arrays(100)
    w[0], m[1] = np.nan, np.inf
    ckptfmt.save(tmp_path / "step_000005.bin", 5, w, m, v, manifest={"layout": LAYOUT})
    code, out = run(runner, "inspect", tmp_path / "step_000005.bin", "--json", "--tensors")
    d = json.loads(out)
    assert code == 0 and d["step"] == 5 and d["n_params"] == 100 and d["size"] == 1208
    assert set(d["regions"]) == {"weights", "m", "v"} and d["fingerprint"] == "verified"
    assert d["regions"]["weights"]["nan"] == 1 and d["regions"]["m"]["inf"] == 1
    assert set(d["tensors"]) == {"x", "y"}
    code, out = run(runner, "inspect", tmp_path / "step_000005.bin")
    assert code == 0 and "fingerprint verified" in out and "weights" in out


def test_inspect_reports_mismatch_and_unverified(runner, tmp_path):
    path = make(tmp_path, 1)
    data = bytearray(path.read_bytes())
    data[20] ^= 1
    path.write_bytes(bytes(data))
    assert json.loads(run(runner, "inspect", path, "--json")[1])["fingerprint"] == "mismatch"
    (tmp_path / "step_000001.json").unlink()
    assert json.loads(run(runner, "inspect", path, "--json")[1])["fingerprint"] == "unverified"


@pytest.mark.parametrize("name", ["truncated", "trailing", "negative_step", "negative_n", "not_a_checkpoint", "empty"])
@pytest.mark.parametrize("command", ["inspect", "validate"])
def test_damaged_inputs_exit_1_with_one_line(runner, bad, name, command):
    code, out = run(runner, command, bad[name])
    assert code == 1, out
    assert "Traceback" not in out and str(bad[name]) in out


def test_corrupt_manifest(runner, bad):
    code, out = run(runner, "validate", bad["corrupt_manifest"])
    assert code == 1 and "not valid JSON" in out
    code, out = run(runner, "inspect", bad["corrupt_manifest"], "--json")
    d = json.loads(out)       # a manifest that cannot be read is not a fingerprint mismatch
    assert code == 0 and d["fingerprint"] == "unchecked" and "not valid JSON" in d["manifest_problem"]


@pytest.mark.parametrize("args", [["inspect", "{missing}"], ["validate", "{missing}"], ["diff", "{missing}", "{file}"],
                                  ["diff", "{dir}", "{file}"], ["convert", "{missing}", "{dir}/x.npz"],
                                  ["ls", "{missing}"], ["ls", "{file}"], ["gc", "{dir}"], ["gc", "{dir}", "--keep-last", "0"],
                                  ["convert", "{file}", "{dir}/x.npz", "--dtype", "float16"], ["frobnicate"]])
def test_cannot_run_exits_2(tmp_path, args):
    f = make(tmp_path, 1)
    subs = {"missing": tmp_path / "nope.bin", "file": f, "dir": tmp_path}
    proc = cli(*[a.format(**subs) for a in args])
    assert proc.returncode == 2, proc.stderr
    assert "Traceback" not in proc.stderr


def test_one_line_errors_in_a_real_process(tmp_path):
    proc = cli("inspect", str(tmp_path / "nope.bin"))
    assert proc.returncode == 2 and proc.stderr.strip().count("\n") == 0 and "nope.bin" in proc.stderr


@pytest.mark.parametrize("args", [["inspect", "{file}", "--tensors"], ["validate", "{file}", "--json"]])
def test_a_reader_that_closes_stdout_ends_the_command_quietly(tmp_path, args):
    """`ckptfmt inspect RUN --tensors | head`: stdout's pipe is closed before the command writes;
    no "[Errno 32] Broken pipe" naming no file, no traceback, no "Exception ignored" at exit."""
    import os
    import subprocess
    from conftest import PY
    f = make(tmp_path, 1)
    read_end, write_end = os.pipe()
    os.close(read_end)                                  # the reader is gone before the first write
    try:
        proc = subprocess.run([PY, "-m", "ckptfmt.cli", *[a.format(file=f) for a in args]], stdout=write_end,
                              stderr=subprocess.PIPE, text=True, timeout=120)
    finally:
        os.close(write_end)
    assert proc.returncode == 2 and proc.stderr == ""


def test_a_usage_error_names_the_command_once(tmp_path):
    proc = cli("gc", str(tmp_path))
    assert proc.returncode == 2 and proc.stderr == ("ckptfmt: gc: Missing a keep rule: --keep-last, --keep-every, "
                                                    "--keep-best, --keep-within or --keep-interval (the guards "
                                                    "alone are no policy). (see --help)\n")


def test_validate_many_and_json(runner, tmp_path, bad):
    good = make(tmp_path, 2)
    code, out = run(runner, "validate", good, "--json")
    d = json.loads(out)
    assert code == 0 and d["ok"] and d["status"] == "verified"
    code, out = run(runner, "validate", good, bad["truncated"], "--json")
    assert code == 1 and [r["ok"] for r in json.loads(out)] == [True, False]
    assert run(runner, "validate", "--fast", good)[0] == 0


def test_diff_exit_codes_and_json(runner, tmp_path):
    a, b = tmp_path / "a", tmp_path / "b"
    a.mkdir(), b.mkdir()
    w, m, v = arrays(100)
    ckptfmt.save(a / "step_000001.bin", 1, w, m, v, manifest={"layout": LAYOUT})
    ckptfmt.save(b / "step_000001.bin", 1, w, m, v, manifest={"layout": LAYOUT})
    code, out = run(runner, "diff", a / "step_000001.bin", b / "step_000001.bin", "--json")
    assert code == 0 and json.loads(out)["identical"] is True
    v2 = v.copy()
    v2[70] *= 1.0001
    ckptfmt.save(b / "step_000001.bin", 1, w, m, v2, manifest={"layout": LAYOUT}, overwrite=True)
    code, out = run(runner, "diff", a / "step_000001.bin", b / "step_000001.bin", "--json", "--tensors")
    d = json.loads(out)
    assert code == 1 and d["identical"] is False and d["regions"]["v"]["first_param"] == "y"
    assert d["tensors"] == {"y": {"v": 1}}
    code, out = run(runner, "diff", a / "step_000001.bin", b / "step_000001.bin")
    assert code == 1 and "y[10]" in out
    assert run(runner, "diff", a / "step_000001.bin", b / "step_000001.bin", "--rtol", "1e-3")[0] == 0


def test_convert_round_trip_and_refusal(runner, tmp_path):
    src = make(tmp_path, 3)
    code, out = run(runner, "convert", src, tmp_path / "x.zst", "--json")
    assert code == 0 and json.loads(out)["verified"] == "round-trip"
    back = tmp_path / "b" / "step_000003.bin"
    back.parent.mkdir()
    assert run(runner, "convert", tmp_path / "x.zst", back)[0] == 0
    assert back.read_bytes() == src.read_bytes()
    proc = cli("convert", str(src), str(tmp_path / "x.zst"))
    assert proc.returncode == 2 and "exists already" in proc.stderr


def test_ls_gc_pin(runner, tmp_path):
    for s in (100, 200, 300, 400, 500):
        make(tmp_path, s, seed=s)
    (tmp_path / ".ckptfmt-tmp.step_000600.bin.1.dead").write_bytes(b"x")
    code, out = run(runner, "ls", tmp_path, "--json")
    d = json.loads(out)
    assert code == 0 and [g["step"] for g in d["generations"]] == [100, 200, 300, 400, 500]
    assert len(d["leftovers"]) == 1
    lines = run(runner, "ls", tmp_path)[1].splitlines()
    assert lines[1].split() == ["step", "size", "age", "status"] and lines[2].split()[0] == "100"
    assert run(runner, "pin", tmp_path, 100)[0] == 0
    rows = json.loads(run(runner, "ls", tmp_path, "--json", "--keep-every", "200")[1])["generations"]
    assert [r["step"] for r in rows if r["milestone"]] == [200, 400] and [r["step"] for r in rows if r["pinned"]] == [100]
    code, out = run(runner, "gc", tmp_path, "--keep-last", "2", "--dry-run", "--json")
    assert code == 0 and json.loads(out)["deleted"] == [200, 300]
    assert (tmp_path / "step_000200.bin").exists()
    code, out = run(runner, "gc", tmp_path, "--keep-last", "2", "--json")
    assert json.loads(out)["deleted"] == [200, 300] and len(json.loads(out)["swept_temps"]) == 1
    assert sorted(p.name for p in tmp_path.glob("step_*.bin")) == ["step_000100.bin", "step_000400.bin", "step_000500.bin"]


def test_version(runner):
    code, out = run(runner, "--version")
    assert code == 0 and ckptfmt.__version__ in out


def test_inspect_of_a_run_without_a_valid_generation(tmp_path):
    path = make(tmp_path, 1)
    data = bytearray(path.read_bytes())
    data[-1] ^= 1
    path.write_bytes(bytes(data[:-4]))
    proc = cli("inspect", str(tmp_path))
    assert proc.returncode == 1 and "no valid generation" in proc.stdout
    assert "ckptfmt: warning: " in proc.stderr and "Traceback" not in proc.stderr


def test_non_finite_values_produce_no_numpy_warnings(tmp_path):
    w, m, v = arrays(100)
    w[:2] = [np.inf, -np.inf]
    m[5] = np.nan
    ckptfmt.save(tmp_path / "step_000001.bin", 1, w, m, v)
    ckptfmt.save(tmp_path / "b.bin", 1, v, m * 0, w)
    for args in (["validate", "step_000001.bin"], ["inspect", "step_000001.bin"], ["diff", "step_000001.bin", "b.bin"]):
        proc = cli(*args, cwd=tmp_path)
        assert proc.returncode in (0, 1) and "Warning" not in proc.stderr and "warning" not in proc.stderr, proc.stderr


@pytest.mark.parametrize("value, says", [
    ('caps={"code":0.5}', "sources ['topics', 'docstrings'] need caps and floors"),   # the help's example, cut short
    ('ctx="x"', "--set: ctx must be an integer >= 1, got 'x'"),
    ("betas=1", "--set: betas must be two numbers in [0, 1), got 1"),
    ("lr=-1", "--set: lr must be a finite number >= 0, got -1"),
    ('sources=["code","pictures"]', "sources must be a non-empty list of code, topics, docstrings"),
    ('caps={"code":0.2,"topics":0.2,"docstrings":0.2}', "caps to at least 1"),
])
def test_train_refuses_a_bad_set_in_one_line_before_the_run_exists(tmp_path, value, says):
    """A --set value of the wrong type or one the bandit cannot use was a traceback (exit 1) from
    deep in the trainer, after the run directory and its lock were made."""
    proc = cli("train", "--run", str(tmp_path / "run"), "--steps", "2", "--set", value)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr
    assert proc.stderr.count("\n") == 1 and proc.stderr.startswith("ckptfmt: ") and says in proc.stderr
    assert not (tmp_path / "run").exists()

