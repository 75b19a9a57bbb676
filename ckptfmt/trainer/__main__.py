"""``python -m ckptfmt.trainer ...`` is ``ckptfmt train ...``."""
import sys

from ..cli import main

if __name__ == "__main__":
    main(["train", *sys.argv[1:]], prog_name="python -m ckptfmt.trainer")
