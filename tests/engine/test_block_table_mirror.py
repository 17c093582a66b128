"""BlockTableMirror: the int32 rows kept between steps equal the KV cache manager's tables after every kind of
edit (appends, copy-on-write, window release, truncation, free and a new table under the same id, rename,
fork), and rows are reused and grown as sequences come and go. No torch."""
import random

import numpy as np

from engine.block_table_mirror import BlockTableMirror
from engine.kv_cache_manager import KVCacheManager

BS = 4


def assert_mirrored(mirror: BlockTableMirror, kv: KVCacheManager, seq_ids: list[str]) -> None:
    rows = mirror.rows(kv, seq_ids)
    assert len(set(rows.tolist())) == len(seq_ids)  # a row each
    for seq_id, row in zip(seq_ids, rows, strict=True):
        table = kv.block_table(seq_id)
        assert mirror.array[row, :len(table)].tolist() == table, seq_id


def test_random_edits_stay_mirrored_and_rows_are_recycled():
    rng = random.Random(7)
    kv = KVCacheManager(num_blocks=400, block_size=BS, enable_prefix_caching=True, sliding_window=12)
    mirror = BlockTableMirror(rows=4, cols=2)  # small: rows are recycled and both dimensions grow
    lengths: dict[str, int] = {}
    next_id = 0
    for _ in range(600):
        op = rng.random()
        if op < 0.2 or not lengths:  # a new sequence (sometimes an id used before)
            seq_id = f"s{rng.randrange(next_id + 1)}" if rng.random() < 0.3 else f"s{next_id}"
            next_id += 1
            if seq_id in lengths:
                continue
            n = rng.randrange(1, 30)
            if kv.allocate_slots(seq_id, 0, n) is not None:
                lengths[seq_id] = n
        else:
            seq_id = rng.choice(sorted(lengths))
            if op < 0.55:  # decode or a chunk: appends
                n = rng.randrange(1, 9)
                if kv.allocate_slots(seq_id, lengths[seq_id], n) is not None:
                    lengths[seq_id] += n
            elif op < 0.62:  # a fork shares the last block: the next write copies it
                child = f"s{next_id}"
                next_id += 1
                kv.fork(seq_id, child)
                lengths[child] = lengths[seq_id]
                for owner in (seq_id, child):
                    if kv.allocate_slots(owner, lengths[owner], 1) is not None:
                        lengths[owner] += 1
            elif op < 0.7:
                kv.release_outside_window(seq_id, lengths[seq_id])
            elif op < 0.78 and kv.num_released(seq_id) == 0:  # rejected proposals rolled back
                keep = rng.randrange(1, lengths[seq_id] + 1)
                kv.truncate(seq_id, keep)
                lengths[seq_id] = keep
            elif op < 0.85:
                new_id = f"s{next_id}"
                next_id += 1
                kv.rename(seq_id, new_id)
                lengths[new_id] = lengths.pop(seq_id)
            else:
                kv.free(seq_id)
                del lengths[seq_id]
        if lengths:
            step = rng.sample(sorted(lengths), min(len(lengths), rng.randrange(1, 7)))
            assert_mirrored(mirror, kv, step)
    assert mirror.array.shape[0] > 4 and mirror.array.shape[1] > 2


def test_a_decode_step_copies_only_what_was_appended():
    kv = KVCacheManager(num_blocks=64, block_size=BS, enable_prefix_caching=False)
    mirror = BlockTableMirror()
    kv.allocate_slots("a", 0, 8)
    (row,) = mirror.rows(kv, ["a"])
    mirror.array[row, 0] = -5  # a copied entry is not copied again while the table only grows
    kv.allocate_slots("a", 8, 1)
    mirror.rows(kv, ["a"])
    assert mirror.array[row, 0] == -5 and mirror.array[row, 2] == kv.block_table("a")[2]
    kv.fork("a", "b")
    kv.allocate_slots("a", 9, 1)  # copy-on-write of the shared block: a new stamp, the row copied whole
    mirror.rows(kv, ["a"])
    assert mirror.array[row, :3].tolist() == kv.block_table("a")
    assert np.array_equal(mirror.array[mirror.rows(kv, ["b"])[0], :3], kv.block_table("b"))


def test_a_table_remade_under_a_mirrored_id_is_copied_again():
    """An id whose old table the mirror holds, given a new table of the same length by allocation, a fork or a
    rename, or a table truncated and grown back with other blocks: each is copied whole, not taken as unchanged."""
    kv = KVCacheManager(num_blocks=64, block_size=BS, enable_prefix_caching=False)
    mirror = BlockTableMirror()

    def remade(make) -> None:  # x's first and second tables are made alike, of other blocks
        for life, filler in enumerate(("fill0", "fill1")):
            kv.allocate_slots(f"src{life}", 0, 8)
            make(f"src{life}")
            assert_mirrored(mirror, kv, ["x"])
            kv.free("x")
            kv.allocate_slots(filler, 0, 8)  # takes x's blocks: the next table has others
        for seq_id in ("src0", "src1", "fill0", "fill1"):
            kv.free(seq_id)

    remade(lambda src: kv.allocate_slots("x", 0, 8))
    remade(lambda src: kv.fork(src, "x"))
    remade(lambda src: kv.rename(src, "x"))
    kv.allocate_slots("t", 0, 8)
    assert_mirrored(mirror, kv, ["t"])
    kv.truncate("t", 4)
    kv.allocate_slots("u", 0, 4)  # takes t's released block
    kv.allocate_slots("t", 4, 4)
    assert_mirrored(mirror, kv, ["t"])
