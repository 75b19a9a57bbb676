"""The ``ckptfmt`` console script (and ``python -m ckptfmt``). It lives outside the package so
that a Ctrl-C while the command line is still being imported ends like a Ctrl-C during a
command (one line, exit 130, with ``--json`` one error document), while ``import ckptfmt`` in
a user's program never touches that program's signals or its KeyboardInterrupt.

It imports nothing of ckptfmt before the Ctrl-C guard, so the document is spelled here; a test
holds it equal to the CLI's own (``ckptfmt.cli.output.error_doc``).
"""
from __future__ import annotations

import json
import sys

INTERRUPTED = "interrupted (Ctrl-C)"
EXIT_INTERRUPTED = 130          # the shell's 128 + SIGINT


def interrupted(argv: "list[str]") -> "int":
    """What a Ctrl-C before the command ran prints; the exit status."""
    if "--json" in argv:
        doc = {"error": {"type": "Interrupted", "message": INTERRUPTED, "path": None,
                         "exit_code": EXIT_INTERRUPTED}}
        print(json.dumps(doc, indent=1), flush=True)
    print(f"ckptfmt: {INTERRUPTED}", file=sys.stderr, flush=True)
    return EXIT_INTERRUPTED


def main() -> "int | None":
    try:
        from ckptfmt.cli import main as command_line
    except KeyboardInterrupt:
        return interrupted(sys.argv[1:])
    return command_line()


if __name__ == "__main__":
    sys.exit(main())
