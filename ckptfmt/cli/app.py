"""The ``ckptfmt`` click group; command modules register themselves on it."""
from __future__ import annotations

import click

from . import output  # noqa: F401  (installs the one-line warning format)


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(package_name="ckptfmt")
def main() -> None:
    """ckptfmt: durable, fingerprinted step_NNNNNN.bin checkpoints.

    Exit codes: 0 ok/valid/identical, 1 a defect or difference was found,
    2 the check could not run (unreadable input, usage error).
    """
