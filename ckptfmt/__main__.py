"""``python -m ckptfmt ...`` is ``ckptfmt ...``: the entry point, above every layer (it only
hands the command line to the CLI)."""
import sys

from .cli import main

if __name__ == "__main__":
    sys.exit(main())
