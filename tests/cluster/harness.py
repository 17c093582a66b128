"""Start pdserve processes the way an operator would (`pdserve prefill-worker` ...), for tests."""
from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import grpc

from common.protocol import generate_pb2_grpc
from loadtest.chaos.leaks import wait_until_idle, worker_stats  # noqa: F401 - worker_stats is used by tests
from loadtest.chaos.processes import ManagedProcess, stop_all

WORKER_FLAGS = ["--model", "default", "--dtype", "float32", "--kv-cache-memory-gib", "0.25", "--num-threads", "1",
                "--max-num-batched-tokens", "512"]
Proc = ManagedProcess


def start(name: str, args: list[str], timeout: float = 600) -> Proc:
    """Run `pdserve ARGS` and wait for its `ready: ... at ADDRESS` line."""
    return ManagedProcess(name, args).start(timeout)


def start_worker(role: str, *extra: str) -> Proc:
    return start(f"{role}-worker", [f"{role}-worker", *WORKER_FLAGS, *extra])


def start_workers(roles: list[str | list[str]], *extra: str) -> list[Proc]:
    """Several workers started side by side (each loads the model; ~7 s apiece one after another): each
    entry a role, or a role and its own flags; `extra` goes to all. If one fails to start, those that
    did are stopped before the error is raised."""
    specs = [[role] if isinstance(role, str) else role for role in roles]
    with ThreadPoolExecutor(len(specs)) as pool:
        futures = [pool.submit(start_worker, spec[0], *spec[1:], *extra) for spec in specs]
    failed = [f.exception() for f in futures if f.exception() is not None]
    if failed:
        stop_all(f.result() for f in futures if f.exception() is None)
        raise failed[0]
    return [f.result() for f in futures]


def start_router(prefill: list[Proc], decode: list[Proc], *extra: str, route_metadata: bool = True) -> Proc:
    """A router over the workers; with `route_metadata` tests can see where samples went (`generate_routed`)."""
    return start("router", ["router", "--port", "0", "--health-interval-s", "0.5",
                            *(["--route-metadata"] if route_metadata else []),
                            "--prefill-workers", ",".join(p.address for p in prefill),
                            "--decode-workers", ",".join(d.address for d in decode), *extra])


def start_cluster(roles: list[str | list[str]], *extra: str, router_flags: tuple[str, ...] = (),
                  route_metadata: bool = True, timeout: float = 60) -> list[Proc]:
    """Workers (as `start_workers`) and a router over them, all started side by side: each worker on a port
    chosen here, the router dialling those ports from the start; returns once the router sees every worker
    healthy. [*prefill, *decode, router] in the order of `roles`; the router has `metrics_url`. Saves the
    router's start-up (~5 s, torch imported for its tokenizer) after the workers'."""
    import time
    specs = [[role] if isinstance(role, str) else list(role) for role in roles]
    specs = [spec[:1] + spec[1:] + ["--port", str(free_port())] for spec in specs]
    addresses = {role: [f"127.0.0.1:{s[-1]}" for s in specs if s[0] == role] for role in ("prefill", "decode")}
    metrics_port = free_port()
    router_args = ["router", "--port", "0", "--health-interval-s", "0.5", "--metrics-port", str(metrics_port),
                   *(["--route-metadata"] if route_metadata else []),
                   "--prefill-workers", ",".join(addresses["prefill"]),
                   "--decode-workers", ",".join(addresses["decode"]), *router_flags]
    with ThreadPoolExecutor(len(specs) + 1) as pool:
        futures = [pool.submit(start_worker, spec[0], *spec[1:], *extra) for spec in specs]
        futures.append(pool.submit(start, "router", router_args))
    failed = [f.exception() for f in futures if f.exception() is not None]
    started = [f.result() for f in futures if f.exception() is None]
    if failed:
        stop_all(started)
        raise failed[0]
    router = started[-1]
    router.metrics_url = f"http://127.0.0.1:{metrics_port}/metrics"
    workers = [w for role in ("prefill", "decode") for w, s in zip(started, specs, strict=False) if s[0] == role]

    def all_healthy() -> bool:
        try:
            return all(metric_value(router.metrics_url, "pdserve:worker_healthy", worker=address) == 1.0
                       for address in addresses["prefill"] + addresses["decode"])
        except OSError:
            return False

    deadline = time.monotonic() + timeout
    while not all_healthy():
        if time.monotonic() > deadline:
            stop_all(started)
            raise RuntimeError("the router did not see every worker healthy")
        time.sleep(0.1)
    return [*workers, router]


def generation_stub(address: str):
    return generate_pb2_grpc.GenerationStub(grpc.insecure_channel(address))


def assert_no_leaks(workers: list[Proc], timeout: float = 20.0, secret_file: str | None = None) -> None:
    """Every live worker ends with no KV blocks in use, no request held and no KV lease (waits for aborts)."""
    busy = wait_until_idle([w.address for w in workers if w.alive], timeout, secret_file)
    assert not busy, f"workers still hold (blocks, requests, leases): {busy}"


XDIST_PORTS_BASE, XDIST_PORTS_PER_WORKER = 20000, 3000
"""Under pytest-xdist each worker draws its ports from a range of its own: below the kernel's ephemeral
range (32768-60999, where bind(0) and outgoing connections land) and above Ray's worker ports (10002-19999),
so a port chosen here and bound a moment later by a process can be taken by nobody else. A worker does not
hand out a port twice in its first 1,500 (ports are often drawn several at a time, before any is bound)."""
_given_ports: set[int] = set()


def free_port() -> int:
    import os
    import random
    import socket
    worker = os.environ.get("PYTEST_XDIST_WORKER", "")
    for _ in range(200):
        if worker.startswith("gw"):
            low = XDIST_PORTS_BASE + int(worker[2:]) * XDIST_PORTS_PER_WORKER
            port = random.randrange(low, low + XDIST_PORTS_PER_WORKER)
            if port in _given_ports and len(_given_ports) < XDIST_PORTS_PER_WORKER // 2:
                continue
        else:
            port = 0
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            _given_ports.add(s.getsockname()[1])
            return s.getsockname()[1]
    raise RuntimeError(f"no free port in pytest worker {worker}'s range")


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

    from common.client import build_request
    from engine.sampling_params import SamplingParams
    call = generation_stub(router.address).Generate(
        build_request(request_id or uuid.uuid4().hex, SamplingParams(max_tokens=max_tokens, temperature=0.0),
                      token_ids=token_ids), timeout=120)
    messages = list(call)
    meta = dict(call.trailing_metadata())
    return {"prefill": meta["pdserve-prefill-worker"], "decode": meta["pdserve-decode-worker"],
            "cached": messages[-1].complete.usage.cached_tokens,
            "tokens": [t for m in messages if m.HasField("chunk") for t in m.chunk.token_ids]}


def grpc_samples(address: str, params, **prompt) -> list:
    """One Generate call over gRPC (build_request's prompt keywords); its samples."""
    import asyncio

    from common.client import build_request, generate_one
    from common.grpc_common import insecure_channel
    from common.protocol import generate_pb2_grpc

    async def run():
        async with insecure_channel(address) as channel:
            return await generate_one(generate_pb2_grpc.GenerationStub(channel),
                                      build_request("grpc-ref", params, **prompt), timeout=120)
    return asyncio.run(run())
