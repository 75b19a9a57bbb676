"""The ways a user starts ckptfmt: ``python -m ckptfmt``, the console script, the torchrun form's
module, an old module path, and every command without the torch extra installed."""
from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest

import ckptfmt
from conftest import without_torch


def run(*argv: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, *argv], capture_output=True, text=True, timeout=300)


def test_python_dash_m_ckptfmt_is_the_command_line():
    result = run("-m", "ckptfmt", "--help")
    assert result.returncode == 0, result.stderr
    assert "convert" in result.stdout and "verify-resume" in result.stdout


def test_the_old_trainer_module_says_what_replaced_it_in_one_line():
    result = run("-m", "ckptfmt.trainer", "--steps", "3")
    assert result.returncode == 2
    assert result.stderr.count("\n") == 1 and "is now `ckptfmt train`" in result.stderr, result.stderr


@pytest.mark.parametrize("command", [["train", "--run", "{tmp}/run", "--steps", "2"],
                                     ["verify-resume", "--output", "{tmp}/verify"]])
def test_a_command_that_runs_a_trainer_without_torch_names_the_extra(tmp_path, command):
    result = without_torch(*[c.format(tmp=tmp_path) for c in command])
    assert result.returncode == 2, result.stderr
    assert result.stderr == f"ckptfmt: {command[0]} needs torch: pip install 'ckptfmt[torch]'\n"
    assert list(tmp_path.iterdir()) == []


def test_the_file_commands_run_without_torch_and_a_pt_names_the_extra(tmp_path):
    path = tmp_path / "step_000001.bin"
    ckptfmt.save(path, 1, *(np.ones(3, "<f4"),) * 3)
    for args in (["inspect", path], ["validate", path], ["diff", path, path]):
        result = without_torch(*args)
        assert result.returncode == 0, (args, result.stderr)
    result = without_torch("convert", path, tmp_path / "x.pt")
    assert result.returncode == 2
    assert "needs torch: pip install 'ckptfmt[torch]'" in result.stderr and result.stderr.count("\n") == 1
    assert not (tmp_path / "x.pt").exists()
