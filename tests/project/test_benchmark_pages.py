"""The benchmark pages are their results: docs/benchmarks/ is what ``python -m benchmarks render``
makes of benchmarks/results/*.jsonl (a page edited by hand, or left stale by new results, fails
here), every results line is a record of the schema, and the results converted from the files
written before the schema give those files back exactly."""
from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks"))
from harness import convert, record, render  # noqa: E402  (benchmarks/ is no package)
from harness.record import FIELDS  # noqa: E402

RESULTS = sorted((ROOT / "benchmarks" / "results").glob("*.jsonl"))


def test_every_results_line_is_a_record_of_the_schema():
    assert len(RESULTS) >= 20
    for path in RESULTS:
        lines = path.read_text().splitlines()
        assert lines, f"{path.name}: empty"
        for n, line in enumerate(lines, 1):
            rec = json.loads(line)
            assert list(rec) == list(FIELDS), f"{path.name}:{n}: fields {list(rec)}"
            assert record.problems(rec) == [], f"{path.name}:{n}: {record.problems(rec)}"


def test_the_committed_pages_are_the_rendering_of_the_committed_results():
    problems = render.differences()
    assert not problems, "\n".join(problems) + "\n(python -m benchmarks render, then commit the pages)"


def test_every_picture_a_page_shows_is_there():
    shown = set()
    for page in (ROOT / "docs" / "benchmarks").glob("*.md"):
        shown |= set(re.findall(r"!\[[^]]*\]\((img/[^)]+\.png)\)", page.read_text()))
    assert shown, "no page shows a picture"
    missing = [p for p in sorted(shown) if not (ROOT / "docs" / "benchmarks" / p).is_file()]
    assert not missing, f"pictures missing (python -m benchmarks render): {missing}"


def test_a_page_edited_by_hand_or_left_stale_is_found(tmp_path):
    pages = tmp_path / "pages"
    shutil.copytree(ROOT / "docs" / "benchmarks", pages)
    assert render.differences(pages) == []
    save = pages / "save.md"
    save.write_text(save.read_text().replace("| ckptfmt | 1.11 |", "| ckptfmt | 1.21 |", 1))
    (pages / "notes.md").write_text("by hand\n")
    problems = render.differences(pages)
    assert any("save.md: differs" in p for p in problems), problems
    assert any("notes.md: not rendered" in p for p in problems), problems


def test_new_results_change_the_rendering(tmp_path):
    """A figure changed in a results file shows in the page drawn from it."""
    results = tmp_path / "results"
    shutil.copytree(ROOT / "benchmarks" / "results", results, ignore=shutil.ignore_patterns("raw"))
    recs = [json.loads(line) for line in (results / "mirror.jsonl").read_text().splitlines()]
    recs[0]["summary"]["mirror_over_upload_file"] = 9.99
    record.dump(recs, results / "mirror.jsonl")
    pages = render.pages(render.Results.of(results))
    assert "| mirror / upload_file (time) | 9.99x |" in pages["object-storage.md"]
    assert render.differences(results=render.Results.of(results)) == [
        f"{ROOT / 'docs' / 'benchmarks' / 'object-storage.md'}: differs from its rendering"]


def test_a_results_line_without_a_field_is_refused_naming_file_and_line(tmp_path):
    path = tmp_path / "bad.jsonl"
    good = json.loads((ROOT / "benchmarks" / "results" / "roots_scan.jsonl").read_text().splitlines()[0])
    path.write_text(json.dumps(good) + "\n" + json.dumps({k: v for k, v in good.items() if k != "commit"}) + "\n")
    with pytest.raises(ValueError, match=r"bad.jsonl:2: not a results record: no 'commit'"):
        record.read(path)


def test_the_old_results_convert_into_the_committed_ones_losslessly(tmp_path):
    """The converter checks that each file's records give its document back; run on the raw
    files it writes what is committed (until a benchmark is run again and replaces its file)."""
    written = convert.convert(out=tmp_path)
    assert len(written) == len(convert.FILES) + len(convert.TRANSCRIBED)
    for path in written:
        committed = ROOT / "benchmarks" / "results" / path.name
        if committed.exists() and json.loads(committed.read_text().splitlines()[0])["date"] == \
                json.loads(path.read_text().splitlines()[0])["date"]:
            assert path.read_text() == committed.read_text(), path.name


def test_python_m_benchmarks_lists_every_benchmark_and_refuses_an_unknown_one():
    run = subprocess.run([sys.executable, "-m", "benchmarks", "--list"], cwd=ROOT, capture_output=True, text=True,
                         timeout=60)
    assert run.returncode == 0, run.stderr
    from harness.catalog import BENCHMARKS
    for b in BENCHMARKS:
        assert f"  {b.name} " in run.stdout and f"benchmarks/{b.script}" in run.stdout
        assert (ROOT / "benchmarks" / b.script).is_file(), b.script
    bad = subprocess.run([sys.executable, "-m", "benchmarks", "no-such"], cwd=ROOT, capture_output=True, text=True,
                         timeout=60)
    assert bad.returncode == 2 and "no benchmark or command 'no-such'" in bad.stderr and "Traceback" not in bad.stderr
