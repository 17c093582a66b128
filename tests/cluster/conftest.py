"""One cluster of real processes for the module: 2 prefill + 2 decode workers, two routers over them."""
from __future__ import annotations

import pytest

from loadtest.chaos.processes import stop_all
from tests.cluster.harness import free_port, start_router, start_workers


@pytest.fixture(scope="package")
def workers(smollm2_dir):
    started = start_workers(["prefill", "prefill", "decode", "decode"])
    try:
        yield {"prefill": started[:2], "decode": started[2:]}
    finally:
        stop_all(started)


@pytest.fixture(scope="package")
def router_1p1d(workers):
    proc = start_router(workers["prefill"][:1], workers["decode"][:1])
    yield proc
    proc.stop()


@pytest.fixture(scope="package")
def router_2p2d(workers):
    port = free_port()
    proc = start_router(workers["prefill"], workers["decode"], "--metrics-port", str(port))
    proc.metrics_url = f"http://127.0.0.1:{port}/metrics"
    yield proc
    proc.stop()


@pytest.fixture(scope="package")
def http_router(workers):
    """A router over one prefill and one decode worker, serving gRPC and the OpenAI HTTP API."""
    port = free_port()
    proc = start_router(workers["prefill"][:1], workers["decode"][:1], "--http-port", str(port))
    proc.http_url = f"http://127.0.0.1:{port}"
    yield proc
    proc.stop()
