"""Benchmarks behind ``specserve bench``; thin entry scripts live in ``bench/`` at the repository root."""
