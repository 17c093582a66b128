"""Names of the Redis keys workers and routers share (one definition for both sides).

- `pdserve:worker:<host:port>`: a hash (role, address, epoch, events) written by the
  worker every heartbeat with a TTL; it disappears when heartbeats stop.
- `pdserve:kv_events:<host:port>:<epoch>`: a stream of the worker's KV event batches;
  entry id `<seq>-1` carries batch `seq` (field `batch`: a serialized KvEventBatch),
  so a reader that has applied batch S reads on after id `<S>-1`.
"""
from __future__ import annotations

PREFIX = "pdserve"
WORKER_PATTERN = f"{PREFIX}:worker:*"
BATCH_FIELD = b"batch"
SIGNATURE_FIELD = b"sig"
"""HMAC of the batch under the cluster secret (see common/cluster_auth/events.py); absent without one."""


def worker_key(address: str) -> str:
    return f"{PREFIX}:worker:{address}"


def kv_events_key(address: str, epoch: int) -> str:
    return f"{PREFIX}:kv_events:{address}:{epoch}"


def stream_id(seq: int) -> str:
    """Stream entry id of batch `seq` (reading after it yields batch seq+1 onwards)."""
    return f"{seq}-1"
