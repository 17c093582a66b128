"""The prefill role: computes prompts to their first token and leases their KV blocks to decode workers.

Plugs into the worker runtime (worker_runtime/role.py): a KV sender (and a receiver, for cached prefixes
pulled from peers), the PrefillLoop, the Prefill RPC, which answers with the first token and, unless it
ended the request, the KV handle a decode worker pulls the blocks with, and LeasePrefix (a peer's pull).
"""
from __future__ import annotations

import asyncio
import dataclasses

from common.protocol import FINISH_REASONS, chunk_from_delta, worker_pb2
from engine.config import EngineConfig, SpeculativeConfig
from engine.sampling_params import InvalidParameter
from prefill_worker.prefill_loop import PrefillLoop
from worker_runtime.errors import WorkerError
from worker_runtime.kv_handle import peer_to_proto, prefix_source
from worker_runtime.kv_leases import lease_seconds
from worker_runtime.role import WorkerRole
from worker_runtime.servicer import abort_with


class PrefillRole(WorkerRole):
    name = "prefill"

    def engine_config(self, config: EngineConfig) -> EngineConfig:
        # It stops every request at its first token: nothing to speculate.
        return dataclasses.replace(config, speculative=SpeculativeConfig())

    def make_loop(self, engine, aio, transfer_side, config) -> PrefillLoop:
        return PrefillLoop(engine, aio, transfer_side.sender, transfer_side.receiver, config.peer_pull_timeout_s)

    async def prefill(self, servicer, request, context):
        rid = request.request_id
        async with servicer.admitted(context):
            params = await servicer.params(request.params, context)
            try:
                lease_s = lease_seconds(request.lease_s, servicer.config.lease_s)
            except InvalidParameter as exc:
                await abort_with(context, exc)
            prompt = list(request.prompt_token_ids)
            try:
                prefix = prefix_source(request, prompt, servicer.config.engine.cache.block_size, servicer.handle_key)
            except InvalidParameter as exc:
                await abort_with(context, exc)
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
