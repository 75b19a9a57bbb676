"""Standard tools work on what we write: ``zstd -d`` gives back the exact
``.bin`` of a ``.zst`` and ``b3sum`` of it prints the manifest's blake3; ``b3sum --check``
passes on the B3SUMS of an export and of a run (and fails when a byte changes). The real
``zstd`` and ``b3sum`` are called: the README's set-up installs them; never skipped."""
from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path

import numpy as np
import pytest

import ckptfmt
from ckptfmt.cli import main
from ckptfmt.tools.convert import convert, load
from ckptfmt.tools.convert import planes as planes_form
from ckptfmt.tools.archive import archive, import_archive
from ckptfmt.tools.export import export
from conftest import arrays, seed_write

GOLDEN = Path(__file__).resolve().parents[1] / "golden" / "v1"


def tool(*args, cwd=None) -> subprocess.CompletedProcess:
    assert shutil.which(args[0]), f"{args[0]} is not installed: see README 'Set-up' (apt-get install zstd b3sum)"
    return subprocess.run(list(map(str, args)), capture_output=True, text=True, cwd=cwd, timeout=120)


@pytest.fixture
def src(tmp_path):
    w, m, v = arrays(3000)
    w[3], w[4] = np.float32(np.nan), -0.0
    path = tmp_path / "step_000042.bin"
    ckptfmt.save(path, 42, w, m, v, manifest={"layout": [{"name": "w", "shape": [3000], "offset": 0}]})
    return path


def test_zstd_d_gives_the_exact_bin_and_b3sum_its_manifest_digest(tmp_path, src):
    convert(str(src), str(tmp_path / "x.zst"))
    out = tmp_path / "plain" / "step_000042.bin"
    out.parent.mkdir()
    proc = tool("zstd", "-d", "-q", tmp_path / "x.zst", "-o", out)
    assert proc.returncode == 0, proc.stderr
    assert out.read_bytes() == src.read_bytes()
    digest = tool("b3sum", "--no-names", out).stdout.strip()
    assert digest == ckptfmt.open(src).manifest["blake3"]
    listing = tool("zstd", "-l", tmp_path / "x.zst").stdout.split("\n")[1].split()
    assert listing[:2] == ["2", "1"]                      # two frames, one of them skippable (the metadata)


def test_a_truncated_zst_fails_in_zstd_and_in_ckptfmt(tmp_path, src):
    convert(str(src), str(tmp_path / "x.zst"))
    data = (tmp_path / "x.zst").read_bytes()
    (tmp_path / "t.zst").write_bytes(data[:-30])
    assert tool("zstd", "-d", "-q", "-c", tmp_path / "t.zst").returncode != 0
    with pytest.raises(ckptfmt.errors.ConvertError):
        load(str(tmp_path / "t.zst"))


def test_a_plain_zstd_of_a_bin_comes_in_as_an_unverified_source(tmp_path, src):
    assert tool("zstd", "-q", src, "-o", tmp_path / "plain.zst").returncode == 0
    (tmp_path / "back").mkdir()
    rep = convert(str(tmp_path / "plain.zst"), str(tmp_path / "back" / "step_000042.bin"))
    assert rep.verified == "unverified-source" and rep.round_trip == "bytes"
    assert (tmp_path / "back" / "step_000042.bin").read_bytes() == src.read_bytes()


def test_the_byte_plane_form_has_its_own_name_and_old_zst_files_still_read(tmp_path, src):
    rep = convert(str(src), str(tmp_path / "x.ckz"))
    assert rep.dst_format == "planes" and rep.verified == "round-trip"
    assert (tmp_path / "x.ckz").read_bytes()[:8] == planes_form.MAGIC
    assert tool("zstd", "-d", "-q", "-c", tmp_path / "x.ckz").returncode != 0    # not a zstd file, and not named one
    golden = GOLDEN / "zst" / "step_000007.zst"                                    # written by the release before
    assert golden.read_bytes()[:8] == planes_form.MAGIC
    out = tmp_path / "g" / "step_000007.bin"
    out.parent.mkdir()
    rep = convert(str(golden), str(out))
    assert rep.round_trip == "bytes" and out.read_bytes() == (GOLDEN / "bin" / "step_000007.bin").read_bytes()


def test_to_planes_flag_and_to_zst_flag_pick_the_form(runner, tmp_path, src):
    assert runner.invoke(main, ["convert", str(src), str(tmp_path / "a.ckz"), "--to", "planes"]).exit_code == 0
    assert runner.invoke(main, ["convert", str(src), str(tmp_path / "b.zst"), "--to", "zst"]).exit_code == 0
    assert (tmp_path / "b.zst").read_bytes()[:4] == bytes.fromhex("5c2a4d18")


def _run_with_generations(tmp_path) -> Path:
    run = tmp_path / "run"
    r = ckptfmt.run.Run(run, create=True)
    for step in (5, 10):
        r.commit(step, *arrays(200, step), manifest={"layout": [{"name": "w", "shape": [200], "offset": 0}]},
                 extra_tensors={"bn.running_mean": np.arange(4, dtype="<f4")})
    return run


def test_b3sum_check_passes_on_an_export_and_fails_after_a_flipped_byte(tmp_path):
    run = _run_with_generations(tmp_path)
    dest = tmp_path / "dest"
    export(str(run), str(dest), steps=[5, 10])
    sums = (dest / "B3SUMS").read_text().splitlines()
    assert "step_000010.extra.safetensors" in "\n".join(sums) and all(len(s.split("  ")[0]) == 64 for s in sums)
    proc = tool("b3sum", "--check", "B3SUMS", cwd=dest)
    assert proc.returncode == 0 and proc.stdout.count(": OK") == len(sums), proc.stdout + proc.stderr
    data = bytearray((dest / "step_000010.bin").read_bytes())
    data[30] ^= 1
    (dest / "step_000010.bin").write_bytes(bytes(data))
    proc = tool("b3sum", "--check", "B3SUMS", cwd=dest)
    assert proc.returncode != 0 and "step_000010.bin: FAILED" in proc.stdout


def test_an_imported_archive_carries_its_b3sums(tmp_path):
    run = _run_with_generations(tmp_path)
    archive(str(run), str(tmp_path / "run.tar.zst"))
    import_archive(str(tmp_path / "run.tar.zst"), str(tmp_path / "back"))
    proc = tool("b3sum", "--check", "B3SUMS", cwd=tmp_path / "back")
    assert proc.returncode == 0 and "step_000010.bin: OK" in proc.stdout, proc.stdout + proc.stderr


def test_validate_writes_b3sums_for_a_run(runner, tmp_path):
    run = _run_with_generations(tmp_path)
    result = runner.invoke(main, ["validate", str(run), "--b3sums", str(tmp_path / "SUMS"), "--json"])
    assert result.exit_code == 0, result.output
    assert json.loads(result.stdout)["b3sums"]["lines"] == 6              # 2 x (.bin, companion, manifest)
    proc = tool("b3sum", "--check", "SUMS", cwd=tmp_path)
    assert proc.returncode == 0 and "run/step_000005.json: OK" in proc.stdout, proc.stdout + proc.stderr
    again = runner.invoke(main, ["validate", str(run), "--b3sums", str(tmp_path / "SUMS")])
    assert again.exit_code == 2 and "exists already" in again.stderr


def test_validate_writes_no_b3sums_for_a_damaged_run(runner, tmp_path):
    run = _run_with_generations(tmp_path)
    data = bytearray((run / "step_000010.bin").read_bytes())
    data[30] ^= 1
    (run / "step_000010.bin").write_bytes(bytes(data))
    result = runner.invoke(main, ["validate", str(run), "--b3sums", str(tmp_path / "SUMS")])
    assert result.exit_code == 1 and not (tmp_path / "SUMS").exists()
    fast = runner.invoke(main, ["validate", str(run), "--fast", "--b3sums", str(tmp_path / "SUMS")])
    assert fast.exit_code == 2 and not (tmp_path / "SUMS").exists()


def test_a_bare_run_gets_b3sums_of_what_is_there(runner, tmp_path):
    run = tmp_path / "bare"
    run.mkdir()
    seed_write(run / "step_000003.bin", 3, *arrays(10))
    assert runner.invoke(main, ["validate", str(run), "--b3sums", str(run / "B3SUMS")]).exit_code == 0
    assert tool("b3sum", "--check", "B3SUMS", cwd=run).stdout.strip() == "step_000003.bin: OK"
