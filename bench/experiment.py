"""γ policies over workloads, live or replayed from traces: `python bench/experiment.py [experiment flags]`."""

import sys

from specserve.cli import main

if __name__ == "__main__":
    sys.exit(main(["experiment", *sys.argv[1:]]))
