"""KvIndex on its own: overlap from events, gaps, snapshots, workers leaving, media (device, cpu, disk)."""
import pytest

from engine.block_hash import hash_full_blocks
from engine.kv_events import AllCleared, BlockRemoved, BlockStored
from router.kv_index import KvIndex

BS = 4


def stored(hashes, medium="device"):
    return [BlockStored(h, hashes[i - 1] if i else -1, medium) for i, h in enumerate(hashes)]


def on_device(hashes):
    return [(h, "device") for h in hashes]


def test_overlap_counts_leading_blocks_each_worker_holds():
    a = hash_full_blocks(list(range(16)), BS)          # 4 blocks
    b = hash_full_blocks(list(range(8)) + [99] * 8, BS)  # shares 2 blocks with a
    index = KvIndex()
    for w in ("w1", "w2", "w3"):
        index.load_snapshot(w, 0, [])
    assert index.apply("w1", 1, stored(a))
    assert index.apply("w2", 1, stored(b))
    assert index.overlap(a, ["w1", "w2", "w3"]) == {"w1": 4, "w2": 2, "w3": 0}
    assert index.overlap(b, ["w1", "w2"]) == {"w1": 2, "w2": 4}
    # A hole in the chain ends the prefix even if later blocks are held.
    assert index.apply("w1", 2, [BlockRemoved(a[1])])
    assert index.overlap(a, ["w1", "w2"]) == {"w1": 1, "w2": 2}
    # Only the workers asked about are reported.
    assert index.overlap(a, ["w2"]) == {"w2": 2}


def test_gap_marks_worker_stale_until_snapshot_and_keeps_its_view():
    a = hash_full_blocks(list(range(16)), BS)
    index = KvIndex()
    index.load_snapshot("w", 5, on_device(a[:2]))
    assert index.apply("w", 6, [BlockStored(a[2], a[1])])
    assert index.apply("w", 6, []), "a batch already applied is ignored"
    assert not index.apply("w", 8, [BlockStored(a[3], a[2])]), "batch 7 was lost"
    assert not index.is_synced("w")
    assert index.overlap(a, ["w"]) == {"w": 3}, "the last view still routes"
    assert not index.apply("w", 9, []), "stale until resynced"
    index.load_snapshot("w", 9, on_device(a))
    assert index.is_synced("w") and index.seq("w") == 9
    assert index.overlap(a, ["w"]) == {"w": 4}
    assert index.num_resyncs == 2


def test_new_epoch_needs_a_snapshot_and_clear_drops_everything():
    a = hash_full_blocks(list(range(16)), BS)
    index = KvIndex()
    index.load_snapshot("w", 3, on_device(a), epoch=1)
    assert not index.apply("w", 1, [], epoch=2), "a restarted worker counts from 1 again"
    index.load_snapshot("w", 1, on_device(a[:1]), epoch=2)
    assert index.overlap(a, ["w"]) == {"w": 1}
    assert index.apply("w", 2, [AllCleared()], epoch=2)
    assert index.overlap(a, ["w"]) == {"w": 0} and index.num_blocks("w") == 0


def test_removing_a_worker_frees_its_blocks_and_bit():
    a = hash_full_blocks(list(range(8)), BS)
    index = KvIndex()
    index.load_snapshot("w1", 0, on_device(a))
    index.load_snapshot("w2", 0, on_device(a))
    index.remove_worker("w1")
    assert index.overlap(a, ["w1", "w2"]) == {"w1": 0, "w2": 2}
    index.load_snapshot("w3", 0, [])
    assert index.overlap(a, ["w2", "w3"]) == {"w2": 2, "w3": 0}, "w3 reuses w1's bit, not its blocks"
    index.remove_worker("w2")
    assert index._holders == {}


def test_a_block_is_held_while_any_medium_holds_it():
    a = hash_full_blocks(list(range(8)), BS)
    index = KvIndex()
    index.load_snapshot("w", 0, [])
    assert index.apply("w", 1, stored(a))
    assert index.apply("w", 2, stored(a, "cpu"))  # offloaded: a host copy besides the device one
    assert index.num_blocks_by_medium("w") == {"device": 2, "cpu": 2, "disk": 0}
    assert index.apply("w", 3, [BlockRemoved(a[0]), BlockRemoved(a[1])])  # evicted from the device pool
    assert index.overlap(a, ["w"]) == {"w": 2}, "still held in host memory"
    assert index.num_blocks("w") == 0 and index.num_blocks_by_medium("w")["cpu"] == 2
    assert index.apply("w", 4, [BlockRemoved(a[1], "disk")]), "not on disk: nothing to remove"
    assert index.overlap(a, ["w"]) == {"w": 2}
    assert index.apply("w", 5, [BlockRemoved(a[1], "cpu")])
    assert index.overlap(a, ["w"]) == {"w": 1}
    assert index.apply("w", 6, [BlockRemoved(a[0], "cpu")])
    assert index.overlap(a, ["w"]) == {"w": 0}
    assert index._holders == {} and index.num_blocks_by_medium("w") == {"device": 0, "cpu": 0, "disk": 0}


def test_clear_forgets_every_medium_and_unknown_media_are_ignored():
    a = hash_full_blocks(list(range(8)), BS)
    index = KvIndex()
    index.load_snapshot("w", 0, [(a[0], "device"), (a[0], "disk"), (a[1], "cpu"), (a[1], "tape")])
    assert index.num_blocks_by_medium("w") == {"device": 1, "cpu": 1, "disk": 1}
    assert index.overlap(a, ["w"]) == {"w": 2}
    assert index.apply("w", 1, [BlockStored(a[1], a[0], "tape")])
    assert index.num_blocks_by_medium("w") == {"device": 1, "cpu": 1, "disk": 1}
    assert index.apply("w", 2, [AllCleared()])
    assert index.overlap(a, ["w"]) == {"w": 0} and index._holders == {}
    assert index.num_blocks_by_medium("w") == {"device": 0, "cpu": 0, "disk": 0}


def test_snapshot_with_media_replaces_the_view():
    a = hash_full_blocks(list(range(16)), BS)
    index = KvIndex()
    index.load_snapshot("w", 3, on_device(a))
    index.load_snapshot("w", 7, [(a[0], "cpu"), (a[1], "disk"), (a[1], "cpu")])
    assert index.overlap(a, ["w"]) == {"w": 2}
    assert index.num_blocks_by_medium("w") == {"device": 0, "cpu": 2, "disk": 1}
    assert index.apply("w", 8, [BlockRemoved(a[1], "cpu")])
    assert index.overlap(a, ["w"]) == {"w": 2}, "still on disk"


WEIGHTS = {"device": 1.0, "cpu": 0.8, "disk": 0.5}


def test_weighted_overlap_prices_each_leading_block_by_its_best_medium():
    a = hash_full_blocks(list(range(24)), BS)  # 6 blocks
    index = KvIndex()
    index.load_snapshot("mixed", 0, [(a[0], "device"), (a[1], "cpu"), (a[2], "disk"), (a[4], "device")])
    index.load_snapshot("dev", 0, on_device(a[:3]))
    index.load_snapshot("both", 0, [(a[0], "disk"), (a[0], "cpu"), (a[1], "disk"), (a[1], "device")])
    index.load_snapshot("none", 0, [])
    got = index.weighted_overlap(a, ["mixed", "dev", "both", "none", "unknown"], WEIGHTS)
    assert got == pytest.approx({"mixed": 1 + 0.8 + 0.5, "dev": 3.0, "both": 0.8 + 1.0, "none": 0.0,
                                 "unknown": 0.0}), "stops at the miss (a[3]); a[4] does not count"
    assert index.overlap(a, ["mixed"]) == {"mixed": 3}, "depth counts any medium"
    assert index.weighted_overlap(a, ["mixed"], {"device": 1.0}) == {"mixed": 1.0}, "a medium left out: 0"
    assert index.weighted_overlap(a, ["dev"], WEIGHTS, depths={"dev": 2}) == {"dev": 2.0}


def test_num_blocks_counts_device_only():
    a = hash_full_blocks(list(range(16)), BS)
    index = KvIndex()
    index.load_snapshot("w", 0, [(a[0], "device"), (a[1], "device"), (a[1], "cpu"), (a[2], "cpu"), (a[3], "disk")])
    assert index.num_blocks("w") == 2
    assert index.num_blocks_by_medium("w") == {"device": 2, "cpu": 2, "disk": 1}
    assert index.num_blocks("gone") == 0 and index.num_blocks_by_medium("gone") == {"device": 0, "cpu": 0, "disk": 0}


def test_overlap_counts_blocks_on_any_medium_and_best_media_counts_by_best():
    a = hash_full_blocks(list(range(24)), BS)  # 6 blocks
    index = KvIndex()
    index.load_snapshot("w", 0, [(a[0], "device"), (a[1], "device"), (a[1], "cpu"), (a[2], "cpu"), (a[3], "device")])
    assert index.overlap(a, ["w", "gone"]) == {"w": 4, "gone": 0}, "a[2] is in host memory: held all the same"
    assert index.best_media(a[:3], "w") == {"device": 2, "cpu": 1, "disk": 0}
    assert index.best_media(a, "gone") == {"device": 0, "cpu": 0, "disk": 0}
