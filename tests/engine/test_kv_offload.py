"""KV cache tiers (engine/kv_offload/): blocks evicted from the pool come back bit-exact from host memory and disk,
outputs do not change, a prompt's prefix is assembled across tiers, aborts while loading leak nothing, a bad disk
file is refused, and a restarted engine finds its disk tier again."""
import random

import pytest
import torch

from engine.config import CacheConfig, EngineConfig
from engine.kv_offload.config import OffloadConfig
from engine.kv_offload.disk_tier import HEADER_BYTES
from engine.llm_engine import LLMEngine
from engine.sampling_params import SamplingParams
from tests.conftest import step_until_output

BS = 16
BLOCK_BYTES = 2 * 2 * BS * 2 * 16 * 4
"""The tiny model's block: 2 layers, K and V, 16 tokens, 2 KV heads of 16, float32."""
GREEDY = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)


def make_engine(model_dir, num_blocks=24, **offload) -> LLMEngine:
    return LLMEngine(EngineConfig(model=str(model_dir), dtype="float32", seed=0,
                                  cache=CacheConfig(block_size=BS, num_blocks=num_blocks,
                                                    offload=OffloadConfig(**offload))))


def prompts(n: int, blocks: int = 8, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(100, 40000) for _ in range(blocks * BS + 1)] for _ in range(n)]


def run(engine: LLMEngine, prompt: list[int]):
    """Generate one prompt, then let the tiers' I/O finish (so what it stored is there)."""
    out = engine.generate([prompt], GREEDY)[0]
    settle(engine)
    return out.completions[0].token_ids, out.num_cached_tokens


def settle(engine: LLMEngine) -> None:
    """An idle engine keeps stepping until its tiers' copies are done (stores end, pins are released)."""
    while engine.has_unfinished():
        assert engine.step() == []
    assert not engine.scheduler.offload.busy and engine.num_kv_blocks_used == 0


def device_block_bytes(engine: LLMEngine, prompt: list[int], num_blocks: int) -> list[torch.Tensor]:
    """The KV of the prompt's first blocks as the device pool holds them (looked up by hash)."""
    hashes = engine.kv.block_hashes("probe", prompt)
    engine.kv.free("probe")
    out = []
    for i, h in enumerate(hashes[:num_blocks]):
        block_id = engine.kv.pool.lookup(h, prompt[i * BS:(i + 1) * BS])
        assert block_id is not None, f"block {i} not on the device"
        out.append(engine.runner.kv_cache[block_id].clone())
    return out


@pytest.fixture(scope="module")
def reference(tiny_qwen2_dir):
    engine = make_engine(tiny_qwen2_dir, num_blocks=64)
    ps = prompts(4)
    return ps, [engine.generate([p], GREEDY)[0].completions[0].token_ids for p in ps]


@pytest.mark.parametrize("tier", ["cpu", "disk"])
def test_evicted_blocks_come_back_bit_exact(tiny_qwen2_dir, tmp_path, reference, tier):
    ps, expected = reference
    # The pool holds one prompt (9 blocks + room to run); the host tier holds 40 blocks, or 2 with a disk below.
    cpu_bytes = (40 if tier == "cpu" else 2) * BLOCK_BYTES
    disk = {"disk_dir": str(tmp_path), "disk_bytes": 64 * BLOCK_BYTES} if tier == "disk" else {}
    engine = make_engine(tiny_qwen2_dir, num_blocks=12, cpu_bytes=cpu_bytes, **disk)
    assert run(engine, ps[0]) == (expected[0], 0)
    original = device_block_bytes(engine, ps[0], 8)
    for p, want in zip(ps[1:], expected[1:], strict=True):  # push prompt 0 out of the pool
        assert run(engine, p) == (want, 0)
    assert engine.kv.find_prefix("x", ps[0]).num_tokens == 0
    engine.kv.free("x")
    assert run(engine, ps[0]) == (expected[0], 8 * BS)
    assert all(torch.equal(a, b) for a, b in zip(original, device_block_bytes(engine, ps[0], 8), strict=True))
    stats = engine.kv_tier_stats()[tier]
    assert stats["hits"] == 8 and stats["bytes_loaded"] == 8 * BLOCK_BYTES
    assert engine.num_kv_blocks_used == 0
    engine.shutdown()


def test_greedy_outputs_equal_with_and_without_offload(tiny_qwen2_dir, tmp_path, reference):
    ps, expected = reference
    engine = make_engine(tiny_qwen2_dir, num_blocks=12, cpu_bytes=4 * BLOCK_BYTES, disk_dir=str(tmp_path),
                         disk_bytes=64 * BLOCK_BYTES)
    order = [0, 1, 2, 3, 1, 0, 3, 2, 0]
    got = [run(engine, ps[i]) for i in order]
    assert [tokens for tokens, _ in got] == [expected[i] for i in order]
    assert [cached for _, cached in got] == [0, 0, 0, 0] + [8 * BS] * 5
    engine.shutdown()


def test_prefix_assembled_across_device_cpu_disk_and_miss(tiny_qwen2_dir, tmp_path, reference):
    ps, expected = reference
    prompt = ps[0]
    engine = make_engine(tiny_qwen2_dir, num_blocks=24, cpu_bytes=3 * BLOCK_BYTES, disk_dir=str(tmp_path),
                         disk_bytes=64 * BLOCK_BYTES)
    hashes = engine.kv.block_hashes("probe", prompt)
    engine.kv.free("probe")
    offload = engine.scheduler.offload
    run(engine, prompt)  # the host keeps blocks 5-7; 0-4 went on to disk as the host evicted them
    original = device_block_bytes(engine, prompt, 5)
    assert engine.kv.pool.reset_prefix_cache()  # the device forgets everything
    run(engine, prompt[:3 * BS + 1])  # blocks 0-2 come back from disk, and onto the host (5-7 go to disk)
    assert engine.kv.pool.reset_prefix_cache()
    run(engine, prompt[:BS + 1])  # block 0 comes back onto the device, from the host
    for h in hashes[5:]:
        assert offload.disk.index.remove(h)  # blocks 5.. nowhere
    assert [h in offload.host.index for h in hashes[:5]] == [True, True, True, False, False]
    assert engine.kv.find_prefix("x", prompt).num_tokens == BS  # block 0 alone on the device
    engine.kv.free("x")
    before = {m: dict(s) for m, s in engine.kv_tier_stats().items()}
    assert run(engine, prompt) == (expected[0], 5 * BS)
    after = engine.kv_tier_stats()
    assert after["cpu"]["hits"] - before["cpu"]["hits"] == 2  # blocks 1, 2
    assert after["disk"]["hits"] - before["disk"]["hits"] == 2  # blocks 3, 4
    assert all(torch.equal(a, b) for a, b in zip(original, device_block_bytes(engine, prompt, 5), strict=True))
    engine.shutdown()


def test_abort_while_loading_frees_everything(tiny_qwen2_dir, tmp_path, reference):
    ps, _ = reference
    engine = make_engine(tiny_qwen2_dir, num_blocks=12, cpu_bytes=40 * BLOCK_BYTES)
    for p in ps:
        run(engine, p)
    offload = engine.scheduler.offload
    with offload.io._wake:  # the I/O thread cannot take the load until we let go
        engine.add_request("r", ps[0], GREEDY)
        assert engine.step() == []
        assert len(engine.scheduler.loading) == 1 and engine.num_kv_blocks_used == 8
        engine.abort_request("r")
        deltas = engine.step()
        assert [d.finish_reason for d in deltas] == ["abort"]
        assert engine.has_unfinished()  # the load still holds its blocks
    while engine.has_unfinished():
        engine.step()
    assert engine.num_kv_blocks_used == 0 and not engine.scheduler.loading
    assert all(e.pins == 0 for e in offload.host.index._entries.values())
    engine.add_request("r", ps[0], GREEDY)  # the same id again, and the blocks loaded for nobody are free
    while engine.has_unfinished():
        engine.step()
    assert engine.num_kv_blocks_used == 0
    engine.shutdown()


def disk_tier_written_by_one_engine(model_dir, tmp_path, prompt: list[int]) -> tuple[dict, dict]:
    """Run `prompt` on an engine with a host and a disk tier, then shut it down (the host tier's blocks go to
    disk); returns the tiers' settings and where the prompt's blocks lie in the file."""
    tiers = {"cpu_bytes": 4 * BLOCK_BYTES, "disk_dir": str(tmp_path), "disk_bytes": 64 * BLOCK_BYTES}
    engine = make_engine(model_dir, num_blocks=12, **tiers)
    run(engine, prompt)
    disk = engine.scheduler.offload.disk
    hashes = engine.kv.block_hashes("probe", prompt)
    where = {"path": disk.path, "data_offset": disk.data_offset, "hashes": hashes}
    engine.shutdown()
    where["slots"] = [disk.index.get(h).slot for h in hashes]
    return tiers, where


def test_warm_restart_serves_prefix_from_disk(tiny_qwen2_dir, tmp_path, reference):
    ps, expected = reference
    tiers, _ = disk_tier_written_by_one_engine(tiny_qwen2_dir, tmp_path, ps[0])
    second = make_engine(tiny_qwen2_dir, num_blocks=12, **tiers)
    assert len(second.offloaded_block_hashes()["disk"]) == 8  # announced before any request
    assert run(second, ps[0]) == (expected[0], 8 * BS)
    assert second.kv_tier_stats()["disk"]["hits"] == 8
    second.shutdown()


def test_corrupted_disk_block_is_refused(tiny_qwen2_dir, tmp_path, reference):
    ps, expected = reference
    tiers, where = disk_tier_written_by_one_engine(tiny_qwen2_dir, tmp_path, ps[0])
    hashes = where["hashes"]
    with open(where["path"], "r+b") as f:  # flip one byte of block 3
        f.seek(where["data_offset"] + where["slots"][3] * BLOCK_BYTES + 100)
        byte = f.read(1)
        f.seek(-1, 1)
        f.write(bytes([byte[0] ^ 0xFF]))
    second = make_engine(tiny_qwen2_dir, num_blocks=12, **tiers)
    assert run(second, ps[0]) == (expected[0], 3 * BS)  # blocks 0-2 load, 3 is refused and recomputed
    stats = second.kv_tier_stats()["disk"]
    assert stats["num_refused"] == 1
    disk = second.scheduler.offload.disk  # the recomputed block was written down again, sound
    assert disk.verify(disk.index.get(hashes[3]).slot, hashes[3])
    assert second.num_kv_blocks_used == 0
    second.shutdown()


@pytest.mark.parametrize("change", ["dtype", "header"])
def test_foreign_layout_disk_file_is_discarded(tiny_qwen2_dir, tmp_path, reference, change):
    ps, expected = reference
    tiers, where = disk_tier_written_by_one_engine(tiny_qwen2_dir, tmp_path, ps[0])
    path = where["path"]
    if change == "header":
        with open(path, "r+b") as f:  # the layout key inside the JSON header
            head = f.read(HEADER_BYTES)
            f.seek(head.index(b'"layout": "') + 11)
            f.write(b"0" * 8)
        second = make_engine(tiny_qwen2_dir, num_blocks=12, **tiers)
        want = expected[0]
    else:
        half = BLOCK_BYTES // 2  # a bfloat16 block
        second = LLMEngine(EngineConfig(model=str(tiny_qwen2_dir), dtype="bfloat16", cache=CacheConfig(
            block_size=BS, num_blocks=12, offload=OffloadConfig(cpu_bytes=4 * half, disk_dir=str(tmp_path),
                                                               disk_bytes=64 * half))))
        want = None
    disk = second.scheduler.offload.disk
    assert disk.discarded and disk.path == path and second.offloaded_block_hashes()["disk"] == []
    tokens, cached = run(second, ps[0])
    assert cached == 0 and (want is None or tokens == want)
    second.shutdown()


def test_config_checks():
    with pytest.raises(ValueError, match="needs both"):
        OffloadConfig(cpu_bytes=1 << 20, disk_dir="/tmp/x")
    with pytest.raises(ValueError, match="below the host tier"):
        OffloadConfig(disk_dir="/tmp/x", disk_bytes=1 << 20)
    with pytest.raises(ValueError, match="prefix caching"):
        CacheConfig(enable_prefix_caching=False, offload=OffloadConfig(cpu_bytes=1 << 20))


def pull_by_copy(prefill: LLMEngine, decode: LLMEngine, prompt: list[int], params: SamplingParams):
    """The disaggregated hand-off with the transfer replaced by a tensor copy: prefill computes the prompt and
    its first token, decode reserves blocks (loading what its tiers hold) and gets only the rest copied."""
    prefill.add_request("p", prompt, params, prefill_only=True)
    delta = step_until_output(prefill)[0]
    table, num_local = decode.reserve_kv("d", prompt)
    src = delta.kv_block_ids
    for s, d in zip(src[num_local:], table[num_local:], strict=True):
        decode.runner.kv_cache[d].copy_(prefill.runner.kv_cache[s])
    prefill.release_kv("p")
    return delta.token_ids[0], num_local


def test_decode_reservation_loads_its_tiers_and_pulls_the_rest(tiny_qwen2_dir, tmp_path, reference):
    ps, expected = reference
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    prefill = make_engine(tiny_qwen2_dir, num_blocks=24)
    decode = make_engine(tiny_qwen2_dir, num_blocks=12, cpu_bytes=40 * BLOCK_BYTES)
    for p in ps:  # prompt 0 passes through the decode engine, then leaves its pool for the host tier
        run(decode, p)
    with decode.scheduler.offload.io._wake:  # the load is still running when the request comes
        first, num_local = pull_by_copy(prefill, decode, ps[0], params)
        assert num_local == 8  # all 8 full blocks from the host tier; only the last, partial one is pulled
        decode.add_request("d", ps[0], params, first_token_id=first)
        assert decode.step() == [] and len(decode.scheduler.loading) == 1
    tokens = [first]
    while decode.has_unfinished():
        tokens += [t for d in decode.step() for t in d.token_ids]
    assert tokens == expected[0]
    assert decode.kv_tier_stats()["cpu"]["hits"] == 8
    settle(decode)
    assert decode.num_kv_blocks_used == 0 and prefill.num_kv_blocks_used == 0
    # A reservation released while its load runs (the pull failed, or an abort) leaks nothing.
    decode.kv.pool.reset_prefix_cache()
    with decode.scheduler.offload.io._wake:
        assert decode.reserve_kv("gone", ps[1])[1] == 8
        assert decode.release_kv("gone")
    while decode.has_unfinished():
        decode.step()
    assert decode.num_kv_blocks_used == 0
    decode.shutdown()
    prefill.shutdown()


def test_pool_view_keeps_each_rank_heads_apart():
    """With tensor parallelism a tier's row is every rank's share of the block, back to the rank that owns it."""
    from engine.kv_offload.pool_view import PoolView
    shards = [torch.randn(4, 2, 2, BS, heads, 8) for heads in (1, 3)]
    view = PoolView(shards)
    assert view.block_bytes == sum(s[0].numel() * 4 for s in shards)
    row = torch.empty(view.block_bytes, dtype=torch.uint8)
    view.copy_out(2, row)
    for shard in shards:
        shard[1].zero_()
    view.copy_in(row, 1)
    assert all(torch.equal(s[1], s[2]) for s in shards)
