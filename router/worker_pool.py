"""The router's view of its workers: connections, health and load.

Workers come from the router's flags (static) or join and leave at run time
(the Redis registry calls `add`/`remove`). Every worker is polled (`GetStats`, which doubles as the health check) every
`health_interval_s`. A worker that cannot be reached (UNAVAILABLE: the process
is gone) is taken out of rotation at once; one that is merely slow to answer
(a busy CPU) only after MAX_SLOW_POLLS polls in a row time out. The poll puts
a worker back when it answers again (e.g. after Ray restarted it on the same
address).
"""
from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import grpc

from common.cluster_auth.grpc_auth import call_with_challenge, worker_channel
from common.protocol import worker_pb2, worker_pb2_grpc
from router.link_estimate import LinkEstimate
from router.routing_policy import PrefillSpeed

logger = logging.getLogger(__name__)
MAX_SLOW_POLLS = 3


@dataclass
class WorkerClient:
    address: str
    role: str
    channel: grpc.aio.Channel = field(repr=False, default=None)
    stub: worker_pb2_grpc.WorkerStub = field(repr=False, default=None)
    healthy: bool = False
    in_flight: int = 0
    """Requests this router has placed on the worker and not yet seen end. The ledger fields (`in_flight`,
    `pending_tokens`, `pending_prompts`, `speed`) are written only by the begin/end methods below."""
    in_flight_at_poll: int = 0
    """`in_flight` when the last stats arrived (the rest of stats.num_requests is others' work)."""
    pending_tokens: int = 0
    """Prefill: uncached prompt tokens of this router's Prefill calls in progress."""
    pending_prompts: dict[str, list[int]] = field(default_factory=dict)
    """Prefill: block hashes of this router's Prefill calls in progress, by sample id."""
    speed: PrefillSpeed = field(default_factory=PrefillSpeed, repr=False)
    """Prefill: its speed as learnt from this router's calls that found it idle."""
    link: LinkEstimate = field(default_factory=LinkEstimate, repr=False)
    """The observed bandwidth of KV pulls into it (router/link_estimate.py): from prefill workers into a decode
    worker, from its peers into a prefill worker."""
    lease_s: float = 0.0
    """Prefill: how long its LeasePrefix calls take, an exponentially weighted average (router/peer_pulls.py)."""
    stats: worker_pb2.WorkerStats | None = None
    last_error: str = ""
    slow_polls: int = 0
    """Consecutive polls that timed out."""
    answered_at: float = float("-inf")
    """Event-loop time of its last answered poll (a silent stream on a worker that answers is slow, not hung)."""
    retiring: bool = False
    """Being removed (a planner scale-down): out of rotation for good, still polled while it drains."""
    _pending_uncached: dict[str, int] = field(default_factory=dict, repr=False)
    """Prefill: the uncached tokens each call in progress added to `pending_tokens`, by sample id."""

    # ---- the ledger: this router's calls on the worker ----------------------
    def begin_prefill(self, sample_id: str, uncached_tokens: int, block_hashes: list[int]) -> None:
        """A Prefill call goes out: `uncached_tokens` of the prompt to compute, its blocks `block_hashes`."""
        self.in_flight += 1
        self.pending_tokens += uncached_tokens
        self.pending_prompts[sample_id] = block_hashes
        self._pending_uncached[sample_id] = uncached_tokens

    def end_prefill(self, sample_id: str, computed_tokens: int | None = None, seconds: float | None = None) -> None:
        """The Prefill call of `sample_id` ended; with `computed_tokens` and `seconds`, it ran alone on the
        worker and its duration teaches the worker's speed."""
        self.in_flight -= 1
        self.pending_tokens -= self._pending_uncached.pop(sample_id, 0)
        self.pending_prompts.pop(sample_id, None)
        if computed_tokens is not None and seconds is not None:
            self.speed.observe(computed_tokens, seconds)

    def begin_decode(self) -> None:
        """A request is routed to this decode worker (its slot is held from admission on)."""
        self.in_flight += 1

    def end_decode(self) -> None:
        """A request routed here has ended (finished, failed, cancelled or migrated away)."""
        self.in_flight -= 1

    @property
    def occupancy(self) -> int:
        """Requests on the worker (what its admission limit counts): this router's, plus
        others' as of the last stats."""
        others = self.stats.num_requests - self.in_flight_at_poll if self.stats else 0
        return self.in_flight + max(0, others)

    @property
    def working(self) -> int:
        """Requests costing the worker compute: `occupancy` without prefill leases (prompts
        already done, only waiting to be pulled), which the stats would otherwise count as
        others' work once this router's call has returned."""
        leases = self.stats.num_leases if self.stats else 0
        return max(self.in_flight, self.occupancy - leases)

    @property
    def has_room(self) -> bool:
        limit = self.stats.max_num_requests if self.stats else 0
        return not limit or self.occupancy < limit


class WorkerPool:
    def __init__(self, prefill: list[str], decode: list[str], health_interval_s: float = 1.0,
                 grpc_key: bytes | None = None, credentials: grpc.ChannelCredentials | None = None,
                 tls_options: Sequence[tuple[str, str]] = ()) -> None:
        self._grpc_key = grpc_key
        self._credentials = credentials
        """mTLS credentials for worker channels (None: plaintext)."""
        self._tls_options = tls_options
        """The cluster's token key: every call to a worker carries a token (None: no cluster secret)."""
        self.workers = [WorkerClient(a, "prefill") for a in prefill] + [WorkerClient(a, "decode") for a in decode]
        self.health_interval_s = health_interval_s
        self.on_change: list[Callable[[], None]] = []
        """Called after any change of health, load or membership (wakes admission waiters)."""
        self.on_add: list[Callable[[WorkerClient], None]] = []
        self.on_remove: list[Callable[[WorkerClient], None]] = []
        self._task: asyncio.Task | None = None

    async def start(self) -> None:
        for w in self.workers:
            self._connect(w)
        await self.check_all()
        self._task = asyncio.create_task(self._poll_forever())

    async def close(self) -> None:
        if self._task:
            self._task.cancel()
        for w in list(self.workers):
            await self.remove(w.address)

    def get(self, address: str) -> WorkerClient | None:
        return next((w for w in self.workers if w.address == address), None)

    async def add(self, address: str, role: str) -> WorkerClient:
        """A worker joins (from the registry): connect, check, start its KV event feed."""
        worker = self.get(address)
        if worker is not None:
            return worker
        worker = WorkerClient(address, role)
        self._connect(worker)
        self.workers.append(worker)
        logger.info("%s worker %s joined", role, address)
        await self.check(worker)
        return worker

    async def remove(self, address: str) -> None:
        worker = self.get(address)
        if worker is None:
            return
        self.workers.remove(worker)
        worker.healthy = False
        for callback in self.on_remove:
            callback(worker)
        if worker.channel is not None:
            await worker.channel.close()
        self.changed()

    def retire(self, address: str) -> WorkerClient | None:
        """Take a worker out of rotation for good, before it drains: no new request is routed to it,
        the ones it holds finish, and its polls go on (its stats show when it is empty)."""
        worker = self.get(address)
        if worker is not None:
            worker.retiring = True
            self.mark_failed(worker, "retiring (scale-down)")
            self.changed()
        return worker

    def changed(self) -> None:
        for callback in self.on_change:
            callback()

    def has_role(self, role: str) -> bool:
        return any(w.role == role for w in self.workers)

    def healthy(self, role: str) -> list[WorkerClient]:
        return [w for w in self.workers if w.role == role and w.healthy]

    def _connect(self, worker: WorkerClient) -> None:
        worker.channel = worker_channel(worker.address, self._grpc_key, self._credentials, self._tls_options)
        worker.stub = worker_pb2_grpc.WorkerStub(worker.channel)
        for callback in self.on_add:
            callback(worker)

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
        await self._check(worker)
        self.changed()

    async def _check(self, worker: WorkerClient) -> None:
        try:
            stats, proven = await call_with_challenge(worker.stub.GetStats, worker_pb2.StatsRequest(), self._grpc_key,
                                                      worker.address, max(2.0, 2 * self.health_interval_s))
        except grpc.aio.AioRpcError as exc:
            if exc.code() == grpc.StatusCode.DEADLINE_EXCEEDED and worker.healthy:
                worker.slow_polls += 1
                if worker.slow_polls < MAX_SLOW_POLLS:
                    return
            self.mark_failed(worker, f"{exc.code().name}: {exc.details()}")
            return
        worker.slow_polls = 0
        worker.answered_at = asyncio.get_running_loop().time()
        if not proven:
            self.mark_failed(worker, f"did not prove it holds the cluster secret and answers to {worker.address}")
            return
        if stats.role != worker.role:
            self.mark_failed(worker, f"is a {stats.role} worker, configured as {worker.role}")
            return
        if stats.draining or worker.retiring:
            self.mark_failed(worker, "draining" if stats.draining else "retiring (scale-down)")
            worker.stats = stats
            worker.in_flight_at_poll = worker.in_flight
            return
        if not worker.healthy:
            logger.info("%s worker %s in rotation", worker.role, worker.address)
        if worker.role == "decode":
            worker.link.observe(stats.kv_pull_bytes, stats.kv_pull_seconds)
        else:  # the peer prefix pulls into it
            worker.link.observe(stats.peer_pull_bytes, stats.peer_pull_seconds)
        worker.stats = stats
        worker.in_flight_at_poll = worker.in_flight
        worker.healthy = True

    async def _poll_forever(self) -> None:
        while True:
            await asyncio.sleep(self.health_interval_s)
            try:
                await self.check_all()
            except Exception:  # never let the poller die
                logger.exception("worker poll failed")
