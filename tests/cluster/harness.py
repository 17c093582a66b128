"""Start pdserve processes the way an operator would (`pdserve prefill-worker` ...), for tests."""
from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field

import grpc

from pdserve.protocol import generate_pb2_grpc, worker_pb2, worker_pb2_grpc

READY = re.compile(r"ready: .*? at (\S+)")
WORKER_FLAGS = ["--model", "default", "--dtype", "float32", "--kv-cache-memory-gib", "0.25", "--num-threads", "1",
                "--max-num-batched-tokens", "512"]


@dataclass
class Proc:
    name: str
    popen: subprocess.Popen
    address: str = ""
    output: list[str] = field(default_factory=list)

    def kill(self) -> None:
        if self.popen.poll() is None:
            self.popen.kill()
            self.popen.wait(10)

    def stop(self, sig=signal.SIGTERM, timeout: float = 30) -> int:
        if self.popen.poll() is None:
            self.popen.send_signal(sig)
            try:
                self.popen.wait(timeout)
            except subprocess.TimeoutExpired:
                self.popen.kill()
                self.popen.wait(10)
        return self.popen.returncode


def start(name: str, args: list[str], timeout: float = 600) -> Proc:
    """Run `pdserve ARGS` and wait for its `ready: ... at ADDRESS` line."""
    popen = subprocess.Popen([sys.executable, "-m", "pdserve.cli", *args], stdout=subprocess.PIPE,
                             stderr=subprocess.STDOUT, text=True, env=dict(os.environ, PYTHONUNBUFFERED="1"))
    proc = Proc(name, popen)
    found = threading.Event()

    def pump() -> None:
        for line in popen.stdout:
            proc.output.append(line)
            match = READY.search(line)
            if match and not found.is_set():
                proc.address = match.group(1)
                found.set()
        found.set()

    threading.Thread(target=pump, daemon=True).start()
    found.wait(timeout)
    if not proc.address:
        proc.kill()
        raise RuntimeError(f"{name} did not become ready:\n{''.join(proc.output[-40:])}")
    return proc


def start_worker(role: str, *extra: str) -> Proc:
    return start(f"{role}-worker", [f"{role}-worker", *WORKER_FLAGS, *extra])


def start_router(prefill: list[Proc], decode: list[Proc], *extra: str, route_metadata: bool = True) -> Proc:
    """A router over the workers; with `route_metadata` tests can see where samples went (`generate_routed`)."""
    return start("router", ["router", "--port", "0", "--health-interval-s", "0.5",
                            *(["--route-metadata"] if route_metadata else []),
                            "--prefill-workers", ",".join(p.address for p in prefill),
                            "--decode-workers", ",".join(d.address for d in decode), *extra])


def generation_stub(address: str):
    return generate_pb2_grpc.GenerationStub(grpc.insecure_channel(address))


def worker_stats(address: str, secret_file: str | None = None) -> worker_pb2.WorkerStats:
    """GetStats of a worker; with the cluster secret's file, carrying a cluster token."""
    metadata = None
    if secret_file is not None:
        from pdserve.cluster_auth import ClusterAuthConfig, tokens
        from pdserve.cluster_auth.grpc_auth import METADATA_KEY
        key = ClusterAuthConfig(secret_file).load().grpc
        metadata = [(METADATA_KEY, tokens.mint(key, "/pdserve.v1.Worker/GetStats"))]
    with grpc.insecure_channel(address) as channel:
        return worker_pb2_grpc.WorkerStub(channel).GetStats(worker_pb2.StatsRequest(), timeout=10, metadata=metadata)


def assert_no_leaks(workers: list[Proc], timeout: float = 20.0, secret_file: str | None = None) -> None:
    """Every worker ends with no KV blocks in use, no request held and no KV lease (waits for aborts to land)."""
    deadline = time.monotonic() + timeout
    while True:
        stats = {w.address: worker_stats(w.address, secret_file) for w in workers if w.popen.poll() is None}
        busy = {a: (s.kv_blocks_used, s.num_requests, s.num_leases) for a, s in stats.items()
                if s.kv_blocks_used or s.num_requests or s.num_leases}
        if not busy:
            return
        if time.monotonic() > deadline:
            raise AssertionError(f"workers still hold (blocks, requests, leases): {busy}")
        time.sleep(0.2)


def free_port() -> int:
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def metric_value(url: str, name: str, **labels: str) -> float | None:
    """One sample of a Prometheus text endpoint, or None."""
    import urllib.request
    text = urllib.request.urlopen(url, timeout=10).read().decode()
    for line in text.splitlines():
        if not line.startswith(name + "{") and not line.startswith(name + " "):
            continue
        if all(f'{k}="{v}"' in line for k, v in labels.items()):
            return float(line.rsplit(" ", 1)[1])
    return None


def generate_routed(router: Proc, token_ids: list[int], max_tokens: int = 4, request_id: str = "") -> dict:
    """One greedy request; its tokens, cached tokens and the workers the router chose (trailing metadata)."""
    import uuid

    from engine.sampling_params import SamplingParams
    from pdserve.client import build_request
    call = generation_stub(router.address).Generate(
        build_request(request_id or uuid.uuid4().hex, SamplingParams(max_tokens=max_tokens, temperature=0.0),
                      token_ids=token_ids), timeout=120)
    messages = list(call)
    meta = dict(call.trailing_metadata())
    return {"prefill": meta["pdserve-prefill-worker"], "decode": meta["pdserve-decode-worker"],
            "cached": messages[-1].complete.usage.cached_tokens,
            "tokens": [t for m in messages if m.HasField("chunk") for t in m.chunk.token_ids]}
