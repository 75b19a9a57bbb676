"""Moving runs elsewhere: export (to a directory or a verified .tar.zst) and import.

Library imports stay inside the commands: ``ckptfmt.tools.export`` costs milliseconds that
``ckptfmt --help`` would otherwise pay.
"""
from __future__ import annotations

import os

import click

from .app import main
from .output import emit, guarded, json_option
from .progress import bytes_in, terminal_bar


@main.command("export")
@click.argument("run", type=click.Path())
@click.argument("dest", type=click.Path())
@click.option("--latest", "latest", is_flag=True, help="Export the newest valid generation (the default).")
@click.option("--steps", "steps", help="Comma-separated steps to export instead of the latest.")
@click.option("--with-history/--without-history", default=True, show_default=True, help="Copy .loss.json (whole).")
@click.option("--weights-only", is_flag=True, help="Inference export: weights as safetensors.")
@click.option("--archive", is_flag=True, help="Write DEST as one verified .tar.zst.")
@json_option
@guarded
def export_cmd(run: str, dest: str, latest: bool, steps: str | None, with_history: bool,
               weights_only: bool, archive: bool, as_json: bool) -> None:
    """Export generations, history and sidecars to DEST, verified at DEST (and loaded there).
    Safe while the run trains: the chosen generations are leased, so retention keeps them. RUN
    may be a URL (a run written straight to object storage: each part streamed here, verified);
    DEST is local."""
    from ..tools.archive import archive as run_archive  # lazy: `--help` fast
    from ..tools.export import checks_in_words, export as run_export  # lazy: as above
    chosen = _parse_steps(steps)
    if latest and chosen:
        raise click.UsageError("--latest and --steps exclude each other")
    fn = run_archive if archive else run_export
    with terminal_bar(f"exporting {run}", bytes_in(run) if os.path.isdir(run) else 0, quiet=as_json) as bar:
        doc = fn(run, dest, steps=chosen, with_history=with_history, weights_only=weights_only,
                 check=_model_check(), progress=bar)
    emit(doc, as_json, lambda d: click.echo(
        f"exported steps {d['steps']} to {dest}: {len(d['files'])} files, verified at the destination: "
        + checks_in_words(d["verified"]) + (" (UNVERIFIED bare files)" if d["bare"] else "")))


def _model_check():
    """The reference trainer's load check (a fresh model + AdamW at DEST) when torch is
    installed; without torch the export is still validated fully and says so."""
    try:
        from ..trainer.export_check import export_check  # lazy: imports torch
    except ImportError:
        return lambda path: "skipped: torch not installed (validated fully instead)"
    return export_check


def _parse_steps(steps: str | None) -> list[int] | None:
    """``--steps 100,200`` as a list of ints (None when not given; ",," names no step and is
    refused rather than read as "the latest")."""
    if steps is None:
        return None
    try:
        chosen = [int(s) for s in steps.split(",") if s.strip()]
    except ValueError:
        chosen = []
    if not chosen:
        raise click.UsageError(f"--steps takes comma-separated integers, got {steps!r}")
    return chosen


@main.command("import")
@click.argument("archive", type=click.Path())
@click.argument("dest", type=click.Path())
@click.option("--step", type=int, help="From a URL: restore this generation instead of the newest valid one.")
@json_option
@guarded
def import_cmd(archive: str, dest: str, step: int | None, as_json: bool) -> None:
    """Unpack an exported .tar.zst into DEST and verify every file; or restore a mirrored run
    from a URL (s3://...) into DEST, as `ckptfmt mirror URL DEST` does."""
    from ..store.objects import is_url  # lazy: keeps `ckptfmt --help` fast
    if is_url(archive):
        from .remote import restore_to  # lazy: as above
        return restore_to(archive, dest, step, as_json)
    if step is not None:
        raise click.UsageError("--step applies to an import from a URL")
    from ..tools.archive import import_archive  # lazy: keeps `ckptfmt --help` fast
    doc = import_archive(archive, dest)
    emit(doc, as_json, lambda d: click.echo(f"imported {d['files']} files into {d['dest']}: verified"))
