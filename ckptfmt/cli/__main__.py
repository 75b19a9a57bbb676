"""``python -m ckptfmt.cli ...`` is ``ckptfmt ...`` (torchrun: ``-m ckptfmt.cli train --run-dir``)."""
import sys

from . import main

if __name__ == "__main__":
    sys.exit(main())
