"""``python -m ckptfmt.trainer`` (what earlier READMEs gave for torchrun) says what replaced it."""
import sys

if __name__ == "__main__":
    sys.stderr.write("ckptfmt: python -m ckptfmt.trainer is now `ckptfmt train` (under torchrun: "
                     "torchrun ... -m ckptfmt.cli train --run-dir DIR ...; see ckptfmt train --help)\n")
    sys.exit(2)
