"""The decode role: pulls a prompt's KV from the prefill worker named in its handle, then generates.

Plugs into the worker runtime (worker_runtime/role.py): a KV receiver (and a sender: its cached context
leased to prefill workers that pull it, router/README.md "Peer prefix pulls"), the DecodeLoop, the Decode RPC
(a stream of chunks, then the completion with its usage), and the drain's last step: streams still open
when the drain times out end as "draining" (UNAVAILABLE), so routers migrate them (router/migration.py).
"""
from __future__ import annotations

import asyncio
import time

import grpc

from common.cluster_auth import handles
from common.protocol import FINISH_REASONS, chunk_from_delta, generate_pb2
from decode_worker.decode_loop import DecodeLoop
from engine.sampling_params import InvalidParameter
from worker_runtime.errors import Draining, WorkerError
from worker_runtime.kv_handle import KVSource, prefix_source
from worker_runtime.role import WorkerRole
from worker_runtime.servicer import abort_with


class DecodeRole(WorkerRole):
    name = "decode"

    def make_loop(self, engine, aio, transfer_side, config) -> DecodeLoop:
        return DecodeLoop(engine, aio, transfer_side.receiver, config.pull_timeout_s, transfer_side.sender,
                          config.peer_pull_timeout_s)

    async def decode(self, servicer, request, context):
        rid = request.request_id
        async with servicer.admitted(context):
            params = await servicer.params(request.params, context)
            source = await _kv_source(servicer, request, context)
            resumed = list(request.resume_token_ids)
            items: asyncio.Queue = asyncio.Queue()
            prompt = list(request.prompt_token_ids)
            try:
                prefix = prefix_source(request, prompt, servicer.config.engine.cache.block_size, servicer.handle_key)
                if prefix is not None and source is not None:
                    raise InvalidParameter("prefix_kv", "only for a prompt computed here (first_token_id unset)")
                await servicer.loop.decode(rid, prompt, params, source, items.put_nowait,
                                           cache_salt=request.cache_salt, resume_token_ids=resumed,
                                           prefix=prefix, prefix_tokens=request.prefix_kv.num_tokens)
            except (InvalidParameter, WorkerError) as exc:
                await abort_with(context, exc)
            num_tokens = 1 if source is not None else len(resumed)  # usage counts every generated token
            finished = False
            try:
                while True:
                    item = await items.get()
                    if isinstance(item, asyncio.CancelledError):
                        finished = True
                        await context.abort(grpc.StatusCode.CANCELLED, "aborted")
                    if isinstance(item, BaseException):
                        finished = True
                        await abort_with(context, item)
                    num_tokens += len(item.token_ids)
                    if item.token_ids or item.text:
                        yield generate_pb2.GenerateResponse(request_id=rid, chunk=chunk_from_delta(item))
                    if item.finished:
                        finished = True
                        yield generate_pb2.GenerateResponse(request_id=rid, complete=generate_pb2.Complete(
                            finish_reason=FINISH_REASONS[item.finish_reason],
                            usage=generate_pb2.Usage(prompt_tokens=len(prompt), completion_tokens=num_tokens,
                                                     cached_tokens=item.num_cached_tokens)))
                        return
            finally:
                if not finished:
                    servicer.loop.abort(rid)

    async def end_streams(self, servicer, loop: DecodeLoop, timeout_s: float) -> None:
        if not servicer.in_flight:
            return
        await loop.call(lambda: loop.end_all(Draining(f"the worker is draining: its {timeout_s:g}s drain "
                                                      f"timeout passed")))
        deadline = time.monotonic() + 5
        while servicer.in_flight and time.monotonic() < deadline:
            await asyncio.sleep(0.05)


async def _kv_source(servicer, request, context) -> KVSource | None:
    """The checked KV handle of a Decode call, None when it carries none (co-located or resumed)."""
    if request.resume_token_ids and request.HasField("first_token_id"):
        await abort_with(context, InvalidParameter("resume_token_ids", "cannot be set with first_token_id"))
    if not request.HasField("first_token_id"):
        return None
    if servicer.handle_key is not None and not handles.verify(servicer.handle_key, request.kv,
                                                              request.prompt_token_ids):
        await abort_with(context, InvalidParameter(
            "kv", "the handle is not signed by a router of this cluster for this prompt"))
    try:
        return KVSource.from_handle(request.kv, request.first_token_id)
    except InvalidParameter as exc:
        await abort_with(context, exc)
