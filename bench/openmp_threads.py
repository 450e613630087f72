"""Why each actor does its torch work on one thread: a target forward, timed on one thread and on two.

    python bench/openmp_threads.py

Times the shipped target's 5-token verify forward (300-token cache) on a dedicated thread, then on
the main thread, then on the dedicated thread again: once two threads have run torch ops, libgomp
parks its workers between parallel regions and every forward pays for waking them.
"""

import time
from concurrent.futures import ThreadPoolExecutor

import torch

from specserve.core.model.causal_lm import CausalLM


def forward_ms() -> float:
    lm = CausalLM.load("models/target")
    cache = lm.new_cache()
    lm.forward(cache, torch.randint(0, 8000, (300,)), last_only=True)
    times = []
    for _ in range(30):
        start = time.perf_counter()
        lm.forward(cache, torch.randint(0, 8000, (5,)))
        times.append(time.perf_counter() - start)
        cache.rollback(300)
    return 1e3 * sorted(times)[len(times) // 2]


if __name__ == "__main__":
    pool = ThreadPoolExecutor(1)
    print(f"dedicated thread only:            {pool.submit(forward_ms).result():.1f} ms")
    print(f"main thread (second torch thread): {forward_ms():.1f} ms")
    print(f"dedicated thread again:           {pool.submit(forward_ms).result():.1f} ms")
