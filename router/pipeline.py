"""One request through the cluster: prefill worker -> KV handle -> decode worker -> stream.

Front ends (gRPC now) hand a validated PreparedRequest to `generate`, which
yields pdserve.v1.GenerateResponse messages: the first token the moment
prefill returns it, then the decode worker's stream. n > 1 fans out into n
independent samples (seed + i), merged into one stream by index.

Which workers: WorkerSelector admits each sample (bounded queue; overload ->
RESOURCE_EXHAUSTED with retry advice), reserves its decode worker, decides
whether remote prefill is worth it, and picks the prefill worker by the
routing policy.

Failure rules: a prefill worker that is unreachable is skipped (the next one
is tried; nothing was streamed yet). A decode stream that breaks (UNAVAILABLE:
the worker died, the connection was cut, the worker drained; or silent for
`stream_timeout_s` on a worker that no longer answers its health polls, or for
SLOW_STREAM_PATIENCE times that on one that does) migrates: the sample is re-admitted on another decode
worker with the prompt and the tokens already streamed (`resume_token_ids`,
recomputed there), up to `max_migrations` times (router/migration.py). Any
other failure ends the sample with a PipelineError carrying the gRPC status. Whenever a sample ends other than by
completing (error, cancel, deadline), every worker it touched is told to abort
it, so no KV blocks or leases outlive the request.
"""
from __future__ import annotations

import asyncio
import logging
import uuid
from collections.abc import AsyncIterator, Callable

import grpc

from common.cluster_auth import handles
from common.protocol import generate_pb2, params_to_proto, worker_pb2
from router.admission import AdmissionRejected
from router.config import RouterConfig
from router.migration import MigrationReason, SampleProgress, migration_reason
from router.peer_pulls import PeerPulls
from router.request_builder import PreparedRequest
from router.worker_pool import WorkerClient
from router.worker_selector import NoHealthyWorker, Route, WorkerSelector

logger = logging.getLogger(__name__)
ABORT_TIMEOUT_S = 5.0
PREFILL_BUSY_RETRIES = 20
PREFILL_BUSY_BACKOFF_S = 0.05
"""A prefill worker answering RESOURCE_EXHAUSTED (full) is asked again (or another is), waiting 0.05 s more
each time: up to 20 tries, ~10 s in all, before the caller sees it."""
SLOW_STREAM_PATIENCE = 4
"""A silent stream on a decode worker that still answers its health polls migrates only after this many
stream timeouts (it is overloaded, and moving its samples would add their recomputation elsewhere)."""


class PipelineError(Exception):
    def __init__(self, code: grpc.StatusCode, message: str, retry_after_s: float | None = None) -> None:
        super().__init__(message)
        self.code = code
        self.retry_after_s = retry_after_s
        """Set on RESOURCE_EXHAUSTED: when the client should try again."""


class _StreamBroken(Exception):
    """A decode stream broke in a way another worker can cure (router/migration.py)."""

    def __init__(self, reason: MigrationReason, error: PipelineError) -> None:
        super().__init__(str(error))
        self.reason = reason
        self.error = error
        """What the sample fails with when it may not migrate."""


class GenerationPipeline:
    def __init__(self, config: RouterConfig, selector: WorkerSelector,
                 on_migration: Callable[[str], None] = lambda reason: None) -> None:
        self.config = config
        self.on_migration = on_migration
        """Called with the reason of every migration (the metric)."""
        self.selector = selector
        self.pool = selector.pool
        self._background: set[asyncio.Task] = set()
        self.peer_pulls = PeerPulls(self.pool, selector.metrics)
        self.handle_key = None

    @property
    def handle_key(self) -> bytes | None:
        """The cluster's handle key: KV handles passed to decode workers (and prefix handles passed to
        prefill workers) are signed with it."""
        return self.peer_pulls.handle_key

    @handle_key.setter
    def handle_key(self, key: bytes | None) -> None:
        self.peer_pulls.handle_key = key

    async def generate(self, request: PreparedRequest, timeout_s: float | None = None,
                       routes: list[tuple[int, Route]] | None = None
                       ) -> AsyncIterator[generate_pb2.GenerateResponse]:
        """Stream the request's responses; `routes` (if given) receives (index, Route) per sample."""
        loop = asyncio.get_running_loop()
        deadline = None if timeout_s is None else loop.time() + timeout_s
        tag = uuid.uuid4().hex[:8]
        hashes = self.selector.block_hashes(request.prompt_token_ids, request.cache_salt)
        routes = [] if routes is None else routes
        if request.params.n == 1:
            async for msg in self._sample(f"{request.request_id}-{tag}", 0, request, request.params, deadline,
                                          hashes, routes):
                msg.request_id = request.request_id
                yield msg
            return
        async for msg in self._fan_out(request, tag, deadline, hashes, routes):
            msg.request_id = request.request_id
            yield msg

    async def _fan_out(self, request: PreparedRequest, tag: str, deadline, hashes, routes):
        queue: asyncio.Queue = asyncio.Queue()
        done = object()

        async def pump(index: int) -> None:
            try:
                async for msg in self._sample(f"{request.request_id}-{tag}-{index}", index, request,
                                              request.params.for_sample(index), deadline, hashes, routes):
                    queue.put_nowait(msg)
                queue.put_nowait(done)
            except BaseException as exc:  # noqa: BLE001 - handed to the consumer
                queue.put_nowait(exc)
                raise

        tasks = [asyncio.create_task(pump(i)) for i in range(request.params.n)]
        try:
            remaining = len(tasks)
            while remaining:
                item = await queue.get()
                if item is done:
                    remaining -= 1
                elif isinstance(item, BaseException):
                    raise item
                else:
                    yield item
        finally:
            for t in tasks:
                t.cancel()

    async def _sample(self, sample_id: str, index: int, request: PreparedRequest, params, deadline, hashes, routes):
        prompt = request.prompt_token_ids
        params_msg = params_to_proto(params)
        progress = SampleProgress(sample_id, self.config.max_migrations)
        touched: list[tuple[WorkerClient, str]] = []
        """(worker, request id there) of the current attempt: aborted unless the sample completes."""
        route = await self._admit(prompt, hashes)
        routes.append((index, route))
        reserved = True
        try:
            decode_req = worker_pb2.DecodeRequest(request_id=sample_id, prompt_token_ids=prompt, params=params_msg,
                                                  cache_salt=request.cache_salt)
            cached = None
            if not route.remote_prefill:  # computed on the decode worker, after pulling what a peer holds
                await self.peer_pulls.lease(sample_id, prompt, route, decode_req, touched, self.selector.block_size)
            else:
                first = await self._prefill(sample_id, prompt, hashes, params_msg, deadline, touched, route,
                                            request.cache_salt)
                cached = first.cached_tokens
                progress.observe(first.first.token_ids)
                yield generate_pb2.GenerateResponse(index=index, chunk=first.first)
                if first.finished:
                    progress.finish()
                    yield generate_pb2.GenerateResponse(index=index, complete=generate_pb2.Complete(
                        finish_reason=first.finish_reason, usage=generate_pb2.Usage(
                            prompt_tokens=len(prompt), completion_tokens=len(first.first.token_ids),
                            cached_tokens=cached)))
                    return
                decode_req.first_token_id = first.first.token_ids[0]
                decode_req.kv.CopyFrom(first.kv)
                if self.handle_key is not None:
                    handles.sign(self.handle_key, decode_req.kv, prompt)
            left: list[WorkerClient] = []
            """Decode workers this sample's stream broke on (avoided when it moves again)."""
            while True:
                try:
                    async for msg in self._decode(decode_req, route.decode, deadline, touched):
                        msg.index = index
                        if msg.HasField("complete"):
                            progress.finish()
                            usage = msg.complete.usage
                            if cached is not None:  # the prompt was computed (or reused) by prefill
                                usage.cached_tokens = cached
                            usage.cached_tokens = min(usage.cached_tokens, len(prompt))
                        elif msg.HasField("chunk"):
                            progress.observe(msg.chunk.token_ids)
                        yield msg
                    if progress.finished:
                        return
                    logger.warning("%s: the stream of decode worker %s ended without completing the sample",
                                   sample_id, route.decode.address)
                    raise _StreamBroken(MigrationReason.WORKER_LOST, PipelineError(
                        grpc.StatusCode.UNAVAILABLE,
                        f"decode worker {route.decode.address}: the stream ended without completing"))
                except _StreamBroken as broken:
                    if not progress.may_migrate():
                        raise broken.error from None
                    left.append(route.decode)
                    for worker, worker_rid in touched:  # the old attempt: free whatever it still holds
                        self._abort_later(worker, worker_rid)
                    touched.clear()
                    self.selector.release(route)
                    reserved = False
                    attempt_id = progress.migrate(broken.reason)
                    self.on_migration(broken.reason.value)
                    logger.warning("%s: %s after %d tokens (%s); migrating (%d of at most %d)", sample_id,
                                   broken.reason.value, len(progress.generated), broken.error,
                                   len(progress.migrations), progress.max_migrations)
                    context = progress.context(prompt)
                    try:
                        moved = await self._admit(context, self.selector.block_hashes(context, request.cache_salt),
                                                  exclude=tuple(left))
                    except PipelineError as exc:
                        raise PipelineError(exc.code, f"{broken.error}; migration failed: {exc}",
                                            exc.retry_after_s) from None
                    route.decode, route.remote_prefill = moved.decode, False
                    reserved = True
                    decode_req = worker_pb2.DecodeRequest(request_id=attempt_id, prompt_token_ids=prompt,
                                                          params=params_msg, cache_salt=request.cache_salt,
                                                          resume_token_ids=progress.resume_token_ids)
        finally:
            if reserved:
                self.selector.release(route)
            if not progress.finished:
                for worker, worker_rid in touched:
                    self._abort_later(worker, worker_rid)

    async def _admit(self, prompt: list[int], hashes: list[int], exclude: tuple[WorkerClient, ...] = ()) -> Route:
        """Admit a sample (a migrating one preferably on a worker not in `exclude`: when only those are
        healthy, one still answering its health poll may take it back, under a new attempt id)."""
        try:
            try:
                return await self.selector.route(prompt, hashes, exclude)
            except NoHealthyWorker:
                if not exclude:
                    raise
            return await self.selector.route(prompt, hashes)
        except AdmissionRejected as exc:
            raise PipelineError(grpc.StatusCode.RESOURCE_EXHAUSTED, str(exc), exc.retry_after_s) from None
        except NoHealthyWorker as exc:
            raise PipelineError(grpc.StatusCode.UNAVAILABLE, str(exc)) from None

    async def _prefill(self, sample_id, prompt, hashes, params_msg, deadline, touched, route: Route,
                       cache_salt: str = ""):
        request = worker_pb2.PrefillRequest(request_id=sample_id, prompt_token_ids=prompt, params=params_msg,
                                            lease_s=self.config.lease_s, cache_salt=cache_salt)
        tried: list[WorkerClient] = []
        busy_retries = 0
        while True:
            pick = self.selector.pick_prefill(len(prompt), hashes, exclude=tuple(tried))
            if pick is None:
                detail = f" (tried {', '.join(w.address for w in tried)})" if tried else ""
                raise PipelineError(grpc.StatusCode.UNAVAILABLE, "no healthy prefill worker" + detail)
            worker = route.prefill = pick.worker
            touched.append((worker, sample_id))
            request.ClearField("prefix_kv")
            pulled = await self.peer_pulls.lease(sample_id, prompt, pick, request, touched, self.selector.block_size,
                                                 attempt=len(tried) + busy_retries)
            held = max(pick.held, pulled)
            uncached = max(0, len(prompt) - held * self.selector.block_size)
            idle = worker.working == 0 and not (worker.stats and worker.stats.num_waiting_tokens)
            started = asyncio.get_running_loop().time()
            worker.begin_prefill(sample_id, uncached, hashes)
            timed: tuple[int, float] | tuple[None, None] = (None, None)
            try:
                first = await worker.stub.Prefill(request, timeout=_remaining(deadline))
                took = asyncio.get_running_loop().time() - started
                computed = len(prompt) - first.cached_tokens
                if idle and not pulled:  # nothing ahead of it: the call's duration is this prompt's prefill
                    timed = (computed, took)
                if self.selector.metrics is not None:
                    self.selector.metrics.observe_prefill_done(computed, pick.predicted_s, took)
                return first
            except grpc.aio.AioRpcError as exc:
                if exc.code() == grpc.StatusCode.UNAVAILABLE:
                    self._recheck(worker)
                    tried.append(worker)
                    continue
                if exc.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and busy_retries < PREFILL_BUSY_RETRIES:
                    # full: its last prompts' KV still waits for their decode workers to pull it, which the
                    # ledger (freed when Prefill returned) does not see; a worker frees up within moments
                    busy_retries += 1
                    await asyncio.sleep(min(PREFILL_BUSY_BACKOFF_S * busy_retries, _remaining(deadline) or 1.0))
                    continue
                raise _worker_error(worker, exc) from None
            finally:
                worker.end_prefill(sample_id, *timed)

    async def _decode(self, decode_req, worker: WorkerClient, deadline, touched):
        """The decode worker's stream; raises _StreamBroken when it breaks in a way a migration cures."""
        touched.append((worker, decode_req.request_id))
        call = worker.stub.Decode(decode_req, timeout=_remaining(deadline))
        silence = self.config.stream_timeout_s or None
        loop = asyncio.get_running_loop()
        read = None
        try:
            last_msg = loop.time()
            while True:
                # One read outstanding across waits: a timed-out wait must not cancel it (a cancelled
                # read cancels the call, whose next read would then look like a clean end).
                read = read or asyncio.ensure_future(call.read())
                done, _ = await asyncio.wait({read}, timeout=silence)
                if not done:
                    if deadline is not None and loop.time() >= deadline:
                        raise PipelineError(grpc.StatusCode.DEADLINE_EXCEEDED, "deadline exceeded")
                    silent = loop.time() - last_msg
                    if loop.time() - worker.answered_at < silence and silent < SLOW_STREAM_PATIENCE * silence:
                        continue  # it answers its health polls: overloaded, not hung; keep waiting
                    self.pool.mark_failed(worker, f"decode stream silent for {silent:.3g}s")
                    self._recheck(worker)  # back in rotation when it answers a poll again
                    raise _StreamBroken(MigrationReason.STREAM_TIMEOUT, PipelineError(
                        grpc.StatusCode.UNAVAILABLE,
                        f"decode worker {worker.address}: stream silent for {silent:.3g}s"))
                msg, read, last_msg = read.result(), None, loop.time()
                if msg is grpc.aio.EOF:
                    return
                yield msg
        except grpc.aio.AioRpcError as exc:
            reason = migration_reason(exc.code(), exc.details())
            if reason is not None:  # out of rotation now, not after a poll: the move must not pick it again
                self.pool.mark_failed(worker, f"decode stream broke: {exc.code().name}: {exc.details()}")
                self._recheck(worker)  # a worker that still answers (a cut connection) comes straight back
            if reason is None:
                raise _worker_error(worker, exc) from None
            raise _StreamBroken(reason, _worker_error(worker, exc)) from None
        finally:
            if read is not None:
                read.cancel()
            call.cancel()

    def _recheck(self, worker: WorkerClient) -> None:
        self._spawn(self.pool.check(worker))

    def _abort_later(self, worker: WorkerClient, sample_id: str) -> None:
        async def abort() -> None:
            try:
                await worker.stub.Abort(generate_pb2.AbortRequest(request_id=sample_id), timeout=ABORT_TIMEOUT_S)
            except grpc.aio.AioRpcError as exc:
                logger.info("abort of %s on %s failed: %s", sample_id, worker.address, exc.code().name)
        self._spawn(abort())

    def _spawn(self, coro) -> None:
        task = asyncio.get_running_loop().create_task(coro)
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    async def wait_background(self) -> None:
        if self._background:
            await asyncio.gather(*self._background, return_exceptions=True)


def _remaining(deadline: float | None) -> float | None:
    if deadline is None:
        return None
    return max(0.001, deadline - asyncio.get_running_loop().time())


def _worker_error(worker: WorkerClient, exc: grpc.aio.AioRpcError) -> PipelineError:
    return PipelineError(exc.code(), f"{worker.role} worker {worker.address}: {exc.details()}")
