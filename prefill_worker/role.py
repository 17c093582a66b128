"""The prefill role: computes prompts to their first token and leases their KV blocks to decode workers.

Plugs into the worker runtime (worker_runtime/role.py): a KV sender, the PrefillLoop, and the Prefill RPC,
which answers with the first token and, unless it ended the request, the KV handle a decode worker pulls
the blocks with.
"""
from __future__ import annotations

import asyncio
import dataclasses
import math

from common.protocol import FINISH_REASONS, chunk_from_delta, worker_pb2
from engine.config import EngineConfig, SpeculativeConfig
from engine.sampling_params import InvalidParameter
from kv_transfer import make_sender
from prefill_worker.prefill_loop import PrefillLoop
from worker_runtime.errors import WorkerError
from worker_runtime.kv_handle import peer_to_proto
from worker_runtime.role import WorkerRole
from worker_runtime.servicer import abort_with


class PrefillRole(WorkerRole):
    name = "prefill"

    def engine_config(self, config: EngineConfig) -> EngineConfig:
        # It stops every request at its first token: nothing to speculate.
        return dataclasses.replace(config, speculative=SpeculativeConfig())

    def open_transfer(self, kv_cache, layout, kv_config):
        return make_sender(kv_cache, layout, kv_config)

    def make_loop(self, engine, aio, transfer_side, config) -> PrefillLoop:
        return PrefillLoop(engine, aio, transfer_side)

    async def prefill(self, servicer, request, context):
        rid = request.request_id
        async with servicer.admitted(context):
            params = await servicer.params(request.params, context)
            lease_s = request.lease_s
            if not math.isfinite(lease_s) or lease_s < 0:
                await abort_with(context, InvalidParameter("lease_s", "must be a finite number >= 0"))
            lease_s = min(lease_s or servicer.config.lease_s, servicer.config.lease_s)  # --lease-s caps it
            try:
                result = await servicer.loop.prefill(rid, list(request.prompt_token_ids), params, lease_s,
                                                     cache_salt=request.cache_salt)
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
