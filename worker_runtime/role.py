"""What a worker role plugs into the shared runtime (worker_runtime/server.py, servicer.py).

The runtime owns what every worker has: the engine, its thread, the gRPC server with auth, health and
metrics, admission and drain, the KV event log and the Redis presence. A role (prefill_worker/role.py,
decode_worker/role.py) supplies the rest: its engine-thread loop (given both KV transfer sides,
transfer_sides.py), its RPC (Prefill or Decode), and what a drain does to streams still open. The runtime
never imports a role; the command that starts a worker (pdserve/worker_roles.py) picks one and hands it over.
"""
from __future__ import annotations

import asyncio
from abc import ABC, abstractmethod
from typing import TYPE_CHECKING, Any

import grpc

from engine.config import EngineConfig

if TYPE_CHECKING:
    from engine.llm_engine import LLMEngine
    from worker_runtime.config import WorkerConfig
    from worker_runtime.engine_loop import EngineLoop
    from worker_runtime.servicer import WorkerServicer


class WorkerRole(ABC):
    name: str
    """"prefill" or "decode": `WorkerConfig.role`."""

    def engine_config(self, config: EngineConfig) -> EngineConfig:
        """The engine configuration this role runs (the worker's, adjusted where the role needs)."""
        return config

    @abstractmethod
    def make_loop(self, engine: LLMEngine, aio: asyncio.AbstractEventLoop, transfer_side: Any,
                  config: WorkerConfig) -> EngineLoop:
        """The engine-thread loop of this role (not started)."""

    async def prefill(self, servicer: WorkerServicer, request, context):
        """The Prefill RPC; a role that does not prefill refuses it."""
        await context.abort(grpc.StatusCode.FAILED_PRECONDITION, f"this is a {self.name} worker")

    async def decode(self, servicer: WorkerServicer, request, context):
        """The Decode RPC (a stream of GenerateResponse); a role that does not decode refuses it."""
        await context.abort(grpc.StatusCode.FAILED_PRECONDITION, f"this is a {self.name} worker")
        yield  # an async generator, as a streaming handler is

    async def end_streams(self, servicer: WorkerServicer, loop: EngineLoop, timeout_s: float) -> None:
        """A drain's timeout passed with calls still open: end them as the role must (nothing by default)."""
        return None
