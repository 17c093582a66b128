"""AdmissionQueue: FIFO, bounded, timed out, never over-admits."""
import asyncio

import pytest

from router.admission import AdmissionQueue, AdmissionRejected


class Slots:
    def __init__(self, n: int) -> None:
        self.free = n

    def try_reserve(self):
        if self.free <= 0:
            return None
        self.free -= 1
        return "slot"

    def release(self, _slot) -> None:
        self.free += 1


def run(coro):
    return asyncio.run(coro)


def test_waiters_are_admitted_in_order_as_slots_free():
    async def scenario():
        slots = Slots(1)
        queue = AdmissionQueue(max_waiting=3, timeout_s=5)
        first, waited = await queue.admit(slots.try_reserve, slots.release)
        assert first == "slot" and waited == 0.0
        order = []

        async def wait(name):
            await queue.admit(slots.try_reserve, slots.release)
            order.append(name)

        tasks = [asyncio.create_task(wait(n)) for n in ("a", "b", "c")]
        await asyncio.sleep(0.01)
        assert queue.num_waiting == 3
        with pytest.raises(AdmissionRejected) as info:
            await queue.admit(slots.try_reserve, slots.release)
        assert info.value.reason == "queue_full" and info.value.retry_after_s == 1.0
        for _ in range(3):
            slots.release(None)
            queue.poke()
            queue.poke()  # a second poke must not admit a second waiter for one slot
            await asyncio.sleep(0.01)
        await asyncio.gather(*tasks)
        assert order == ["a", "b", "c"] and slots.free == 0 and queue.num_waiting == 0
    run(scenario())


def test_a_newcomer_does_not_overtake_waiters():
    async def scenario():
        slots = Slots(0)
        queue = AdmissionQueue(max_waiting=2, timeout_s=5)
        waiter = asyncio.create_task(queue.admit(slots.try_reserve, slots.release))
        await asyncio.sleep(0.01)
        slots.free = 1  # room appears but nobody poked yet
        newcomer = asyncio.create_task(queue.admit(slots.try_reserve, slots.release))
        await asyncio.sleep(0.01)
        assert not newcomer.done(), "queued behind the waiter"
        queue.poke()
        await asyncio.sleep(0.01)
        assert waiter.done() and not newcomer.done()
        newcomer.cancel()
    run(scenario())


def test_timeout_and_cancel_leave_nothing_behind():
    async def scenario():
        slots = Slots(0)
        queue = AdmissionQueue(max_waiting=2, timeout_s=0.05)
        with pytest.raises(AdmissionRejected) as info:
            await queue.admit(slots.try_reserve, slots.release)
        assert info.value.reason == "queue_timeout"
        task = asyncio.create_task(queue.admit(slots.try_reserve, slots.release))
        await asyncio.sleep(0.01)
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        assert queue.num_waiting == 0
        slots.free = 1
        queue.poke()
        assert slots.free == 1, "nobody left to reserve for"
    run(scenario())
