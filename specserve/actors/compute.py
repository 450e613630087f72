"""One thread per actor process for all torch work.

GNU OpenMP (the CPU build of torch uses libgomp) keeps one team of worker threads per thread
that has ever entered a parallel region. Once a process holds more such threads than it has
CPUs, libgomp stops spinning between regions and parks its workers on futexes, and every
parallel op pays a wake-up: measured here (``bench/openmp_threads.py``), a target forward that
takes 15 ms when one thread does all the torch work takes 21-22 ms once a second thread has also
run torch ops.
Actors are exactly that case: Ray runs methods on its own threads and gRPC handlers on a pool.
So each actor funnels its torch work through one :class:`ComputeThread`; code on other threads
that must touch a tensor does so in :func:`single_threaded` (an OpenMP team of one has no
workers).

Does not: make torch thread-safe in general, or schedule work fairly (calls run in FIFO order).
"""

from __future__ import annotations

import contextlib
import functools
import threading
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Concatenate, ParamSpec, Protocol, TypeVar

import torch

P = ParamSpec("P")
T = TypeVar("T")


class ComputeThread:
    def __init__(self, num_threads: int | None = None, name: str = "torch") -> None:
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix=name)
        self._thread_id = self._pool.submit(threading.get_ident).result()
        if num_threads:
            self.run(torch.set_num_threads, num_threads)

    def run(self, fn: Callable[P, T], *args: P.args, **kwargs: P.kwargs) -> T:
        """Run ``fn`` on the compute thread and return its result (directly when already there)."""
        if threading.get_ident() == self._thread_id:
            return fn(*args, **kwargs)
        return self._pool.submit(fn, *args, **kwargs).result()

    def start(self, fn: Callable[[], object]) -> Future[object]:
        """Queue ``fn`` (e.g. a loop that runs until told to stop) without waiting for it."""
        return self._pool.submit(fn)

    def shutdown(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)


class HasComputeThread(Protocol):
    compute: ComputeThread


S = TypeVar("S", bound=HasComputeThread)


def on_compute_thread(method: Callable[Concatenate[S, P], T]) -> Callable[Concatenate[S, P], T]:
    """Decorate a method of an object with a ``compute`` thread: every call runs there."""

    @functools.wraps(method)
    def run_there(self: S, *args: P.args, **kwargs: P.kwargs) -> T:
        return self.compute.run(method, self, *args, **kwargs)

    return run_there


@contextlib.contextmanager
def single_threaded() -> Iterator[None]:
    """Torch ops on this (non-compute) thread without starting another OpenMP team."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(before)
