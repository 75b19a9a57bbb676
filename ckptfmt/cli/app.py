"""The ``ckptfmt`` click group; command modules register themselves on it."""
from __future__ import annotations

import click

from .output import EXIT_CANNOT, Fail, interrupted, one_line_warnings, quiet_after_closed_stdout, stdout_is_pipe


class Group(click.Group):
    """The command group; a usage error (a missing option, a bad value) is reported like every
    other failure: one line on stderr, exit 2, and with ``--json`` the error document."""

    def invoke(self, ctx: click.Context) -> object:
        wants_json = "--json" in [*getattr(ctx, "_protected_args", []), *ctx.args]
        try:
            with one_line_warnings():
                return super().invoke(ctx)
        except click.UsageError as exc:
            # "ckptfmt: gc: Missing option ..." (Fail.show puts the program's name in front)
            where = _subcommand(exc.ctx)
            raise Fail(f"{where + ': ' if where else ''}{exc.format_message()} (see --help)", EXIT_CANNOT,
                       as_json=wants_json) from None
        except KeyboardInterrupt:      # before a command's own guard (its options being parsed)
            raise interrupted(wants_json) from None
        except BrokenPipeError as exc:
            if exc.filename is not None or not stdout_is_pipe():
                raise Fail(str(exc), EXIT_CANNOT, kind=type(exc).__name__, as_json=wants_json) from None
            quiet_after_closed_stdout()


def _subcommand(ctx: "click.Context | None") -> str:
    """The command's path below the program ("gc"), whatever the program was called as."""
    names = []
    while ctx is not None and ctx.parent is not None:
        names.append(ctx.info_name or "")
        ctx = ctx.parent
    return " ".join(reversed(names))


@click.group(cls=Group, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(package_name="ckptfmt")
def main() -> None:
    """ckptfmt: durable, fingerprinted step_NNNNNN.bin checkpoints.

    Exit codes: 0 ok/valid/identical, 1 a defect or difference was found,
    2 the check could not run (unreadable input, usage error).
    """
