"""The Redis password from a file or $REDIS_PASSWORD, against a real redis-server with requirepass;
never on a command line (`pdserve router --redis-password-file`)."""
from __future__ import annotations

import asyncio
import time

import grpc
import pytest
import redis

from common import redis_client
from common.client import build_request
from engine.sampling_params import SamplingParams
from tests.cluster.harness import free_port, generation_stub, start, start_worker
from tests.redis_server import RedisServer
from worker_runtime.redis_presence import RedisPresence

PASSWORD = "s3cret-redis-password-0123"


@pytest.fixture(scope="module")
def protected_redis():
    server = RedisServer(free_port(), password=PASSWORD).start()
    yield server
    server.stop()


@pytest.fixture
def password_file(tmp_path):
    path = tmp_path / "redis-password"
    path.write_text(PASSWORD + "\n")
    return str(path)


def ping(url: str, **kwargs) -> bool:
    async def run() -> bool:
        client = redis_client.connect(url, timeout_s=5, **kwargs)
        try:
            return await client.ping()
        finally:
            await redis_client.close(client)
    return asyncio.run(run())


def test_a_password_from_a_file_or_the_environment_opens_a_protected_redis(protected_redis, password_file,
                                                                               monkeypatch):
    monkeypatch.delenv(redis_client.PASSWORD_ENV, raising=False)
    with pytest.raises(redis.AuthenticationError):
        ping(protected_redis.url)
    assert ping(protected_redis.url, password_file=password_file)
    monkeypatch.setenv(redis_client.PASSWORD_ENV, PASSWORD)
    assert ping(protected_redis.url)
    monkeypatch.setenv(redis_client.PASSWORD_ENV, "wrong")
    with pytest.raises(redis.AuthenticationError):
        ping(protected_redis.url)


def test_worker_presence_uses_the_password_file(protected_redis, password_file, monkeypatch):
    monkeypatch.delenv(redis_client.PASSWORD_ENV, raising=False)
    presence = RedisPresence(protected_redis.url, "127.0.0.1:1", "decode", None, 3.0, password_file)

    async def run() -> bool:
        try:
            return await presence.redis.ping()
        finally:
            await redis_client.close(presence.redis)
    assert asyncio.run(run())


def test_worker_and_router_meet_through_a_protected_redis_with_the_password_in_a_file(protected_redis,
                                                                                     password_file, tiny_qwen2_dir):
    registry = ["--redis-url", protected_redis.url, "--redis-password-file", password_file,
                "--registry-ttl-s", "2"]
    worker = start_worker("decode", *registry, "--model", str(tiny_qwen2_dir))
    router = None
    try:
        router = start("router", ["router", "--port", "0", "--health-interval-s", "0.5", *registry])
        for proc in (worker, router):
            with open(f"/proc/{proc.popen.pid}/cmdline", "rb") as f:
                assert PASSWORD.encode() not in f.read()
        stub = generation_stub(router.address)
        deadline = time.monotonic() + 30
        while True:  # the router learns of the worker from the registry only
            try:
                messages = list(stub.Generate(build_request("r", SamplingParams(max_tokens=2, temperature=0.0),
                                                            token_ids=[1, 2, 3]), timeout=60))
                break
            except grpc.RpcError as exc:
                if exc.code() != grpc.StatusCode.UNAVAILABLE or time.monotonic() > deadline:
                    raise
                time.sleep(0.5)
        assert messages[-1].complete.usage.completion_tokens == 2
    finally:
        if router is not None:
            router.stop()
        worker.stop()


def test_a_rediss_url_speaks_tls_to_a_real_redis(tmp_path, password_file, monkeypatch):
    """rediss:// with the server's CA in the URL (`?ssl_ca_certs=`), the password from a file."""
    import shutil
    import subprocess

    from tests.tls_certs import make_tls_files

    monkeypatch.delenv(redis_client.PASSWORD_ENV, raising=False)
    tls = make_tls_files(tmp_path)
    port = free_port()
    server = subprocess.Popen([shutil.which("redis-server"), "-", "--port", "0", "--tls-port", str(port),
                               "--bind", "127.0.0.1", "--save", "", "--tls-cert-file", tls.cert,
                               "--tls-key-file", tls.key, "--tls-ca-cert-file", tls.ca, "--tls-auth-clients", "no"],
                              stdin=subprocess.PIPE, stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT)
    server.stdin.write(f'requirepass "{PASSWORD}"\n'.encode())
    server.stdin.close()
    try:
        url = f"rediss://127.0.0.1:{port}/0?ssl_ca_certs={tls.ca}"
        deadline = time.monotonic() + 10
        while True:
            try:
                assert ping(url, password_file=password_file)
                break
            except redis.ConnectionError:
                if time.monotonic() > deadline or server.poll() is not None:
                    raise
                time.sleep(0.1)
        with pytest.raises(redis.AuthenticationError):
            ping(url)
        with pytest.raises(redis.ConnectionError):  # plaintext to the TLS port
            ping(f"redis://127.0.0.1:{port}/0", password_file=password_file)
    finally:
        server.terminate()
        server.wait(10)
