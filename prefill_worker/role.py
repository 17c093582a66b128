"""The prefill role: computes prompts to their first token and leases their KV blocks to decode workers.

Plugs into the worker runtime (worker_runtime/role.py): a KV sender (and a receiver, for cached prefixes
pulled from peers), the PrefillLoop, the Prefill RPC, which answers with the first token and, unless it
ended the request, the KV handle a decode worker pulls the blocks with, and LeasePrefix (a peer's pull).
"""
from __future__ import annotations

import asyncio
import dataclasses
import math

from common.cluster_auth import handles
from common.protocol import FINISH_REASONS, chunk_from_delta, worker_pb2
from engine.config import EngineConfig, SpeculativeConfig
from engine.sampling_params import InvalidParameter
from kv_transfer import make_receiver, make_sender
from prefill_worker.prefill_loop import PrefillLoop
from worker_runtime.errors import WorkerError
from worker_runtime.kv_handle import MAX_TRANSFER_ID_CHARS, KVSource, peer_to_proto
from worker_runtime.role import WorkerRole
from worker_runtime.servicer import abort_with


class PrefillRole(WorkerRole):
    name = "prefill"

    def engine_config(self, config: EngineConfig) -> EngineConfig:
        # It stops every request at its first token: nothing to speculate.
        return dataclasses.replace(config, speculative=SpeculativeConfig())

    def open_transfer(self, kv_cache, layout, kv_config):
        sender = make_sender(kv_cache, layout, kv_config)
        try:
            return TransferSides(sender, make_receiver(kv_cache, layout, kv_config))
        except BaseException:
            sender.close()
            raise

    def make_loop(self, engine, aio, transfer_side, config) -> PrefillLoop:
        return PrefillLoop(engine, aio, transfer_side.sender, transfer_side.receiver, config.peer_pull_timeout_s)

    async def lease_prefix(self, servicer, request, context):
        async with servicer.admitted(context):
            lease_s = await _lease_s(servicer, request.lease_s, context)
            try:
                if not 0 < len(request.lease_id) <= MAX_TRANSFER_ID_CHARS:
                    raise InvalidParameter("lease_id", f"must have 1 to {MAX_TRANSFER_ID_CHARS} characters")
                lease = await servicer.loop.lease_prefix(request.lease_id, list(request.token_ids),
                                                         request.cache_salt, lease_s)
            except InvalidParameter as exc:
                await abort_with(context, exc)
        if lease is None:
            return worker_pb2.PrefixLeaseResponse(num_tokens=0)
        num_tokens = len(lease.block_ids) * servicer.config.engine.cache.block_size
        return worker_pb2.PrefixLeaseResponse(num_tokens=num_tokens, kv=worker_pb2.KVHandle(
            peer=peer_to_proto(lease.peer_info), transfer_id=lease.transfer_id, block_ids=lease.block_ids,
            num_tokens=num_tokens, worker_address=servicer.address, capability=lease.capability))

    async def prefill(self, servicer, request, context):
        rid = request.request_id
        async with servicer.admitted(context):
            params = await servicer.params(request.params, context)
            lease_s = await _lease_s(servicer, request.lease_s, context)
            prompt = list(request.prompt_token_ids)
            prefix = await _prefix_source(servicer, request, prompt, context)
            try:
                result = await servicer.loop.prefill(rid, prompt, params, lease_s, cache_salt=request.cache_salt,
                                                     prefix=prefix, prefix_tokens=request.prefix_kv.num_tokens)
            except asyncio.CancelledError:
                servicer.loop.abort(rid)
                raise
            except (InvalidParameter, WorkerError) as exc:
                await abort_with(context, exc)
            first = result.first
            response = worker_pb2.PrefillResponse(first=chunk_from_delta(first), finished=first.finished,
                                                  cached_tokens=first.num_cached_tokens)
            if first.finished:
                response.finish_reason = FINISH_REASONS[first.finish_reason]
            else:
                response.kv.CopyFrom(worker_pb2.KVHandle(
                    peer=peer_to_proto(result.peer_info), transfer_id=result.transfer_id,
                    block_ids=result.block_ids, num_tokens=len(request.prompt_token_ids),
                    worker_address=servicer.address, capability=result.capability))
            return response


class TransferSides:
    """A prefill worker's two kv_transfer sides: the sender its leases go out by, a receiver for peer pulls."""

    def __init__(self, sender, receiver) -> None:
        self.sender = sender
        self.receiver = receiver

    @property
    def backend_name(self) -> str:
        return self.sender.backend_name

    def backend_info(self) -> dict[str, str]:
        return self.sender.backend_info()

    def close(self) -> None:
        self.receiver.close()
        self.sender.close()


async def _lease_s(servicer, lease_s: float, context) -> float:
    """A request's lease, checked; 0 is the worker's default, and --lease-s caps it."""
    if not math.isfinite(lease_s) or lease_s < 0:
        await abort_with(context, InvalidParameter("lease_s", "must be a finite number >= 0"))
    return min(lease_s or servicer.config.lease_s, servicer.config.lease_s)


async def _prefix_source(servicer, request, prompt: list[int], context) -> KVSource | None:
    """The checked `prefix_kv` of a Prefill call (None without one): signed by a router for this prompt's
    first `num_tokens` tokens, whole blocks, one block id per block."""
    if not request.HasField("prefix_kv"):
        return None
    handle, block_size = request.prefix_kv, servicer.config.engine.cache.block_size
    try:
        if not 0 < handle.num_tokens <= len(prompt) or handle.num_tokens % block_size:
            raise InvalidParameter("prefix_kv.num_tokens", f"must be whole blocks of {block_size} tokens within "
                                                           f"the prompt, got {handle.num_tokens}")
        if len(handle.block_ids) != handle.num_tokens // block_size:
            raise InvalidParameter("prefix_kv.block_ids", "must have one id per block of num_tokens")
        if servicer.handle_key is not None and not handles.verify(servicer.handle_key, handle,
                                                                  prompt[:handle.num_tokens]):
            raise InvalidParameter("prefix_kv", "the handle is not signed by a router of this cluster for this "
                                                "prompt")
        return KVSource.from_handle(handle, field="prefix_kv")
    except InvalidParameter as exc:
        await abort_with(context, exc)
