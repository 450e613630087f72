"""Load test of the HTTP API, speculation on vs off: `python bench/serve_load.py [specserve bench-serve flags]`."""

import sys

from specserve.cli import main

if __name__ == "__main__":
    sys.exit(main(["bench-serve", *sys.argv[1:]]))
