"""KV events with media across the wire: proto round trip (unknown media dropped), worker snapshots
listing offloaded blocks, and what the router's feed and its index gauge make of them."""
import asyncio

from prometheus_client import CollectorRegistry

from common.protocol import kv_events_from_proto, kv_events_to_proto, worker_pb2
from engine.kv_events import AllCleared, BlockRemoved, BlockStored
from router.kv_feeds import KvFeeds
from router.kv_index import KvIndex
from router.routing_metrics import RoutingMetrics
from worker_runtime.kv_event_log import KvEventLog


def test_round_trip_keeps_media_and_writes_device_as_empty():
    events = [BlockStored(11), BlockStored(12, 11, "cpu"), BlockStored(13, 12, "disk"), BlockRemoved(11),
              BlockRemoved(12, "cpu"), AllCleared()]
    messages = kv_events_to_proto(events)
    assert messages[0].stored.medium == "" and messages[3].removed.medium == ""  # as old workers write
    assert messages[1].stored.medium == "cpu" and messages[4].removed.medium == "cpu"
    wire = worker_pb2.KvEventBatch(events=messages).SerializeToString()
    assert kv_events_from_proto(worker_pb2.KvEventBatch.FromString(wire).events) == events


def test_an_unknown_medium_drops_that_event_only():
    messages = [worker_pb2.KvEvent(stored=worker_pb2.BlockStored(block_hash=1, medium="tape")),
                worker_pb2.KvEvent(stored=worker_pb2.BlockStored(block_hash=2, medium="cpu")),
                worker_pb2.KvEvent(removed=worker_pb2.BlockRemoved(block_hash=3, medium="nvme")),
                worker_pb2.KvEvent(removed=worker_pb2.BlockRemoved(block_hash=4))]
    assert kv_events_from_proto(messages) == [BlockStored(2, medium="cpu"), BlockRemoved(4, "device")]


class FakeEngine:
    """What KvEventLog uses of LLMEngine, with blocks offloaded to host memory and disk."""

    def __init__(self) -> None:
        self.offloaded = {"cpu": [21, 22], "disk": [22, 23]}

    def enable_kv_events(self) -> None:
        pass

    def take_kv_events(self) -> list:
        return []

    def cached_block_hashes(self) -> list[int]:
        return [20, 21]

    def offloaded_block_hashes(self) -> dict[str, list[int]]:
        return self.offloaded


def test_snapshot_lists_each_block_once_per_medium_and_the_router_indexes_them():
    loop = asyncio.new_event_loop()
    try:
        engine = FakeEngine()
        snapshot = KvEventLog(engine, loop, worker="w:1").snapshot_now()
    finally:
        loop.close()
    assert snapshot.snapshot and snapshot.worker == "w:1"
    assert sorted((e.stored.block_hash, e.stored.medium) for e in snapshot.events) == [
        (20, ""), (21, ""), (21, "cpu"), (22, "cpu"), (22, "disk"), (23, "disk")]
    index = KvIndex()
    KvFeeds(index)._load(snapshot)
    assert index.is_synced("w:1")
    assert index.num_blocks_by_medium("w:1") == {"device": 2, "cpu": 2, "disk": 2}
    assert index.overlap([20, 21, 22, 23], ["w:1"]) == {"w:1": 4}
    index.load_snapshot("v:1", 0, [(20, "device"), (21, "disk")])
    registry = CollectorRegistry()
    RoutingMetrics(registry, index, lambda: 0)
    gauge = {(m, w): registry.get_sample_value("pdserve:kv_index_blocks", {"worker": w, "medium": m})
             for m in ("device", "cpu", "disk") for w in ("w:1", "v:1")}
    assert gauge == {("device", "w:1"): 2, ("cpu", "w:1"): 2, ("disk", "w:1"): 2,
                     ("device", "v:1"): 1, ("cpu", "v:1"): 0, ("disk", "v:1"): 1}


def test_snapshot_without_tiers_is_device_only():
    loop = asyncio.new_event_loop()
    try:
        engine = FakeEngine()
        engine.offloaded = {}
        snapshot = KvEventLog(engine, loop).snapshot_now()
    finally:
        loop.close()
    assert [(e.stored.block_hash, e.stored.medium) for e in snapshot.events] == [(20, ""), (21, "")]
