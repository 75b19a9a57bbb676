"""The ``ckptfmt`` click group; command modules register themselves on it."""
from __future__ import annotations

import click

from . import output  # noqa: F401  (installs the one-line warning format)
from .output import EXIT_CANNOT, Fail


class Group(click.Group):
    """The command group; a usage error (a missing option, a bad value) is reported like every
    other failure: one line on stderr, exit 2, and with ``--json`` the error document."""

    def invoke(self, ctx: click.Context) -> object:
        wants_json = "--json" in [*getattr(ctx, "_protected_args", []), *ctx.args]
        try:
            return super().invoke(ctx)
        except click.UsageError as exc:
            where = exc.ctx.command_path if exc.ctx is not None else "ckptfmt"
            raise Fail(f"{where}: {exc.format_message()} (see --help)", EXIT_CANNOT,
                       as_json=wants_json) from None


@click.group(cls=Group, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(package_name="ckptfmt")
def main() -> None:
    """ckptfmt: durable, fingerprinted step_NNNNNN.bin checkpoints.

    Exit codes: 0 ok/valid/identical, 1 a defect or difference was found,
    2 the check could not run (unreadable input, usage error).
    """
