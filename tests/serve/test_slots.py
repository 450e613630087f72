"""PrioritySlots: slots go to waiters by priority, first come first served within one; cancelled waiters give up
their place or pass on the slot they were handed; a free slot is taken at once."""

from __future__ import annotations

import asyncio

import pytest

from specserve.serve.slots import PrioritySlots


def test_freed_slots_go_by_priority_then_arrival() -> None:
    async def main() -> list[str]:
        slots = PrioritySlots(1)
        await slots.acquire()
        served: list[str] = []

        async def wait(name: str, priority: int) -> None:
            await slots.acquire(priority)
            served.append(name)
            await asyncio.sleep(0)
            slots.release()

        tasks = [asyncio.create_task(wait(name, p)) for name, p in (("fresh1", 1), ("fresh2", 1), ("resumed", 0))]
        await asyncio.sleep(0)
        assert slots.waiting == 3
        slots.release()
        await asyncio.gather(*tasks)
        return served

    assert asyncio.run(main()) == ["resumed", "fresh1", "fresh2"]


def test_a_free_slot_is_taken_at_once_and_returns_to_the_pool() -> None:
    async def main() -> None:
        slots = PrioritySlots(2)
        await slots.acquire()
        await slots.acquire(0)
        third = asyncio.create_task(slots.acquire())
        await asyncio.sleep(0)
        assert not third.done()
        slots.release()
        await third
        slots.release()
        slots.release()
        await asyncio.wait_for(slots.acquire(), 1)  # both back in the pool
        await asyncio.wait_for(slots.acquire(), 1)

    asyncio.run(main())


def test_a_cancelled_waiter_gives_up_its_place_or_passes_its_slot_on() -> None:
    async def main() -> None:
        slots = PrioritySlots(1)
        await slots.acquire()
        gone = asyncio.create_task(slots.acquire(0))
        kept = asyncio.create_task(slots.acquire(1))
        await asyncio.sleep(0)
        gone.cancel()  # waiting: its place goes
        await asyncio.sleep(0)
        slots.release()
        await asyncio.wait_for(kept, 1)

        handed = asyncio.create_task(slots.acquire())
        after = asyncio.create_task(slots.acquire())
        await asyncio.sleep(0)
        slots.release()  # handed the slot...
        handed.cancel()  # ...and cancelled before it ran: the slot passes on
        await asyncio.wait_for(after, 1)
        assert handed.cancelled()

    asyncio.run(main())


def test_slots_must_be_positive() -> None:
    with pytest.raises(ValueError, match="slots must be >= 1"):
        PrioritySlots(0)
