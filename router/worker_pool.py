"""The router's view of its workers: connections, health, load, and the pick.

Every worker is polled (`GetStats`, which doubles as the health check) every
`health_interval_s`. A worker that cannot be reached (UNAVAILABLE: the process
is gone) is taken out of rotation at once; one that is merely slow to answer
(a busy CPU) only after MAX_SLOW_POLLS polls in a row time out. The poll puts
a worker back when it answers again (e.g. after Ray restarted it on the same
address).
"""
from __future__ import annotations

import asyncio
import itertools
import logging
from dataclasses import dataclass, field

import grpc

from pdserve.grpc_common import insecure_channel
from pdserve.protocol import worker_pb2, worker_pb2_grpc

logger = logging.getLogger(__name__)
MAX_SLOW_POLLS = 3


@dataclass
class WorkerClient:
    address: str
    role: str
    index: int
    channel: grpc.aio.Channel = field(repr=False, default=None)
    stub: worker_pb2_grpc.WorkerStub = field(repr=False, default=None)
    healthy: bool = False
    in_flight: int = 0
    """Calls this router has open on the worker."""
    stats: worker_pb2.WorkerStats | None = None
    last_error: str = ""
    slow_polls: int = 0
    """Consecutive polls that timed out."""

    def load(self) -> tuple:
        """Smaller is less loaded: open calls, then queued prompt tokens, then KV in use."""
        s = self.stats
        return (self.in_flight, s.num_waiting_tokens if s else 0, s.kv_blocks_used if s else 0, self.index)


class WorkerPool:
    def __init__(self, prefill: list[str], decode: list[str], policy: str = "least_loaded",
                 health_interval_s: float = 1.0) -> None:
        self.workers = [WorkerClient(a, "prefill", i) for i, a in enumerate(prefill)]
        self.workers += [WorkerClient(a, "decode", i) for i, a in enumerate(decode)]
        self.policy = policy
        self.health_interval_s = health_interval_s
        self._round_robin = {"prefill": itertools.count(), "decode": itertools.count()}
        self._task: asyncio.Task | None = None

    async def start(self) -> None:
        for w in self.workers:
            w.channel = insecure_channel(w.address)
            w.stub = worker_pb2_grpc.WorkerStub(w.channel)
        await self.check_all()
        self._task = asyncio.create_task(self._poll_forever())

    async def close(self) -> None:
        if self._task:
            self._task.cancel()
        for w in self.workers:
            if w.channel is not None:
                await w.channel.close()

    def has_role(self, role: str) -> bool:
        return any(w.role == role for w in self.workers)

    def pick(self, role: str, exclude: tuple[WorkerClient, ...] = ()) -> WorkerClient | None:
        """A healthy worker of this role, or None."""
        candidates = [w for w in self.workers if w.role == role and w.healthy and w not in exclude]
        if not candidates:
            return None
        if self.policy == "round_robin":
            return candidates[next(self._round_robin[role]) % len(candidates)]
        return min(candidates, key=WorkerClient.load)

    def mark_failed(self, worker: WorkerClient, error: str) -> None:
        if worker.healthy:
            logger.warning("%s worker %s leaves rotation: %s", worker.role, worker.address, error)
        worker.healthy = False
        worker.last_error = error

    async def check_all(self) -> None:
        await asyncio.gather(*(self.check(w) for w in self.workers))

    async def wait_healthy(self, timeout_s: float) -> bool:
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        while not all(w.healthy for w in self.workers):
            if loop.time() >= deadline:
                return False
            await asyncio.sleep(0.1)
            await self.check_all()
        return True

    async def check(self, worker: WorkerClient) -> None:
        try:
            stats = await worker.stub.GetStats(worker_pb2.StatsRequest(),
                                               timeout=max(2.0, 2 * self.health_interval_s))
        except grpc.aio.AioRpcError as exc:
            if exc.code() == grpc.StatusCode.DEADLINE_EXCEEDED and worker.healthy:
                worker.slow_polls += 1
                if worker.slow_polls < MAX_SLOW_POLLS:
                    return
            self.mark_failed(worker, f"{exc.code().name}: {exc.details()}")
            return
        worker.slow_polls = 0
        if stats.role != worker.role:
            self.mark_failed(worker, f"is a {stats.role} worker, configured as {worker.role}")
            return
        if stats.draining:
            self.mark_failed(worker, "draining")
            worker.stats = stats
            return
        if not worker.healthy:
            logger.info("%s worker %s in rotation", worker.role, worker.address)
        worker.stats = stats
        worker.healthy = True

    async def _poll_forever(self) -> None:
        while True:
            await asyncio.sleep(self.health_interval_s)
            try:
                await self.check_all()
            except Exception:  # never let the poller die
                logger.exception("worker poll failed")
