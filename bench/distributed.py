"""In-process engine vs the distributed runtime: `python bench/distributed.py [specserve bench-distributed flags]`."""

import sys

from specserve.cli import main

if __name__ == "__main__":
    sys.exit(main(["bench-distributed", *sys.argv[1:]]))
