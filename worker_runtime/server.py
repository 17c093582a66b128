"""One worker process: engine + engine thread + kv_transfer side + gRPC server, serving one role.

`WorkerServer` starts and stops in any asyncio loop (tests run it in-process,
the Ray actor in a thread of its own); `run_worker` is the process entry point
behind `pdserve prefill-worker` / `pdserve decode-worker`, with SIGTERM drain.
"""
from __future__ import annotations

import asyncio
import dataclasses
import logging
import os
import threading
import time
from pathlib import Path

import grpc
import torch

from common.cluster_auth.grpc_auth import ClusterAuthServerInterceptor
from common.cluster_auth.secret import LOOPBACK_HOSTS, warn_if_exposed
from common.grpc_common import (
    WORKER_SERVER_OPTIONS,
    add_health_and_reflection,
    run_until_signalled,
    set_serving,
)
from common.grpc_invalid_messages import InvalidMessages
from common.protocol import worker_pb2, worker_pb2_grpc
from engine.llm_engine import LLMEngine
from kv_transfer import KVLayout
from kv_transfer.sharded import ShardedKV
from kv_transfer.tls import KVTLSFiles
from worker_runtime.config import WorkerConfig
from worker_runtime.engine_loop import EngineLoop
from worker_runtime.kv_event_log import KvEventLog
from worker_runtime.metrics import WorkerMetrics
from worker_runtime.role import WorkerRole
from worker_runtime.servicer import WorkerServicer
from worker_runtime.transfer_sides import open_sides

logger = logging.getLogger(__name__)
BROKEN_EXIT_GRACE_S = 2.0
BROKEN_EXIT_CODE = 75  # EX_TEMPFAIL: start again
SERVICE = worker_pb2.DESCRIPTOR.services_by_name["Worker"].full_name


class WorkerServer:
    def __init__(self, config: WorkerConfig, role: WorkerRole) -> None:
        if role.name != config.role:
            raise ValueError(f"a {role.name} role cannot serve a {config.role} worker's configuration")
        self.config = config
        self.role = role
        self.address = ""
        self.engine: LLMEngine | None = None
        self._transfer_side = None
        self._loop_thread: EngineLoop | None = None
        self._server = None
        self._health = None
        self._servicer: WorkerServicer | None = None
        self._metrics: WorkerMetrics | None = None
        self.metrics_port: int | None = None
        self._presence = None
        self._serving = False
        """gRPC started and not draining: what /ready on the metrics port says."""

    async def start(self) -> str:
        """Load the model, open the KV transfer side, serve; returns host:port."""
        config = self.config
        if config.num_threads:
            torch.set_num_threads(config.num_threads)
        aio = asyncio.get_running_loop()
        self.engine = await aio.run_in_executor(None, LLMEngine, self.role.engine_config(config.engine))
        runner = self.engine.runner
        shards = runner.kv_shards()  # one per tensor-parallel rank or pipeline stage in this node's processes
        kv_cache = shards[0] if len(shards) == 1 else ShardedKV(shards, runner.kv_stages)
        layout = KVLayout.of_kv_cache(kv_cache, Path(self.engine.model_path).name, runner.kv_scales)
        stages = runner.remote_stages()  # pipeline stages on other nodes: their own senders
        keys = config.auth.load()  # read here, in the worker's process: never carried in its arguments
        warn_if_exposed(f"{config.role} worker gRPC", config.host, keys)
        warn_if_exposed(f"{config.role} worker KV transfer", config.kv_transfer.host, keys)
        kv_tls = KVTLSFiles(config.tls.cert_file, config.tls.key_file, config.tls.ca_file) \
            if config.tls.enabled and config.kv_tls else None
        kv_config = dataclasses.replace(config.kv_transfer, auth_key=keys.kv if keys else None, tls=kv_tls)
        self._transfer_side = await aio.run_in_executor(None, open_sides, kv_cache, layout, kv_config, stages)
        self._loop_thread = self.role.make_loop(self.engine, aio, self._transfer_side, config)
        self._loop_thread.on_broken = lambda reason: aio.call_soon_threadsafe(self._broken, reason)
        kv_events = self._loop_thread.kv_events = KvEventLog(self.engine, aio)
        self._loop_thread.start()
        auth = ClusterAuthServerInterceptor(keys.grpc) if keys else None
        interceptors = [auth] if auth else []  # first: a stranger's call is refused before anything is read
        self._server = grpc.aio.server(interceptors=[*interceptors, InvalidMessages()],
                                       options=WORKER_SERVER_OPTIONS)
        if config.tls.enabled:
            port = self._server.add_secure_port(f"{config.host}:{config.port}", config.tls.server_credentials())
        else:
            port = self._server.add_insecure_port(f"{config.host}:{config.port}")
        if port == 0:
            raise OSError(f"cannot bind {config.host}:{config.port}")
        self.address = kv_events.worker = f"{_advertised_host(config)}:{port}"
        if auth is not None:
            auth.audiences = worker_names(self.address, config, port)
        self._servicer = WorkerServicer(config, self.role, self._loop_thread, self.address,
                                        getattr(self._transfer_side, "backend_name", ""))
        self._servicer.handle_key = keys.handle if keys else None
        all_layers = layout.num_layers + sum(stage.num_layers for stage in stages)
        self._servicer.kv_block_bytes = layout.block_nbytes * all_layers // layout.num_layers
        worker_pb2_grpc.add_WorkerServicer_to_server(self._servicer, self._server)
        self._health = add_health_and_reflection(self._server, [SERVICE])
        if config.metrics_port is not None:
            self._metrics = WorkerMetrics(self._loop_thread, config.role, self.address,
                                          self._transfer_side.backend_info())
            self.metrics_port = self._metrics.serve(config.host, config.metrics_port, self._ready)
        await self._server.start()
        await set_serving(self._health, [SERVICE], True)
        self._serving = True
        if config.redis_url:
            from worker_runtime.redis_presence import RedisPresence
            self._presence = RedisPresence(config.redis_url, self.address, config.role, kv_events,
                                           config.registry_ttl_s, config.redis_password_file,
                                           keys.events if keys else None, keys.registry if keys else None)
            await self._presence.start()
        logger.info("%s worker serving at %s (kv_transfer %s, metrics port %s)", config.role, self.address,
                    self._servicer.backend, self.metrics_port)
        return self.address

    def _broken(self, reason: str) -> None:
        """The engine can never step again (a rank or pipeline stage is gone; its requests already failed
        UNAVAILABLE): stop serving, then end this process after a moment (the failures reach their callers), so
        what supervises it (Ray restarts the actor, Kubernetes the pod) starts a fresh worker."""
        logger.critical("%s worker %s: %s; exiting to be replaced", self.config.role, self.address, reason)
        self._serving = False
        if self._health is not None:
            asyncio.ensure_future(set_serving(self._health, [SERVICE], False))
        threading.Timer(BROKEN_EXIT_GRACE_S, os._exit, (BROKEN_EXIT_CODE,)).start()

    def _ready(self) -> bool:
        return self._serving

    async def drain(self, timeout_s: float | None = None) -> None:
        """Stop taking requests (health NOT_SERVING, new calls UNAVAILABLE); wait for in-flight ones."""
        timeout_s = self.config.drain_timeout_s if timeout_s is None else timeout_s
        if self._servicer is None:
            return
        self._servicer.draining = True
        self._serving = False
        await set_serving(self._health, [SERVICE], False)
        await self._leave_registry()
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline and (self._servicer.in_flight
                                               or self._loop_thread.stats.get("num_requests", 0)):
            await asyncio.sleep(0.05)
        if self._servicer.in_flight:
            await self.role.end_streams(self._servicer, self._loop_thread, timeout_s)

    async def _leave_registry(self) -> None:
        if self._presence is not None:
            presence, self._presence = self._presence, None
            await presence.stop()

    async def stop(self, grace_s: float = 1.0) -> None:
        await self._leave_registry()
        if self._server is not None:
            await self._server.stop(grace_s)
        if self._loop_thread is not None:
            self._loop_thread.stop()
            self._loop_thread.join(timeout=10)
        if self._transfer_side is not None:
            self._transfer_side.close()
        if self.engine is not None:
            self.engine.shutdown()  # the tensor-parallel ranks and the KV tiers' I/O, if any
        if self._metrics is not None:
            self._metrics.close()


def _advertised_host(config: WorkerConfig) -> str:
    if config.advertise_host:
        return config.advertise_host
    if config.host in ("0.0.0.0", "::"):
        return config.kv_transfer.public_host
    return config.host


def worker_names(address: str, config: WorkerConfig, port: int) -> tuple[str, ...]:
    """The ``host:port`` names a router may dial this worker by, which its cluster tokens must name:
    the advertised address, the bound one, the loopback aliases of a loopback one, and `auth_names`."""
    hosts = [address.rsplit(":", 1)[0], config.host, *config.auth_names]
    if any(h in LOOPBACK_HOSTS for h in hosts):
        hosts += LOOPBACK_HOSTS
    names = (f"[{h}]:{port}" if ":" in h else f"{h}:{port}" for h in hosts if h not in ("0.0.0.0", "::"))
    return tuple(dict.fromkeys([address, *names]))


def run_worker(config: WorkerConfig, role: WorkerRole) -> int:
    """Process entry point: serve `role` until SIGTERM/SIGINT, then drain and exit."""
    return run_until_signalled(WorkerServer(config, role), lambda address: f"ready: {config.role} worker at {address}")
