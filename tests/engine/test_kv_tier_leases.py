"""A peer's lease on a prefix the holder keeps partly in a lower KV tier (engine/kv_views.py
`lease_cached_prefix`): the tier's blocks are loaded back into device blocks before the lease is answered,
bit-exact, and enter the device's prefix cache; a lease released while its load runs leaks nothing."""
import torch

from tests.engine.test_kv_offload import BLOCK_BYTES, BS, device_block_bytes, make_engine, prompts, run, settle


def wait_loaded(engine, lease_id, prefix):
    while (blocks := engine.leased_prefix_loaded(lease_id, prefix)) is None:
        engine.step()
    return blocks


def test_a_lease_loads_the_blocks_a_lower_tier_holds_back_first(tiny_qwen2_dir):
    ps = prompts(4)
    engine = make_engine(tiny_qwen2_dir, num_blocks=12, cpu_bytes=40 * BLOCK_BYTES)
    run(engine, ps[0])
    original = device_block_bytes(engine, ps[0], 8)
    for p in ps[1:]:  # prompt 0 leaves the pool for the host tier
        run(engine, p)
    prefix = ps[0][:8 * BS]
    with engine.scheduler.offload.io._wake:  # the load is still running when the lease is made
        blocks, loading = engine.lease_cached_prefix("l~pull", prefix)
        assert loading and len(blocks) == 8
        assert engine.leased_prefix_loaded("l~pull", prefix) is None
    assert wait_loaded(engine, "l~pull", prefix) == blocks
    assert all(torch.equal(a, engine.runner.kv_cache[b]) for a, b in zip(original, blocks, strict=True))
    assert engine.kv.find_prefix("probe", prefix, whole=True).block_ids == blocks  # now cached on the device
    engine.kv.free("probe")
    assert engine.release_kv("l~pull")
    settle(engine)
    # A lease on blocks now on the device is answered at once.
    assert engine.lease_cached_prefix("again~pull", prefix) == (blocks, False)
    assert engine.release_kv("again~pull")
    assert engine.num_kv_blocks_used == 0
    engine.shutdown()


def test_a_lease_released_while_loading_leaks_nothing(tiny_qwen2_dir):
    ps = prompts(4)
    engine = make_engine(tiny_qwen2_dir, num_blocks=12, cpu_bytes=40 * BLOCK_BYTES)
    for p in ps:
        run(engine, p)
    engine.kv.pool.reset_prefix_cache()
    with engine.scheduler.offload.io._wake:
        assert engine.lease_cached_prefix("gone~pull", ps[1][:8 * BS])[1]
        assert engine.release_kv("gone~pull")
    settle(engine)
    assert engine.lease_cached_prefix("none~pull", list(range(500, 500 + 4 * BS))) == ([], False)
    assert engine.num_kv_blocks_used == 0
    engine.shutdown()
