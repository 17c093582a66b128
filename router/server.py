"""The router process: worker pool + pipeline + request runner, fronted by the gRPC Generation service
(+ the OpenAI-compatible HTTP API, + metrics)."""
from __future__ import annotations

import asyncio
import logging
import time

from common.grpc_common import add_health_and_reflection, new_server, run_until_signalled, set_serving
from common.protocol import generate_pb2, generate_pb2_grpc
from router.admission import AdmissionQueue
from router.auth import ApiKeys
from router.config import RouterConfig
from router.front_security import warn_if_exposed
from router.kv_feeds import KvFeeds
from router.kv_index import KvIndex
from router.metrics import RouterMetrics
from router.openai.app import create_app
from router.openai.server import HttpServer
from router.pipeline import GenerationPipeline
from router.request_builder import RequestBuilder
from router.requests import RequestRunner
from router.routing_metrics import RoutingMetrics
from router.routing_policy import RoutingPolicy
from router.service import GenerationServicer
from router.tls_reload import CertificateFiles
from router.worker_pool import WorkerPool
from router.worker_selector import WorkerSelector

logger = logging.getLogger(__name__)
SERVICE = generate_pb2.DESCRIPTOR.services_by_name["Generation"].full_name


class WorkersUnreachable(RuntimeError):
    """A router told to wait for its workers could not reach every one of them."""


class RouterServer:
    def __init__(self, config: RouterConfig) -> None:
        self.config = config
        self.address = ""
        keys = config.cluster_auth.load()
        self.pool = WorkerPool(config.prefill_workers, config.decode_workers, config.health_interval_s,
                               keys.grpc if keys else None,
                               config.worker_tls.channel_credentials() if config.worker_tls.enabled else None,
                               config.worker_tls.channel_options())
        self.metrics = RouterMetrics(self.pool)
        self.index = KvIndex()
        self.admission = AdmissionQueue(config.max_queue_len, config.queue_timeout_s, config.retry_after_s)
        self.routing_metrics = RoutingMetrics(self.metrics.registry, self.index, lambda: self.admission.num_waiting)
        self.selector = WorkerSelector(self.pool, self.index, RoutingPolicy(config.routing_policy,
                                                                            config.routing_weights),
                                       self.admission, config.skip_prefill_tokens, self.routing_metrics,
                                       config.link_aware_prefill, config.peer_pulls)
        self.pipeline = GenerationPipeline(config, self.selector,
                                           on_migration=lambda reason: self.metrics.migrations.labels(reason).inc())
        self.keys = ApiKeys(config.security.api_key_file)
        self.pipeline.handle_key = keys.handle if keys else None
        self._events_key = keys.events if keys else None
        self._registry_key = keys.registry if keys else None
        self._redis = None
        self._feeds: KvFeeds | None = None
        self._registry = None
        self._server = None
        self._health = None
        self.runner: RequestRunner | None = None
        self.http_port: int | None = None
        self._http = None
        self._metrics_server = None
        self._certs: CertificateFiles | None = None
        self._cert_watch: asyncio.Task | None = None

    async def start(self, wait_for_workers_s: float = 0.0) -> str:
        config = self.config
        loop = asyncio.get_running_loop()
        builder = await loop.run_in_executor(None, lambda: RequestBuilder(
            config.model, config.max_model_len, config.max_n, config.max_prompt_chars))
        if config.redis_url:
            from common import redis_client
            self._redis = redis_client.connect(config.redis_url, timeout_s=5,
                                               password_file=config.redis_password_file)
        self._feeds = KvFeeds(self.index, self._redis, self._events_key)
        self.pool.on_add.append(self._feeds.start)
        self.pool.on_remove.append(self._feeds.stop)
        await self.pool.start()
        if self._redis is not None:
            from router.registry import RedisRegistry
            self._registry = RedisRegistry(self._redis, self.pool, config.health_interval_s, config.registry_ttl_s,
                                           self._registry_key)
            await self._registry.start()
        if wait_for_workers_s and not await self.pool.wait_healthy(wait_for_workers_s):
            unreachable = [w.address for w in self.pool.workers if not w.healthy]
            await self.stop()
            raise WorkersUnreachable(f"workers not healthy through the addresses they advertise after "
                                     f"{wait_for_workers_s:.0f}s: {', '.join(unreachable)}")
        self.runner = RequestRunner(builder, self.pipeline, self.metrics)
        self._server = new_server(max_receive_bytes=config.max_request_bytes)
        generate_pb2_grpc.add_GenerationServicer_to_server(
            GenerationServicer(self.runner, self.keys, config.route_metadata), self._server)
        self._health = add_health_and_reflection(self._server, [SERVICE])
        warn_if_exposed(config.host, config.security, self.keys)
        bind = f"{config.host}:{config.port}"
        if config.security.tls:
            self._certs = CertificateFiles(config.security.tls_cert_file, config.security.tls_key_file)
            port = self._server.add_secure_port(bind, self._certs.grpc_credentials())
        else:
            port = self._server.add_insecure_port(bind)
        if port == 0:
            raise OSError(f"cannot bind {config.host}:{config.port}")
        self.address = f"{config.host}:{port}"
        await self._server.start()
        if config.http_port is not None:
            self._http = HttpServer(create_app(self.runner, config.model, config.max_request_bytes, self.keys,
                                               config.tool_call_parser),
                                    config.host, config.http_port, config.security.tls_cert_file,
                                    config.security.tls_key_file, config.http_limits)
            self.http_port = await self._http.start()
            if self._certs is not None:
                self._cert_watch = asyncio.create_task(self._certs.watch_http(self._http.ssl_context))
        if config.metrics_port is not None:
            self._metrics_server = self.metrics.serve(config.host, config.metrics_port)
        await set_serving(self._health, [SERVICE], True)
        return self.address

    async def drain(self, timeout_s: float | None = None) -> None:
        timeout_s = self.config.drain_timeout_s if timeout_s is None else timeout_s
        self.runner.draining = True
        await set_serving(self._health, [SERVICE], False)
        deadline = time.monotonic() + timeout_s
        while self.runner.num_running and time.monotonic() < deadline:
            await asyncio.sleep(0.05)

    async def stop(self, grace_s: float = 1.0) -> None:
        if self._cert_watch is not None:
            self._cert_watch.cancel()
        if self._http is not None:
            await self._http.stop(grace_s)
        if self._server is not None:
            await self._server.stop(grace_s)
        await self.pipeline.wait_background()
        if self._registry is not None:
            await self._registry.close()
        await self.pool.close()
        if self._feeds is not None:
            await self._feeds.close()
        if self._redis is not None:
            from common import redis_client
            await redis_client.close(self._redis)
        if self._metrics_server is not None:
            self._metrics_server.close()


def run_router(config: RouterConfig) -> int:
    """Process entry point: serve until SIGTERM/SIGINT, then drain and exit."""
    router = RouterServer(config)

    def ready_line(address: str) -> str:
        scheme = "https" if config.security.tls else "http"
        http = (f" (OpenAI API at {scheme}://{config.host}:{router.http_port}/v1)"
                if router.http_port is not None else "")
        return f"ready: router at {address}{http}"

    return run_until_signalled(router, ready_line)
