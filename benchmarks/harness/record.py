"""The results schema, and the one writer every benchmark's new results go through.

A results file is JSON lines, one object per measurement set::

    {"benchmark": "facts", "parameters": {"size": "12.8M", "bytes": 153782792, "measurement": "save"},
     "machine": {...}, "commit": "c4d7db6..." or null, "date": "2026-11-30T15:29:24" or null,
     "command": "benchmarks/facts_bench.py --reps 7" or null,
     "samples": [0.17, ...] or null, "summary": {"median": ..., "min": ..., "gbps": ...} or null}

``parameters`` say what was measured under which conditions (their order is the document's
nesting); ``samples`` hold one entry per repetition where the benchmark kept them (a number, or
an object when a repetition records several figures); ``summary`` holds what the benchmark
computed from them (median, min, max, throughput, ratios within the run). A field the run did
not record is null, never guessed.
"""
from __future__ import annotations

import datetime
import json
import os
import platform
import shlex
import subprocess
import sys
from pathlib import Path
from typing import Any, Iterable

from .shapes import SPECS, STAMPS

FIELDS = ("benchmark", "parameters", "machine", "commit", "date", "command", "samples", "summary")
ROOT = Path(__file__).resolve().parents[2]
RESULTS = ROOT / "benchmarks" / "results"
ENTRY = "BENCHMARKS_COMMAND"          # set by ``python -m benchmarks NAME``: the command as typed


def to_records(benchmark: str, doc: dict, fallback: dict[str, Any],
               override: dict[str, Any] | None = None) -> list[dict[str, Any]]:
    """The schema's records of one benchmark document; a stamp the document lacks comes from
    ``fallback`` (this run's, for new results; what benchmarks/README.md said, for old ones),
    one in ``override`` replaces the document's."""
    spec = SPECS[benchmark]
    stamps, rest = spec.stamps(doc)
    machine = {**(fallback.get("machine") or {}), **(stamps["machine"] or {})} or None
    base = {k: stamps[k] if stamps[k] is not None else fallback.get(k) for k in STAMPS}
    base.update(override or {})
    out = []
    for part in spec.shape.flatten(rest):
        st = {**base, "machine": machine, **(spec.per_record(part, doc) if spec.per_record else {})}
        out.append({"benchmark": benchmark, "parameters": part["parameters"], **{k: st[k] for k in STAMPS},
                    "samples": part["samples"], "summary": part["summary"]})
    return out


def to_document(records: list[dict[str, Any]]) -> dict:
    """One benchmark's records back into its script's document (stamps left out)."""
    names = {r["benchmark"] for r in records}
    if len(names) != 1:
        raise ValueError(f"records of {len(names)} benchmarks ({sorted(names)}) make no one document")
    return SPECS[names.pop()].shape.unflatten(records)


def problems(record: Any) -> list[str]:
    """What makes one line not a record of the schema (empty: it is one)."""
    if not isinstance(record, dict):
        return ["not a JSON object"]
    out = [f"no {f!r}" for f in FIELDS if f not in record]
    out += [f"unknown field {f!r}" for f in record if f not in FIELDS]
    kinds = {"benchmark": (str,), "parameters": (dict,), "machine": (dict, type(None)), "commit": (str, type(None)),
             "date": (str, type(None)), "command": (str, type(None)), "samples": (list, type(None)),
             "summary": (dict, type(None))}
    out += [f"{f!r} is {type(record[f]).__name__}" for f, k in kinds.items() if f in record and not isinstance(record[f], k)]
    if not out and record["benchmark"] not in SPECS:
        out.append(f"unknown benchmark {record['benchmark']!r} (benchmarks/harness/shapes.py names them)")
    return out


def read(path: str | Path) -> list[dict[str, Any]]:
    """The records of a results file; ValueError naming the file and line of one that is not."""
    out = []
    with open(path) as f:
        for n, line in enumerate(f, 1):
            try:
                record = json.loads(line)
            except json.JSONDecodeError as exc:
                raise ValueError(f"{path}:{n}: not JSON ({exc.msg})") from None
            bad = problems(record)
            if bad:
                raise ValueError(f"{path}:{n}: not a results record: {'; '.join(bad)}")
            out.append(record)
    return out


def dump(records: Iterable[dict[str, Any]], path: str | Path) -> Path:
    """Write records as JSON lines, atomically (a cut run leaves the previous file or this one)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in records))
    os.replace(tmp, path)
    return path


# ---------------------------------------------------------------- new results
def machine() -> dict[str, Any]:
    """What this process can say about the machine without importing anything new."""
    out: dict[str, Any] = {"cpus": os.cpu_count(), "python": platform.python_version(), "platform": platform.platform()}
    try:
        with open("/proc/meminfo") as f:
            out["mem_total_gib"] = round(int(f.readline().split()[1]) / 2**20, 1)
    except (OSError, ValueError, IndexError):
        pass
    for name in ("torch", "numpy"):
        if name in sys.modules:
            out[name] = getattr(sys.modules[name], "__version__", None)
    torch = sys.modules.get("torch")
    if torch is not None and torch.cuda.is_available() and torch.cuda.is_initialized():
        out["gpu"] = torch.cuda.get_device_name(0)
    out["load_avg_1min"] = round(os.getloadavg()[0], 2)
    return out


def commit() -> str | None:
    """HEAD of the checkout, "+ changes" when the code (ckptfmt/, the benchmarks' Python) differs
    from it; None where there is no git (the GPU machine gets the files without their history)."""
    try:
        git = ["git", "-C", str(ROOT)]
        head = subprocess.run(git + ["rev-parse", "HEAD"], capture_output=True, text=True, timeout=30)
        if head.returncode:
            return None
        dirty = subprocess.run(git + ["status", "--porcelain", "--", "ckptfmt", ":(glob)benchmarks/**/*.py"],
                               capture_output=True, text=True, timeout=30).stdout.strip()
        return head.stdout.strip() + (" + changes" if dirty else "")
    except (OSError, subprocess.SubprocessError):
        return None


def command() -> str:
    """The command line that started this run, as typed where ``python -m benchmarks`` started it."""
    if os.environ.get(ENTRY):
        return os.environ[ENTRY]
    script = Path(sys.argv[0]).resolve()
    shown = script.relative_to(ROOT) if script.is_relative_to(ROOT) else script
    return shlex.join(["python", str(shown), *sys.argv[1:]])


def started() -> str:
    """When this process started (the run, for a benchmark's script), ISO 8601 in UTC; now,
    where /proc does not say."""
    try:
        with open("/proc/stat") as f:
            boot = next(int(line.split()[1]) for line in f if line.startswith("btime "))
        with open("/proc/self/stat") as f:
            ticks = int(f.read().rsplit(")", 1)[1].split()[19])      # field 22, starttime
        when = datetime.datetime.fromtimestamp(boot + ticks / os.sysconf("SC_CLK_TCK"), datetime.timezone.utc)
    except (OSError, ValueError, IndexError, StopIteration):
        when = datetime.datetime.now(datetime.timezone.utc)
    return when.isoformat(timespec="seconds")


def results_path(out: str | Path) -> Path:
    """Where a benchmark's ``--out`` goes: results are JSON lines, so ``x.json`` becomes ``x.jsonl``."""
    out = Path(out)
    return out.with_suffix(".jsonl") if out.suffix == ".json" else out


def write_results(benchmark: str, doc: dict, out: str | Path) -> Path:
    """Write one run's document as the schema's records to ``out`` (``.json`` -> ``.jsonl``),
    stamped with this run's machine, commit, date and command where the document has none (the
    command as typed to ``python -m benchmarks`` in any case)."""
    now = {"machine": machine(), "commit": commit(), "command": command(), "date": started()}
    typed = {"command": os.environ[ENTRY]} if os.environ.get(ENTRY) else {}
    records = json.loads(json.dumps(to_records(benchmark, doc, now, typed)))
    path = dump(records, results_path(out))
    print(f"results: {path}", file=sys.stderr, flush=True)
    if to_document(records) != json.loads(json.dumps(SPECS[benchmark].stamps(doc)[1])):
        keep = path.with_suffix(".document.json")        # the shape lost something: keep it all
        keep.write_text(json.dumps(doc, indent=1) + "\n")
        print(f"results: {benchmark}'s shape does not give its document back (benchmarks/harness/shapes.py); "
              f"the whole document is in {keep}", file=sys.stderr, flush=True)
    return path
