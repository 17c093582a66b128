"""TLS on a real router's public fronts: plaintext refused, and a replaced certificate served to
new connections without a restart (what cert-manager renewals and Secret updates rely on)."""
from __future__ import annotations

import os
import shutil
import ssl
import time
import urllib.error
import urllib.request

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from tests.cluster.harness import free_port, start
from tests.tls_certs import make_tls_files


def grpc_health(address: str, ca: str) -> int:
    with open(ca, "rb") as f:
        credentials = grpc.ssl_channel_credentials(root_certificates=f.read())
    with grpc.secure_channel(address, credentials) as channel:
        return health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=5).status


def https_health(url: str, ca: str) -> int:
    context = ssl.create_default_context(cafile=ca)
    with urllib.request.urlopen(url + "/health", timeout=5, context=context) as response:
        return response.status


def install(source, live_dir) -> None:
    """Replace the live files the way a Secret update does: new files moved into place."""
    for name, target in ((source.key, "key.pem"), (source.cert, "cert.pem")):
        shutil.copy(name, live_dir / f".{target}.new")
        os.replace(live_dir / f".{target}.new", live_dir / target)


def test_tls_fronts_refuse_plaintext_and_pick_up_a_new_certificate(tmp_path):
    (tmp_path / "first").mkdir()
    (tmp_path / "second").mkdir()
    first, second = make_tls_files(tmp_path / "first"), make_tls_files(tmp_path / "second")
    live = tmp_path / "live"
    live.mkdir()
    install(first, live)
    http_port = free_port()
    router = start("router", ["router", "--port", "0", "--http-port", str(http_port),
                              "--tls-cert-file", str(live / "cert.pem"), "--tls-key-file", str(live / "key.pem")])
    url = f"https://127.0.0.1:{http_port}"
    try:
        assert "OpenAI API at https://" in "".join(router.output)
        assert grpc_health(router.address, first.ca) == health_pb2.HealthCheckResponse.SERVING
        assert https_health(url, first.ca) == 200
        with grpc.insecure_channel(router.address) as channel, pytest.raises(grpc.RpcError):
            health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=5)
        with pytest.raises((urllib.error.URLError, ConnectionError)):
            urllib.request.urlopen(url.replace("https", "http") + "/health", timeout=5)
        with pytest.raises(grpc.RpcError):  # a client trusting another CA
            grpc_health(router.address, second.ca)

        install(second, live)
        deadline = time.monotonic() + 30
        while True:
            try:
                assert grpc_health(router.address, second.ca) == health_pb2.HealthCheckResponse.SERVING
                assert https_health(url, second.ca) == 200
                break
            except (grpc.RpcError, urllib.error.URLError, ConnectionError):
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.5)
        with pytest.raises(grpc.RpcError):
            grpc_health(router.address, first.ca)
        with pytest.raises(urllib.error.URLError):
            https_health(url, first.ca)
    finally:
        router.stop()


def test_a_router_bound_beyond_loopback_without_keys_or_tls_warns():
    router = start("router", ["router", "--host", "0.0.0.0", "--port", "0"])
    try:
        output = "".join(router.output)
        assert "without API keys" in output and "without TLS" in output
    finally:
        router.stop()
    loopback = start("router", ["router", "--port", "0"])
    try:
        assert "without API keys" not in "".join(loopback.output)
    finally:
        loopback.stop()
