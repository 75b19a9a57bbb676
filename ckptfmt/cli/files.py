"""Commands on checkpoint files: inspect, validate, diff, convert.

Library imports stay inside the commands: each tool module costs milliseconds that
``ckptfmt --help`` would otherwise pay.
"""
from __future__ import annotations

import json

import os
import sys

import click

from .app import main
from .output import EXIT_CANNOT, EXIT_DEFECT, TOLERANCE, Fail, emit, fmt, guarded, json_option, metrics_words, size
from .progress import bytes_in, terminal_bar
from .runs import print_ls


# ---------------------------------------------------------------- inspect
@main.command()
@click.argument("path", type=click.Path())
@json_option
@click.option("--tensors", is_flag=True, help="Statistics per parameter (needs a layout).")
@guarded
def inspect(path: str, as_json: bool, tensors: bool) -> None:
    """Show what a file or run holds, whatever its kind (known by its content, spec/FORMAT.md
    §8.6): a seed .bin's step, size, fingerprint status and per-region statistics; ckptfmt's
    .zst, .ckz, .safetensors, .pt, .npz, sharded generations and DCP directories; foreign torch.save files (.pt, .ckpt,
    pytorch_model.bin), safetensors (and their index.json), .npz and DCP directories: kind, step,
    tensors, parameters, dtypes. A URL: a run written straight to object storage (its
    generations, and its newest valid generation read and verified), or URL/step_N.bin (its
    header and manifest, read by ranged reads)."""
    from ..tools.inspect import inspect_path  # lazy: keeps `ckptfmt --help` fast
    from ..store.objects import is_url  # lazy: as above
    if is_url(path):
        return _inspect_url(path, as_json, tensors)
    data = inspect_path(path, tensors=tensors)
    if "latest" in data:                     # a run directory
        emit(data, as_json, _print_run_inspect)
        if data["latest"] is None and "latest_problem" in data or any("problem" in f for f in data.get("files", [])):
            sys.exit(EXIT_DEFECT)
        return
    emit(data, as_json, print_inspect)


def _inspect_url(url: str, as_json: bool, tensors: bool) -> None:
    """``inspect URL/step_N.bin``: header and manifest only (ranged reads); ``inspect URL`` of a
    run written there: its listing and its newest valid generation, read and verified (exit 1:
    none)."""
    from .. import format as ckfmt  # lazy: keeps `ckptfmt --help` fast
    from .remote import inspect_url_out, print_ls_url  # lazy: as above
    if ckfmt.parse_name(url.rstrip("/").rpartition("/")[2]) is not None:
        return inspect_url_out(url, as_json)
    from ..tools.inspect import inspect_run_url  # lazy: as above
    data = inspect_run_url(url, tensors=tensors)

    def shown(d: dict) -> None:
        print_ls_url(d)
        if d.get("latest_problem"):
            click.echo(d["latest_problem"])
        if d.get("latest"):
            click.echo("latest valid generation:")
            print_inspect(d["latest"])
    emit(data, as_json, shown)
    if data["latest"] is None:
        sys.exit(EXIT_DEFECT)


def print_inspect(d: dict) -> None:
    if d.get("kind", "bin") != "bin":
        return _print_other(d)
    click.echo(f"{d['path']}\n  step {d['step']}  n_params {d['n_params']:,}  size {d['size']:,} bytes")
    click.echo(f"  fingerprint {d['fingerprint']}  blake3 {d['blake3']}")
    if d.get("manifest_problem"):
        click.echo(f"  manifest problem (the fingerprint cannot be checked): {d['manifest_problem']}")
    if d.get("manifest"):
        man = d["manifest"]
        click.echo(f"  manifest: {man.get('layout_tensors', 0)} tensors in layout; seal: {man.get('seal')}")
        if isinstance(man.get("config"), dict):
            click.echo("  config: " + _words(man["config"]))
        if man.get("metrics"):
            click.echo("  metrics: " + " ".join(metrics_words(man["metrics"], d["step"])))
    _print_stats_table(d["regions"])
    for name, regions in (d.get("tensors") or {}).items():
        click.echo(f"  {name}")
        _print_stats_table(regions, indent="    ")


def _words(config: dict, width: int = 200) -> str:
    """A config as ``key=value`` words on one line, cut at ``width`` characters."""
    text = " ".join(f"{k}={json.dumps(v, allow_nan=True)}" for k, v in sorted(config.items())) or "{}"
    return text if len(text) <= width else text[:width - 1] + "…"


def _print_other(d: dict) -> None:
    """A file of another kind than the seed .bin: kind, origin, what it holds, its regions."""
    click.echo(f"{d['path']}\n  kind {d['kind']} ({d['label']}, "
               + ("written by ckptfmt" if d.get("origin") == "ckptfmt" else "foreign") + ")")
    click.echo(f"  step {d['step']}  n_params {d['n_params']:,}  size {d['size']:,} bytes")
    held = [f"{d[k]} {k.removeprefix('n_')}" for k in ("n_tensors", "parameters", "buffers", "shards")
            if d.get(k) is not None]
    if d.get("dtypes"):
        held.append("dtypes " + ", ".join(d["dtypes"]))
    if "optimizer" in d:
        held.append(f"optimizer {d['optimizer'] or 'none (m, v zero)'}"
                    + (f", moments {d['moments']}" if d.get("moments") else ""))
    if held:
        click.echo("  " + "; ".join(held))
    click.echo(f"  recorded blake3 {d['recorded_blake3']}" if d.get("recorded_blake3") else
               f"  {d.get('no_digest', 'no digest of its own')} (unverified)")
    _print_stats_table(d["regions"])
    for name, regions in (d.get("tensors") or {}).items():
        click.echo(f"  {name}")
        _print_stats_table(regions, indent="    ")


def _print_stats_table(regions: dict, indent: str = "  ") -> None:
    cols = ("min", "max", "mean", "std", "max_abs", "nan", "inf", "zeros")
    click.echo(indent + f"{'region':8}" + "".join(f"{c:>13}" for c in cols))
    for name, s in regions.items():
        click.echo(indent + f"{name:8}" + "".join(f"{fmt(s[c]):>13}" for c in cols))


def _print_run_inspect(d: dict) -> None:
    print_ls(d)
    if d.get("latest_problem"):
        click.echo(d["latest_problem"])
    if d.get("training"):
        click.echo(d["training"])
    for f in d.get("files", []):           # checkpoint files of other kinds, and no generation
        if "problem" in f:
            click.echo(f"{f['path']}\n  kind {f['kind']} ({f['label']})\n  defect: {f['problem']}")
        else:
            print_inspect(f)
    if d.get("latest"):
        click.echo("latest valid generation:")
        print_inspect(d["latest"])


# ---------------------------------------------------------------- validate
@main.command()
@click.argument("paths", nargs=-1, required=True, type=click.Path())
@json_option
@click.option("--fast", is_flag=True, help="Skip hashing and value scans (structure and manifest only).")
@click.option("--scan", is_flag=True, help="Scan every value even where the manifest records value facts "
              "(by default a committed generation whose blake3 matches is checked by its recorded facts).")
@click.option("--b3sums", "b3sums_out", type=click.Path(), metavar="FILE",
              help="When everything validates, write FILE for `b3sum --check`: every committed generation's "
                   "files, paths relative to FILE's directory (spec/FORMAT.md §6.3).")
@guarded
def validate(paths: tuple[str, ...], as_json: bool, fast: bool, scan: bool, b3sums_out: str | None) -> None:
    """Check files or run directories of any kind (known by content, spec/FORMAT.md §8.6): a
    seed .bin's structure, fingerprint, manifest (its seal: every field against its own digest,
    §4.7), values; a run's generations and sidecars;
    ckptfmt's .zst, .ckz, .safetensors, .pt, .npz and sharded generations against the blake3
    they record; a DCP directory ckptfmt wrote by its arrays against the blake3 of the .bin
    they make, which it records; a foreign file (torch.save, safetensors, index.json, .npz, DCP) by
    its structure and values ("unverified: no digest of its own") (a URL: every committed object read back and
    compared with its manifest's blake3).
    Exit 1 names each defect, a diverged generation's non-finite values by region and count."""
    from ..tools.validate import validate_path  # lazy: keeps `ckptfmt --help` fast
    from ..store.objects import is_url  # lazy: as above
    if any(is_url(p) for p in paths):
        from .remote import validate_urls  # lazy: as above
        return validate_urls(paths, fast, as_json)
    for p in paths:
        try:
            os.stat(p)          # a symlink loop says so, not "no such file"
        except FileNotFoundError:
            raise Fail(f"{p}: no such file or directory", EXIT_CANNOT, kind="FileNotFoundError", path=p) from None
    if b3sums_out and fast:
        raise click.UsageError("--b3sums needs the deep check: drop --fast")
    if scan and fast:
        raise click.UsageError("--scan is part of the deep check: drop --fast")
    if b3sums_out:
        from .. import fsio  # lazy: as above
        fsio.refuse_url(b3sums_out, "the B3SUMS file", "it is written as a local file")
    if b3sums_out and os.path.lexists(b3sums_out):
        raise Fail(f"{b3sums_out}: exists already; refusing to overwrite", EXIT_CANNOT)
    reports = []
    for p in paths:
        with terminal_bar(f"validating {p}", bytes_in(p) if not fast else 0, quiet=as_json) as bar:
            reports.append(validate_path(p, deep=not fast, progress=bar, scan=scan))
    for r in reports:
        if r.could_not_run:     # e.g. a manifest newer than this ckptfmt: no verdict to print
            raise Fail(next(f.message for f in r.findings if f.level == "unsupported"), EXIT_CANNOT,
                       kind="unsupported", path=r.path)
    sums = _write_b3sums(paths, b3sums_out) if b3sums_out and all(r.ok for r in reports) else None
    data = [r.to_dict() for r in reports] if len(reports) > 1 else reports[0].to_dict()
    if sums is not None:
        data = {"reports": data, "b3sums": sums} if len(reports) > 1 else {**data, "b3sums": sums}
    emit(data, as_json, lambda _: [_print_report(r) for r in reports])
    if sums is not None and not as_json:
        click.echo(f"wrote {sums['file']}: {sums['lines']} lines (b3sum --check {os.path.basename(sums['file'])} "
                   f"in {os.path.dirname(os.path.abspath(sums['file']))})")
    if not all(r.ok for r in reports):
        sys.exit(EXIT_DEFECT)


def _write_b3sums(paths: tuple[str, ...], out: str) -> dict:
    """The check file of what was just validated (digests hashed again as it is written)."""
    from ..tools.b3sums import write_for  # lazy: keeps `ckptfmt --help` fast
    return write_for(paths, out)


VERDICTS = {"damaged": "DAMAGED", "unsupported": "CANNOT CHECK", "no checkpoint": "NO CHECKPOINT",
            "diverged": "DIVERGED"}


def _print_report(r) -> None:
    """``PATH: OK (verified)``, ``PATH: DAMAGED``, ``PATH: NO CHECKPOINT``: the status is named
    once, and only where it adds to the verdict."""
    verdict = "OK" if r.ok else VERDICTS.get(r.status, "DAMAGED")
    click.echo(f"{r.path}: {verdict}" + (f" ({r.status})" if r.ok else ""))
    for f in r.findings:
        click.echo(f"  {f.level}: {f.message}")


# ---------------------------------------------------------------- diff
@main.command()
@click.argument("a", type=click.Path())
@click.argument("b", type=click.Path())
@json_option
@click.option("--atol", type=TOLERANCE, default=0.0, show_default=True, help="Absolute tolerance.")
@click.option("--rtol", type=TOLERANCE, default=0.0, show_default=True, help="Relative tolerance.")
@click.option("--tensors", is_flag=True, help="List every differing parameter (needs a layout).")
@guarded
def diff(a: str, b: str, as_json: bool, atol: float, rtol: float, tensors: bool) -> None:
    """Compare two checkpoints of any kinds that hold the same parameters (a .bin and its .zst,
    .safetensors or .pt, a foreign torch.save file and its conversion): header, weights, m, v
    (by parameter name) and, between two .bin, the companion file. Exit 0 only when
    bit-identical (or within --atol/--rtol). Generations of a run are read under a read lease.
    A or B may be a generation of a run on object storage, URL/step_NNNNNN.bin (read whole,
    every part verified against its manifest)."""
    from ..tools.diff import diff as run_diff, leased, per_tensor  # lazy: keeps `ckptfmt --help` fast
    total = os.path.getsize(a) + os.path.getsize(b) if os.path.isfile(a) and os.path.isfile(b) else 0
    with leased(a, b), terminal_bar("comparing", total, quiet=as_json) as bar:
        result = run_diff(a, b, atol=atol, rtol=rtol, progress=bar)
        data = result.to_dict()
        if tensors:
            data["tensors"] = per_tensor(a, b) if result.kinds == ["bin", "bin"] else result.per_tensor
    emit(data, as_json, _print_diff)
    if not (result.identical or (result.within_tolerance and (atol or rtol))):
        sys.exit(EXIT_DEFECT)


def _print_diff(d: dict) -> None:
    click.echo(f"{d['a']} vs {d['b']}: {d['verdict']}")
    steps, ns = d["header"]["step"], d["header"]["n_params"]
    click.echo(f"  step {steps[0]} vs {steps[1]}; n_params {ns[0]:,} vs {ns[1]:,}")
    if not d["comparable"]:
        click.echo(f"  {d.get('why_not') or 'n_params differ: regions are not comparable'}")
        return
    for name, r in d["regions"].items():
        if r["identical"]:
            click.echo(f"  {name:8} identical")
            continue
        where = f"index {r['first_index']}"
        if r["first_param"]:
            where += f" ({r['first_param']}[{r['first_param_index']}])"
        click.echo(f"  {name:8} {r['n_diff']:,} differ; max|d| {fmt(r['max_abs'])} max rel "
                   f"{fmt(r['max_rel'])} max ulp {r['max_ulp']} rel L2 {fmt(r['rel_l2'])} cos "
                   f"{fmt(r['cosine'])}; first at {where}")
    if d.get("companion_differs"):
        click.echo(f"  companion differs: {', '.join(d['companion_differs'])}")
    for name, regions in (d.get("tensors") or {}).items():
        click.echo(f"  {name}: " + ", ".join(f"{r} {n:,}" for r, n in regions.items()))


# ---------------------------------------------------------------- convert
@main.command()
@click.argument("src", type=click.Path())
@click.argument("dst", type=click.Path())
@click.option("--to", "to", type=click.Choice(["bin", "safetensors", "pt", "npz", "zst", "planes", "torch",
                                               "weights", "shards", "dcp"]),
              help="Target format (default: from DST's extension, which must agree with --to). zst: a "
                   "standard zstd stream of the .bin (zstd -d gives it back); planes: the byte-plane form "
                   "(.ckz, smaller, ckptfmt only); torch: a torch.save of {model, optimizer} state dicts "
                   "(.pt); weights: a plain safetensors state dict; shards: DST is a run directory that "
                   "receives a sharded generation; dcp: DST is a torch.distributed.checkpoint directory.")
@click.option("--shards", "n_shards", type=click.IntRange(min=1), default=None,
              help="With --to shards: how many shards (ranks)  [default: 2].")
@click.option("--weights-only", is_flag=True, help="Inference export (safetensors, pt, npz): weights only, per parameter.")
@click.option("--dtype", type=click.Choice(["float32", "float16", "bfloat16"]), help="With --weights-only.")
@click.option("--no-verify", is_flag=True, help="Skip the round-trip verification.")
@click.option("--groups", "groups_file", type=click.Path(), default=None, metavar="FILE",
              help="A foreign .pt whose optimizer has several param groups without usable param_names "
                   "(nanoGPT's, the HF Trainer's decay / no-decay groups): a JSON file listing each group's "
                   'parameter names in the optimizer\'s order, [["wte.weight", ...], ["ln_f.bias", ...]].')
@json_option
@guarded
def convert(src: str, dst: str, to: str | None, n_shards: int | None, weights_only: bool, dtype: str | None,
            no_verify: bool, groups_file: str | None, as_json: bool) -> None:
    """Convert between .bin, .safetensors, .pt, .npz, .zst, .ckz, sharded generations (a
    step_NNNNNN.json of one; consolidate with DST .bin, split with --to shards) and DCP
    directories. A torch.save of a model + Adam/AdamW/SGD optimizer (or a bare state dict) and a
    safetensors file of weights convert into a .bin (spec/FORMAT.md §10.7) and back (--to torch,
    --to weights); optimizer state goes with its parameter by name (§10.8): several param
    groups need param_names in the file or --groups FILE. SRC's kind is known by its content
    (pytorch_model.bin and a .ckpt are torch.save files); DST's from its name or --to. The source is checked against its own digest before anything is written
    (exit 1 on a mismatch) and the result by converting back; "verified" is printed only when
    both hold."""
    from ..tools.convert import convert as run_convert  # lazy: keeps `ckptfmt --help` fast
    total = os.path.getsize(src) * (2 if no_verify else 3) if os.path.isfile(src) else 0
    with terminal_bar(f"converting {src}", total, quiet=as_json) as bar:
        report = run_convert(src, dst, to=to, weights_only=weights_only, dtype=dtype, verify=not no_verify,
                             progress=bar, shards=n_shards, groups=groups_file)
    emit(report.to_dict(), as_json, _print_convert)


def _print_convert(r: dict) -> None:
    """One line: what was written, and what was proven (the word "verified" only when the
    source matched its digest and the result checked)."""
    head = (f"{r['src']} -> {r['dst']} ({r['dst_format']}, {size(r['dst_bytes'])}, "
            f"ratio {r['src_bytes'] / max(r['dst_bytes'], 1):.3f})")
    if r["verified"] in ("round-trip", "values"):
        click.echo(f"{head}; verified: {r['verified']} (source matched its own digest)")
    elif r["verified"] == "unverified-source":
        click.echo(f"{head}; round trip: {r['round_trip']} identical; source {r['source_check']}")
    else:
        click.echo(f"{head}; not verified (--no-verify); source check: {r['source_check']}")
