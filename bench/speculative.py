"""Speculative decoding vs plain decoding vs transformers: `python bench/speculative.py [specserve bench flags]`."""

import sys

from specserve.cli import main

if __name__ == "__main__":
    sys.exit(main(["bench", *sys.argv[1:]]))
