"""Verify buckets on the CPU (issue 20): T_verify(k) per cache and bucket, and the bucketed engine's speedup per γ.

    python bench/buckets.py [--quick] [--threads 1] [--ks 1-32,40,48,56,64] [--repeats 9] [--gammas 1-8] [--out DIR]

What it measures and writes: :mod:`specserve.benchmarks.buckets`.
"""

import sys

from specserve.benchmarks.buckets import main

if __name__ == "__main__":
    sys.exit(main())
