"""``PrioritySlots``: an asyncio semaphore that hands freed slots to waiters by priority, first come first served
within one priority.

A model replica on the runner path admits ``at_once`` requests to generate and queues the rest; a request resumed
from a lost replica (its client is mid-stream, waiting) goes before requests that have not started. A waiter that
is cancelled gives up its place, or passes on the slot it was handed. One event loop; not thread-safe.
"""

from __future__ import annotations

import asyncio
import heapq
import itertools


class PrioritySlots:
    def __init__(self, slots: int) -> None:
        if slots < 1:
            raise ValueError(f"slots must be >= 1, got {slots}")
        self._free = slots
        self._order = itertools.count()
        self._waiters: list[tuple[int, int, asyncio.Future[None]]] = []  # a heap: (priority, arrival, future)

    @property
    def waiting(self) -> int:
        return sum(not future.done() for _, _, future in self._waiters)

    async def acquire(self, priority: int = 1) -> None:
        """Take a slot, waiting while none is free; lower ``priority`` values are served first."""
        if self._free > 0 and not self.waiting:
            self._free -= 1
            return
        future: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        heapq.heappush(self._waiters, (priority, next(self._order), future))
        try:
            await future
        except asyncio.CancelledError:
            if future.done() and not future.cancelled():  # handed a slot as it was cancelled: pass it on
                self.release()
            raise

    def release(self) -> None:
        """Give a slot back: to the first waiter of the lowest priority, else to the pool."""
        while self._waiters:
            _, _, future = heapq.heappop(self._waiters)
            if not future.done():
                future.set_result(None)
                return
        self._free += 1
