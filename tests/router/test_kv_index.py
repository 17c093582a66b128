"""KvIndex on its own: overlap from events, gaps, snapshots, workers leaving."""
from engine.block_hash import hash_full_blocks
from engine.kv_events import AllCleared, BlockRemoved, BlockStored
from router.kv_index import KvIndex

BS = 4


def stored(hashes):
    return [BlockStored(h, hashes[i - 1] if i else -1) for i, h in enumerate(hashes)]


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
    index.load_snapshot("w", 5, a[:2])
    assert index.apply("w", 6, [BlockStored(a[2], a[1])])
    assert index.apply("w", 6, []), "a batch already applied is ignored"
    assert not index.apply("w", 8, [BlockStored(a[3], a[2])]), "batch 7 was lost"
    assert not index.is_synced("w")
    assert index.overlap(a, ["w"]) == {"w": 3}, "the last view still routes"
    assert not index.apply("w", 9, []), "stale until resynced"
    index.load_snapshot("w", 9, a)
    assert index.is_synced("w") and index.seq("w") == 9
    assert index.overlap(a, ["w"]) == {"w": 4}
    assert index.num_resyncs == 2


def test_new_epoch_needs_a_snapshot_and_clear_drops_everything():
    a = hash_full_blocks(list(range(16)), BS)
    index = KvIndex()
    index.load_snapshot("w", 3, a, epoch=1)
    assert not index.apply("w", 1, [], epoch=2), "a restarted worker counts from 1 again"
    index.load_snapshot("w", 1, a[:1], epoch=2)
    assert index.overlap(a, ["w"]) == {"w": 1}
    assert index.apply("w", 2, [AllCleared()], epoch=2)
    assert index.overlap(a, ["w"]) == {"w": 0} and index.num_blocks("w") == 0


def test_removing_a_worker_frees_its_blocks_and_bit():
    a = hash_full_blocks(list(range(8)), BS)
    index = KvIndex()
    index.load_snapshot("w1", 0, a)
    index.load_snapshot("w2", 0, a)
    index.remove_worker("w1")
    assert index.overlap(a, ["w1", "w2"]) == {"w1": 0, "w2": 2}
    index.load_snapshot("w3", 0, [])
    assert index.overlap(a, ["w2", "w3"]) == {"w2": 2, "w3": 0}, "w3 reuses w1's bit, not its blocks"
    index.remove_worker("w2")
    assert index._holders == {}
