"""python -m benchmarks: one entry to every benchmark, the results and the rendered pages.

    python -m benchmarks --list                     # every benchmark: what, usual arguments, time
    python -m benchmarks NAME [ARGS...]             # run one, with the arguments its script takes
    python -m benchmarks render [--check]           # docs/benchmarks/ from benchmarks/results/*.jsonl
    python -m benchmarks table FILE                 # the tables of one results file
    python -m benchmarks convert                    # the results written before the schema, into it

benchmarks/ is no package: its scripts run as scripts (``from common import ...``), and the
harness is imported from this folder as ``harness``.
"""
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from harness.catalog import main  # noqa: E402

sys.exit(main(sys.argv[1:]))
