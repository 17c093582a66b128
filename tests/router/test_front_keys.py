"""API keys on a real router process (no workers needed): keys from $PDSERVE_API_KEYS, and keys
rotated by editing the key file while the router runs."""
from __future__ import annotations

import os
import time
import urllib.error
import urllib.request

import grpc
import pytest

from common.protocol import generate_pb2, generate_pb2_grpc
from tests.cluster.harness import free_port, start

OLD = "sk-old-0123456789abcdef"
NEW = "sk-new-0123456789abcdef"
ENV_KEY = "sk-env-0123456789abcdef"


def abort_status(address: str, key: str | None) -> str:
    """'ok' when Abort answered, else the status code's name."""
    metadata = (("authorization", f"Bearer {key}"),) if key else ()
    with grpc.insecure_channel(address) as channel:
        try:
            generate_pb2_grpc.GenerationStub(channel).Abort(generate_pb2.AbortRequest(request_id="x"),
                                                            metadata=metadata, timeout=10)
            return "ok"
        except grpc.RpcError as exc:
            return exc.code().name


def http_status(url: str, key: str | None) -> int:
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    try:
        with urllib.request.urlopen(urllib.request.Request(url, headers=headers), timeout=10) as response:
            return response.status
    except urllib.error.HTTPError as exc:
        return exc.code


def test_keys_from_the_environment_and_rotation_through_the_file(tmp_path, monkeypatch):
    key_file = tmp_path / "keys"
    key_file.write_text(f"team:{OLD}\n")
    monkeypatch.setenv("PDSERVE_API_KEYS", f"ops:{ENV_KEY}")
    http_port = free_port()
    router = start("router", ["router", "--port", "0", "--http-port", str(http_port),
                              "--api-key-file", str(key_file)])
    base = f"http://127.0.0.1:{http_port}"
    try:
        with open(f"/proc/{router.popen.pid}/cmdline", "rb") as f:
            cmdline = f.read()
        assert ENV_KEY.encode() not in cmdline and OLD.encode() not in cmdline
        assert abort_status(router.address, None) == "UNAUTHENTICATED"
        assert abort_status(router.address, ENV_KEY) == "ok"
        assert abort_status(router.address, OLD) == "ok"
        assert http_status(base + "/v1/models", None) == 401
        assert http_status(base + "/v1/models", ENV_KEY) == 200
        assert http_status(base + "/health", None) == 200

        # Rotation: both keys for a while, then the old one removed; no restart.
        key_file.write_text(f"team:{OLD}\nteam:{NEW}\n")
        os.utime(key_file, (time.time(), time.time() + 1))
        _eventually(lambda: abort_status(router.address, NEW) == "ok")
        assert abort_status(router.address, OLD) == "ok"
        key_file.write_text(f"team:{NEW}\n")
        os.utime(key_file, (time.time(), time.time() + 2))
        _eventually(lambda: abort_status(router.address, OLD) == "UNAUTHENTICATED")
        assert abort_status(router.address, NEW) == "ok"
        assert http_status(base + "/v1/models", OLD) == 401
        assert http_status(base + "/v1/models", NEW) == 200
        assert abort_status(router.address, ENV_KEY) == "ok"
    finally:
        router.stop()


def _eventually(check, timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not check():
        if time.monotonic() > deadline:
            pytest.fail("not within the reload interval")
        time.sleep(0.2)
