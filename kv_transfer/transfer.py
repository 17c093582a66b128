"""Per-request transfer objects and the table of those still in flight.

A :class:`Transfer` only moves forward (WAITING -> TRANSFERRING -> DONE, or
-> FAILED from any non-terminal state). Backend threads bracket every access
to the transfer's block memory with ``begin_io()`` / ``end_io()``; a stop
request (``abort()``, deadline) that arrives meanwhile interrupts the I/O via
``interrupt`` and the transfer turns FAILED only once the backend has let go
of the memory. So "terminal" always means "you may free the blocks now".
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Sequence

from .state import TransferState

logger = logging.getLogger("pdserve.kv_transfer")


class Transfer:
    """One request's transfer, on the sender or the receiver side."""

    def __init__(self, transfer_id: str, role: str, block_ids: Sequence[int], timeout_s: float,
                 abort_wait_s: float = 2.0,
                 interrupt: Callable[[Transfer], None] | None = None,
                 on_finish: Callable[[Transfer, TransferState], None] | None = None) -> None:
        self.transfer_id = transfer_id
        self.role = role
        self.block_ids: tuple[int, ...] = tuple(block_ids)
        self.created = time.monotonic()
        self.deadline = self.created + timeout_s
        self.finished_at: float | None = None
        self.bytes_moved = 0
        self.error: str | None = None
        self._abort_wait_s = abort_wait_s
        self._interrupt = interrupt
        self._on_finish = on_finish
        self._state = TransferState.WAITING
        self._lock = threading.Lock()
        self._finished = threading.Event()
        self._idle = threading.Event()
        self._idle.set()
        self._busy = False
        self._stop_reason: str | None = None
        self._finishing = False
        self._hooks: list[Callable[[Transfer], None]] = []
        self.granted_nbytes = 0
        self.capability = ""
        """Sender: the 128-bit secret (hex) a ``read``/``abort`` must name; receiver: the one it names."""

    def __repr__(self) -> str:
        return (f"Transfer({self.transfer_id!r}, {self.role}, {self._state.name}, "
                f"{len(self.block_ids)} blocks, error={self.error!r})")

    # -- public API ---------------------------------------------------------
    @property
    def state(self) -> TransferState:
        """Current state, without checking the deadline."""
        return self._state

    def poll(self) -> TransferState:
        """Current state; past the deadline, starts failing the transfer. Never blocks."""
        state = self._state
        if not state.is_terminal and time.monotonic() >= self.deadline:
            self.request_stop(f"deadline exceeded after {self.deadline - self.created:.3f}s",
                              interrupt=True)
            state = self._state
        return state

    def abort(self, reason: str = "aborted by caller") -> TransferState:
        """Fail the transfer and wait (bounded) until no backend touches its blocks."""
        self.request_stop(reason, interrupt=True)
        if not self._idle.wait(self._abort_wait_s):
            logger.error("transfer %s: backend still busy %.1fs after abort",
                         self.transfer_id, self._abort_wait_s)
        return self._state

    def wait(self, timeout: float | None = None) -> TransferState:
        """Block until terminal, the deadline, or ``timeout``; returns the state."""
        end = None if timeout is None else time.monotonic() + timeout
        while True:
            state = self.poll()
            if state.is_terminal:
                return state
            now = time.monotonic()
            if end is not None and now >= end:
                return state
            step = max(0.0, self.deadline - now) + 0.001
            if end is not None:
                step = min(step, end - now)
            self._finished.wait(min(step, 0.05))

    @property
    def elapsed_s(self) -> float | None:
        """Seconds from creation to the terminal state."""
        return None if self.finished_at is None else self.finished_at - self.created

    # -- backend side -------------------------------------------------------
    def add_finish_hook(self, fn: Callable[[Transfer], None]) -> None:
        """Call ``fn(self)`` when the transfer turns terminal (at once if it already is)."""
        with self._lock:
            if not (self._state.is_terminal or self._finishing):
                self._hooks.append(fn)
                return
        fn(self)

    def set_interrupt(self, fn: Callable[[Transfer], None] | None) -> None:
        """Install the callable that breaks the backend's blocking I/O on stop."""
        self._interrupt = fn

    @property
    def stop_requested(self) -> bool:
        """True once abort or the deadline asked the backend to stop."""
        return self._stop_reason is not None

    def remaining(self) -> float:
        """Seconds left before the deadline (may be <= 0)."""
        return self.deadline - time.monotonic()

    def set_transferring(self) -> bool:
        """WAITING -> TRANSFERRING; False unless it was WAITING (and not being stopped)."""
        with self._lock:
            if (self._state != TransferState.WAITING or self._stop_reason is not None
                    or self._finishing):
                return False
            self._state = TransferState.TRANSFERRING
            return True

    def begin_io(self) -> bool:
        """Mark that a backend starts touching the blocks; False if it must not."""
        with self._lock:
            if self._state.is_terminal or self._stop_reason is not None or self._finishing:
                return False
            self._busy = True
            self._idle.clear()
            return True

    def end_io(self) -> None:
        """The backend no longer touches the blocks; applies a pending stop."""
        with self._lock:
            self._busy = False
            reason = self._stop_reason
        if reason is not None:
            self._finish(TransferState.FAILED, reason)
        self._idle.set()

    def request_stop(self, reason: str, interrupt: bool = False) -> None:
        """Ask to fail; immediate when no I/O runs, else after ``end_io``."""
        with self._lock:
            if self._state.is_terminal or self._finishing:
                return
            if self._stop_reason is None:
                self._stop_reason = reason
            busy = self._busy
        if not busy:
            self._finish(TransferState.FAILED, reason)
        elif interrupt and self._interrupt is not None:
            try:
                self._interrupt(self)
            except Exception:  # interrupting is best effort
                logger.exception("transfer %s: interrupt failed", self.transfer_id)

    def succeed(self, nbytes: int = 0) -> bool:
        """Terminal DONE unless a stop was requested (then FAILED)."""
        self.bytes_moved += nbytes
        if self._stop_reason is not None:
            return self._finish(TransferState.FAILED, self._stop_reason)
        return self._finish(TransferState.DONE, None)

    def fail(self, reason: str) -> bool:
        """Terminal FAILED with ``reason`` (the backend must have let go of the blocks)."""
        return self._finish(TransferState.FAILED, reason)

    def _finish(self, state: TransferState, error: str | None) -> bool:
        with self._lock:
            if self._state.is_terminal or self._finishing:
                return False
            self._finishing = True
            self.error = error
            self.finished_at = time.monotonic()
        if state == TransferState.FAILED:
            logger.info("transfer %s (%s) failed: %s", self.transfer_id, self.role, error)
        if self._on_finish is not None:  # bookkeeping first: counters are exact once terminal
            self._on_finish(self, state)
        for hook in self._hooks:
            hook(self)
        self._state = state
        self._finished.set()
        return True


class TransferTable:
    """Transfers not yet terminal, plus a thread that enforces their deadlines."""

    def __init__(self, name: str, period_s: float = 0.05) -> None:
        self._items: dict[str, Transfer] = {}
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._period_s = period_s
        self.num_done = 0
        self.num_failed = 0
        self.bytes_moved = 0
        self._thread = threading.Thread(target=self._run, name=f"kv-reaper-{name}", daemon=True)
        self._thread.start()

    def add(self, t: Transfer) -> None:
        """Track ``t``; refuses a duplicate live transfer id."""
        with self._lock:
            if t.transfer_id in self._items:
                raise ValueError(f"transfer id {t.transfer_id!r} already in flight")
            self._items[t.transfer_id] = t

    def get(self, transfer_id: str) -> Transfer | None:
        """The live transfer with this id, if any."""
        with self._lock:
            return self._items.get(transfer_id)

    def finished(self, t: Transfer, state: TransferState) -> None:
        """``on_finish`` hook: forget ``t`` and count it."""
        with self._lock:
            if self._items.get(t.transfer_id) is t:
                del self._items[t.transfer_id]
            if state == TransferState.DONE:
                self.num_done += 1
            else:
                self.num_failed += 1
            self.bytes_moved += t.bytes_moved

    def live(self) -> list[Transfer]:
        """Snapshot of the transfers in flight."""
        with self._lock:
            return list(self._items.values())

    def __len__(self) -> int:
        with self._lock:
            return len(self._items)

    def close(self, reason: str) -> None:
        """Abort everything still in flight and stop the reaper thread."""
        for t in self.live():
            t.abort(reason)
        self._stop.set()
        self._thread.join(timeout=2)

    def _run(self) -> None:
        while not self._stop.wait(self._period_s):
            for t in self.live():
                t.poll()
