"""The leak check every chaos run and scenario ends with: each live worker holds no KV block,
no request and no KV lease once the traffic is over (aborts may take a moment to land)."""
from __future__ import annotations

import time

import grpc

from common.protocol import worker_pb2, worker_pb2_grpc


def worker_stats(address: str, secret_file: str | None = None, timeout: float = 10) -> worker_pb2.WorkerStats:
    """GetStats of a worker; with the cluster secret's file, the call carries a cluster token."""
    metadata = None
    if secret_file is not None:
        from common.cluster_auth import ClusterAuthConfig, tokens
        from common.cluster_auth.grpc_auth import METADATA_KEY
        key = ClusterAuthConfig(secret_file).load().grpc
        token = tokens.mint(key, "/pdserve.v1.Worker/GetStats", address, worker_pb2.StatsRequest().SerializeToString())
        metadata = [(METADATA_KEY, token)]
    with grpc.insecure_channel(address) as channel:
        return worker_pb2_grpc.WorkerStub(channel).GetStats(worker_pb2.StatsRequest(), timeout=timeout,
                                                             metadata=metadata)


def held(stats: worker_pb2.WorkerStats) -> tuple[int, int, int]:
    """(KV blocks used, requests, leases) a worker holds."""
    return stats.kv_blocks_used, stats.num_requests, stats.num_leases


def wait_until_idle(addresses: list[str], timeout: float = 20.0,
                    secret_file: str | None = None) -> dict[str, tuple[int, int, int]]:
    """Poll until no worker holds anything; what each still holds at `timeout` (empty: no leak)."""
    deadline = time.monotonic() + timeout
    while True:
        busy = {a: held(s) for a in addresses if any(held(s := worker_stats(a, secret_file)))}
        if not busy or time.monotonic() > deadline:
            return busy
        time.sleep(0.2)
