"""KvFeeds reading a worker's KV event stream from a real Redis: gaps resync, outages are survived.

The worker side is a fake stub answering GetKvSnapshot (the real worker's
snapshot is tested through the cluster tests); the batches are written to
Redis exactly as worker_runtime/redis_presence.py writes them.
"""
import asyncio
import time

import pytest

from common import redis_client, redis_keys
from common.cluster_auth import events as cluster_events
from common.protocol import kv_events_to_proto, worker_pb2
from engine.block_hash import hash_full_blocks
from engine.kv_events import BlockRemoved, BlockStored
from router.kv_feeds import KvFeeds
from router.kv_index import KvIndex
from router.worker_pool import WorkerClient
from tests.cluster.harness import free_port
from tests.redis_server import RedisServer

ADDRESS, EPOCH = "10.0.0.1:7000", 42
HASHES = hash_full_blocks(list(range(64)), 16)  # 4 blocks


class FakeWorkerStub:
    """Answers GetKvSnapshot with whatever the test says the worker holds."""

    def __init__(self) -> None:
        self.seq, self.hashes, self.calls = 0, [], 0

    async def GetKvSnapshot(self, request, timeout=None):
        self.calls += 1
        return worker_pb2.KvEventBatch(seq=self.seq, epoch=EPOCH, snapshot=True, events=kv_events_to_proto(
            [BlockStored(h) for h in self.hashes]))


async def publish(client, seq: int, events, key: bytes | None = None, signature: bytes | None = None) -> None:
    """Write batch `seq` as a worker does (signed with `key`), or with the given `signature`."""
    batch = worker_pb2.KvEventBatch(worker=ADDRESS, seq=seq, epoch=EPOCH, events=kv_events_to_proto(events))
    stream, data = redis_keys.kv_events_key(ADDRESS, EPOCH), batch.SerializeToString()
    fields = {redis_keys.BATCH_FIELD: data}
    if key is not None:
        fields[redis_keys.SIGNATURE_FIELD] = cluster_events.sign(key, stream, data)
    if signature is not None:
        fields[redis_keys.SIGNATURE_FIELD] = signature
    await client.xadd(stream, fields, id=redis_keys.stream_id(seq))


async def until(predicate, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError("condition not met in time")
        await asyncio.sleep(0.02)


@pytest.fixture
def redis_server():
    server = RedisServer(free_port()).start()
    yield server
    server.stop()


def test_gap_resyncs_from_snapshot_and_redis_restart_is_survived(redis_server):
    async def scenario():
        client = redis_client.connect(redis_server.url, timeout_s=5)
        index, stub = KvIndex(), FakeWorkerStub()
        stub.seq, stub.hashes = 2, HASHES[:2]
        worker = WorkerClient(ADDRESS, "prefill", stub=stub)
        feeds = KvFeeds(index, client)
        feeds.start(worker)
        overlap = lambda: index.overlap(HASHES, [ADDRESS])[ADDRESS]  # noqa: E731
        try:
            # 1. First sync from the snapshot, then batches in order.
            await until(lambda: index.is_synced(ADDRESS) and index.seq(ADDRESS) == 2)
            assert overlap() == 2 and stub.calls == 1
            await publish(client, 3, [BlockStored(HASHES[2], HASHES[1])])
            await until(lambda: index.seq(ADDRESS) == 3)
            assert overlap() == 3 and stub.calls == 1
            # 2. Batch 4 is lost: batch 5 triggers a resync from the worker's snapshot.
            stub.seq, stub.hashes = 5, HASHES
            await publish(client, 5, [BlockStored(HASHES[3], HASHES[2])])
            await until(lambda: stub.calls == 2 and index.is_synced(ADDRESS))
            assert index.seq(ADDRESS) == 5 and overlap() == 4 and index.num_resyncs == 2
            await publish(client, 6, [BlockRemoved(HASHES[0])])
            await until(lambda: index.seq(ADDRESS) == 6)
            assert overlap() == 0 and stub.calls == 2
            # 3. Redis goes away: the index keeps its view and the feed keeps trying.
            redis_server.stop()
            await asyncio.sleep(1.5)
            assert index.is_synced(ADDRESS) and index.seq(ADDRESS) == 6
            # 4. It comes back empty. The worker's batch 7 was lost meanwhile; batch 8 shows the gap.
            redis_server.start()
            stub.seq, stub.hashes = 8, HASHES[:1]
            await publish(client, 8, [BlockStored(HASHES[0])])
            await until(lambda: stub.calls == 3 and index.is_synced(ADDRESS) and index.seq(ADDRESS) == 8, 15)
            assert overlap() == 1
            await publish(client, 9, [BlockStored(HASHES[1], HASHES[0])])
            await until(lambda: index.seq(ADDRESS) == 9)
            assert overlap() == 2 and stub.calls == 3
        finally:
            await feeds.close()
            await redis_client.close(client)
    asyncio.run(scenario())


def test_with_the_cluster_secret_only_signed_batches_are_applied(redis_server):
    key, wrong = b"e" * 32, b"w" * 32

    async def scenario():
        client = redis_client.connect(redis_server.url, timeout_s=5)
        index, stub = KvIndex(), FakeWorkerStub()
        stub.seq, stub.hashes = 1, HASHES[:1]
        feeds = KvFeeds(index, client, events_key=key)
        feeds.start(WorkerClient(ADDRESS, "prefill", stub=stub))
        overlap = lambda: index.overlap(HASHES, [ADDRESS])[ADDRESS]  # noqa: E731
        try:
            await until(lambda: index.is_synced(ADDRESS) and index.seq(ADDRESS) == 1)
            await publish(client, 2, [BlockStored(HASHES[1], HASHES[0])], key=key)  # the worker's own
            await until(lambda: index.seq(ADDRESS) == 2)
            assert overlap() == 2 and stub.calls == 1
            # someone with write access to Redis: unsigned, signed with another key, or a valid
            # signature copied from another batch. None is applied; each makes the feed resync.
            for seq, signature in ((3, None), (4, cluster_events.sign(wrong, "x", b"")), (5, b"0" * 64)):
                stub.seq, stub.hashes = seq - 1, HASHES[:2]
                forged = feeds.num_forged
                await publish(client, seq, [BlockRemoved(HASHES[0])], signature=signature)
                await until(lambda f=forged: feeds.num_forged == f + 1)
                await until(lambda s=seq: index.is_synced(ADDRESS) and index.seq(ADDRESS) == s - 1)
                assert overlap() == 2  # block 0 is still indexed: the false removal was not applied
            assert stub.calls == 4
        finally:
            await feeds.close()
            await redis_client.close(client)
    asyncio.run(scenario())
