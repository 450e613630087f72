"""Chains vs static vs dynamic draft trees at equal verified nodes: `python bench/trees.py [bench-trees flags]`."""

import sys

from specserve.cli import main

if __name__ == "__main__":
    sys.exit(main(["bench-trees", *sys.argv[1:]]))
