"""One cluster of real processes for the chaos scenarios: redis-server, 2 prefill + 3 decode workers
(registered in Redis, drain timeout 1 s) and four routers over them:

- `router`: migrates broken streams (stream timeout 4 s), metrics on;
- `no_migration`: the same with --max-migrations 0 (what callers saw before migration);
- `redis_router`: finds the workers through Redis only (no addresses on its command line);
- `front`: gRPC + OpenAI HTTP over 2 prefill + 2 decode (the storm and the fuzzer).

A scenario may kill, stop or drain workers; after each one (modules mark their tests with the
`workers_restored` fixture) every worker is brought back (restarted on its port, as a kubelet would)
and back in rotation before the next, so scenarios stay independent."""
from __future__ import annotations

import signal
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

from loadtest.chaos.faults import wait_back
from loadtest.chaos.processes import stop_all
from tests.cluster.harness import WORKER_FLAGS, free_port, metric_value, start, start_router, start_workers
from tests.redis_server import RedisServer

STREAM_TIMEOUT_S = 4


def router_with_metrics(prefill, decode, *extra):
    port = free_port()
    proc = start_router(prefill, decode, "--metrics-port", str(port), *extra)
    proc.metrics_url = f"http://127.0.0.1:{port}/metrics"
    return proc


@pytest.fixture(scope="package")
def chaos_cluster(smollm2_dir, tmp_path_factory):
    from common.cluster_auth import write_secret_file
    redis_server = RedisServer(free_port()).start()
    secret = write_secret_file(str(tmp_path_factory.mktemp("chaos-secret")))
    auth = ["--cluster-secret-file", secret]
    registry = ["--redis-url", redis_server.url, "--registry-ttl-s", "2"]
    procs = []
    try:
        workers = start_workers(["prefill", "prefill", "decode", "decode", "decode"], "--drain-timeout-s", "1", *auth,
                                *registry)
        procs += workers
        prefill, decode = workers[:2], workers[2:]
        migrating = ["--stream-timeout-s", str(STREAM_TIMEOUT_S), *auth]
        http_port = free_port()
        jobs = {
            "router": lambda: router_with_metrics(prefill, decode, *migrating),
            "no_migration": lambda: router_with_metrics(prefill, decode, *migrating, "--max-migrations", "0"),
            "redis_router": lambda: _redis_router(registry, auth),
            "front": lambda: router_with_metrics(prefill, decode[:2], *migrating, "--http-port", str(http_port)),
        }
        with ThreadPoolExecutor(4) as pool:
            routers = dict(zip(jobs, pool.map(lambda job: job(), jobs.values()), strict=True))
        procs += routers.values()
        routers["front"].http_url = f"http://127.0.0.1:{http_port}"
        cluster = {"prefill": prefill, "decode": decode, "redis": redis_server, "secret": secret, **routers}
        wait_in_rotation(cluster)
        yield cluster
    finally:
        stop_all(procs)
        redis_server.stop()


def _redis_router(registry, auth):
    port = free_port()
    proc = start("redis-router", ["router", "--port", "0", "--health-interval-s", "0.5", "--metrics-port",
                                  str(port), "--route-metadata", *registry, *auth])
    proc.metrics_url = f"http://127.0.0.1:{port}/metrics"
    return proc


def wait_in_rotation(cluster, timeout: float = 60) -> None:
    """Every worker is healthy in every router that is given it."""
    for name in ("router", "no_migration", "redis_router", "front"):
        router = cluster[name]
        workers = cluster["prefill"] + (cluster["decode"][:2] if name == "front" else cluster["decode"])
        for w in workers:
            assert wait_back(lambda r=router, w=w: metric_value(r.metrics_url, "pdserve:worker_healthy",
                                                                worker=w.address) == 1.0, timeout), \
                f"{w.address} is not back in {name}'s rotation"


@pytest.fixture
def workers_restored(chaos_cluster):
    """After each scenario: stopped workers continued, dead ones restarted on their port, all in rotation."""
    yield
    for w in chaos_cluster["prefill"] + chaos_cluster["decode"]:
        w.send(signal.SIGCONT)
        if not w.alive:
            w.restart()
    wait_in_rotation(chaos_cluster)


@pytest.fixture(scope="package")
def offline_engine(smollm2_dir):
    """The offline engine, configured as the workers are: the reference every output must equal."""
    from engine.config import CacheConfig, EngineConfig, SchedulerConfig
    from engine.llm_engine import LLMEngine
    flags = dict(zip(WORKER_FLAGS[::2], WORKER_FLAGS[1::2], strict=True))
    return LLMEngine(EngineConfig(model=str(smollm2_dir), dtype=flags["--dtype"],
                                  cache=CacheConfig(kv_cache_memory_bytes=256 << 20),
                                  scheduler=SchedulerConfig(max_num_batched_tokens=512)))


def settle(seconds: float = 0.5) -> None:
    time.sleep(seconds)
