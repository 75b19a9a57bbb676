"""``python -m ckptfmt ...`` is ``ckptfmt ...``: the console script's entry (``ckptfmt_console``,
outside the package), above every layer; it only hands the command line to the CLI."""
import sys

from ckptfmt_console import main

if __name__ == "__main__":
    sys.exit(main())
