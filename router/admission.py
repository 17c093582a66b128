"""Admission control: a bounded FIFO of requests waiting for a worker with room. No I/O.

A request asks `admit(try_reserve)`. `try_reserve()` is synchronous: it returns
a reservation (e.g. a decode slot it has just taken) or None when every worker
is saturated. With no one waiting and room available the request goes at once;
otherwise it queues (at most `max_waiting`, else rejected at once) until
`poke()` — called whenever capacity may have freed up — reserves for it in
arrival order, or until `timeout_s` passes. Reserving inside `poke` (never in
the waiter after it wakes) means two waiters can never both take the last slot.
"""
from __future__ import annotations

import asyncio
import time
from collections import deque
from collections.abc import Callable
from typing import Any


class AdmissionRejected(Exception):
    """Every worker is saturated: retry after `retry_after_s`."""

    def __init__(self, reason: str, message: str, retry_after_s: float) -> None:
        super().__init__(message)
        self.reason = reason
        self.retry_after_s = retry_after_s


class AdmissionQueue:
    def __init__(self, max_waiting: int, timeout_s: float, retry_after_s: float = 1.0) -> None:
        if max_waiting < 0 or timeout_s < 0:
            raise ValueError("max_waiting and timeout_s must be >= 0")
        self.max_waiting = max_waiting
        self.timeout_s = timeout_s
        self.retry_after_s = retry_after_s
        self._waiters: deque[tuple[asyncio.Future, Callable[[], Any]]] = deque()

    @property
    def num_waiting(self) -> int:
        return len(self._waiters)

    async def admit(self, try_reserve: Callable[[], Any],
                    release: Callable[[Any], None]) -> tuple[Any, float]:
        """(reservation, seconds waited); raises AdmissionRejected. `release` undoes a
        reservation made for a waiter that was cancelled at the same moment."""
        if not self._waiters:
            reservation = try_reserve()
            if reservation is not None:
                return reservation, 0.0
        if len(self._waiters) >= self.max_waiting:
            raise AdmissionRejected("queue_full", f"every worker is saturated and {self.max_waiting} requests "
                                    f"are already waiting; retry in {self.retry_after_s:g} s", self.retry_after_s)
        start = time.monotonic()
        future = asyncio.get_running_loop().create_future()
        entry = (future, try_reserve)
        self._waiters.append(entry)
        try:
            reservation = await asyncio.wait_for(future, self.timeout_s)
        except asyncio.CancelledError:
            if future.done() and not future.cancelled():
                release(future.result())
            raise
        except asyncio.TimeoutError:
            raise AdmissionRejected("queue_timeout", f"every worker stayed saturated for {self.timeout_s:g} s; "
                                    f"retry in {self.retry_after_s:g} s", self.retry_after_s) from None
        finally:
            if entry in self._waiters:
                self._waiters.remove(entry)
        return reservation, time.monotonic() - start

    def poke(self) -> None:
        """Capacity may have freed up: reserve for waiters in order while there is room."""
        while self._waiters:
            future, try_reserve = self._waiters[0]
            if future.done():  # timed out or cancelled; admit() removes it
                self._waiters.popleft()
                continue
            reservation = try_reserve()
            if reservation is None:
                return
            self._waiters.popleft()
            future.set_result(reservation)
