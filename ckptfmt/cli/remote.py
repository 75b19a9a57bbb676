"""Object storage: ``mirror RUN URL`` (upload, verified there) and ``mirror URL DEST`` (restore).

Library imports stay inside the commands (``ckptfmt --help`` stays fast; fsspec is optional).
"""
from __future__ import annotations

import json
import logging
import sys
from typing import Any

import click

from .app import main
from .output import EXIT_DEFECT, emit, guarded, json_option, print_memory, size
from .policy import policy_of, policy_options

# aiohttp (under s3fs) lets a failed request's writer task die unobserved, and asyncio logs each
# such task with a traceback at garbage collection; the CLI's failure is its one line on stderr.
logging.getLogger("asyncio").setLevel(logging.CRITICAL)


@main.command("mirror")
@click.argument("source")
@click.argument("dest")
@policy_options
@click.option("--step", type=int, help="Restore (URL DEST) this generation instead of the newest valid one.")
@click.option("--quick", is_flag=True, help="Trust generations already at the URL when manifest and sizes match "
                                            "(no read-back of their bytes).")
@click.option("--watch", is_flag=True, help="Keep mirroring as new generations commit, until SIGTERM/SIGINT "
                                            "(exit 0); network failures are reported and retried; a RUN "
                                            "that does not exist yet is waited for.")
@click.option("--interval", type=click.FloatRange(min=0.1), default=10.0, show_default=True,
              help="With --watch: seconds between passes.")
@json_option
@guarded
def mirror_cmd(source: str, dest: str, step: int | None, quick: bool, watch: bool, interval: float,
               as_json: bool, **keep: Any) -> None:
    """Mirror RUN's committed generations, history and sidecars to URL (s3://bucket/prefix, any
    fsspec URL), each read back and compared by blake3 before its manifest is written there, with
    the retention of the --keep-* flags applied at the URL as gc applies it locally (none: the URL
    keeps every generation; a metric not yet recorded is no error here); or,
    given URL DEST, restore the newest valid generation (or --step) and the sidecars into the new
    run directory DEST. Needs the extra: pip install 'ckptfmt[remote]'. Credentials and endpoint
    from the AWS environment and config files (AWS_ENDPOINT_URL, AWS_ACCESS_KEY_ID, ...)."""
    from ..store.objects import is_url  # lazy: keeps `ckptfmt --help` fast
    if is_url(source) == is_url(dest):
        raise click.UsageError("give one local run directory and one URL: mirror RUN URL, or mirror URL DEST")
    if not is_url(dest) and (quick or watch or any(v is not None for v in keep.values())):
        raise click.UsageError("--keep-*, --metric, --mode, --quick and --watch apply to mirror RUN URL")
    retention = policy_of(**keep)
    if is_url(dest):
        if step is not None:
            raise click.UsageError("--step applies to a restore (mirror URL DEST)")
        if watch:
            return _watch(source, dest, interval, as_json, retention=retention, recheck=not quick)
        from ..run.mirror import mirror  # lazy: as above
        doc = mirror(source, dest, retention=retention, recheck=not quick)
        emit(doc, as_json, _print_mirror)
        if doc["refused"]:     # a local generation failed its hash and was not sent: a defect
            sys.exit(EXIT_DEFECT)
        return
    restore_to(source, dest, step, as_json)


class _Stopped(BaseException):
    """Raised by the SIGTERM/SIGINT handler of ``--watch``: an upload in flight is aborted
    (never committed there) and the watch ends with exit 0."""


def _watch(run: str, url: str, interval: float, as_json: bool, **options) -> None:
    """``mirror --watch``: one line (or JSON line) per pass that did something, until a signal."""
    import signal
    from ..run.mirror import watch  # lazy: keeps `ckptfmt --help` fast

    def stop(signum, frame):
        raise _Stopped()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, stop)

    def report(doc: dict) -> None:
        if as_json:
            click.echo(json.dumps(doc, allow_nan=False))
        elif "error" in doc:
            click.echo(f"ckptfmt: warning: {doc['error']}; retrying in {interval:g} s", err=True)
        elif "waiting" in doc:
            click.echo(f"ckptfmt: {doc['waiting']}", err=True)
        elif doc["uploaded"] or doc["replaced"] or doc["deleted"] or doc["refused"]:
            _print_mirror(doc)
    try:
        watch(run, url, interval=interval, report=report, **options)
    except _Stopped:
        click.echo(json.dumps({"stopped": "signal"}) if as_json else f"mirror of {run} to {url}: stopped by signal")


def restore_to(url: str, dest: str, step: int | None, as_json: bool) -> None:
    """Restore and print (shared with ``import URL DEST``)."""
    from ..tools.restore import restore  # lazy: keeps `ckptfmt --help` fast
    emit(restore(url, dest, step=step), as_json, lambda d: click.echo(
        f"restored step {d['step']} and {len(d['sidecars'])} sidecars from {d['url']} into {d['dest']}: verified"
        + (f" (skipped damaged steps {[s['step'] for s in d['skipped']]})" if d["skipped"] else "")))


def _print_mirror(d: dict) -> None:
    up = [u["step"] for u in d["uploaded"]]
    click.echo(f"mirrored {d['run']} to {d['url']}: uploaded {up or 'nothing new'}"
               + (f", replaced damaged {d['replaced']}" if d["replaced"] else "")
               + (f", refused damaged local {d['refused']}" if d["refused"] else "")
               + (f", deleted {d['deleted']}" if d["deleted"] else "")
               + f"; at the URL: {d['at_destination']}")


# ------------------------------------------------- validate / ls / inspect of a URL (RUN §10.9)
def validate_urls(paths: tuple[str, ...], fast: bool, as_json: bool) -> None:
    """``validate URL``: every committed object read back and hashed (``--fast``: headers and
    sizes); exit 1 when anything committed there is damaged."""
    from ..store.objects import is_url
    from ..tools.remote_check import validate_url  # lazy: keeps `ckptfmt --help` fast
    if len(paths) != 1 or not is_url(paths[0]):
        raise click.UsageError("validate takes one URL at a time (local paths in another call)")
    doc = validate_url(paths[0], deep=not fast)
    emit(doc, as_json, _print_validate)
    if not doc["ok"]:
        sys.exit(EXIT_DEFECT)


def _print_validate(d: dict) -> None:
    click.echo(f"{d['url']}: {'OK' if d['ok'] else 'NO CHECKPOINT' if d.get('problem') else 'DAMAGED'}")
    if d.get("problem"):
        click.echo(f"  defect: {d['problem']}")
    for g in d["generations"]:
        click.echo(f"  {g['step']:>10}  {g['status']}" + ("" if g["ok"] else "  (defect)"))
    for s in d["sidecars"]:
        click.echo(f"  {s['file']}: {s['status']}")


def ls_url_out(url: str, as_json: bool) -> None:
    """``ls URL``: the generations at the URL from one listing; NO CHECKPOINT (exit 1) where
    there is none, as of a local directory."""
    from ..tools.remote_check import ls_url  # lazy: keeps `ckptfmt --help` fast
    data = ls_url(url)
    emit(data, as_json, print_ls_url)
    if data.get("problem"):
        sys.exit(EXIT_DEFECT)


def print_ls_url(d: dict) -> None:
    click.echo(d["url"])
    if d["generations"]:
        click.echo(f"  {'step':>10}  {'size':>10}  status")
    for g in d["generations"]:
        click.echo(f"  {g['step']:>10}  {size(g['size']):>10}  {g['status']}")
    if d.get("training") or d.get("problem"):
        click.echo(f"  {d.get('training') or 'NO CHECKPOINT: ' + d['problem']}")
    print_memory((d.get("tiers") or {}).get("memory"))


def inspect_url_out(url: str, as_json: bool) -> None:
    """``inspect URL/step_N.bin``: header and manifest only (ranged reads)."""
    from ..tools.remote_check import inspect_url  # lazy: keeps `ckptfmt --help` fast
    emit(inspect_url(url), as_json, lambda d: click.echo(
        f"{d['path']}\n  step {d['step']}  n_params {d['n_params']:,}  size {d['size']:,} bytes\n"
        f"  blake3 {d['blake3']} ({d['fingerprint']})"
        + (f"\n  header problem: {d['header_problem']}" if d["header_problem"] else "")
        + (f"\n  manifest: {d['manifest']['layout_tensors']} tensors in layout" if d.get("manifest") else "")))
