"""Prefill on an engine of TP p, pull its KV into an engine of TP d, decode there: the tokens equal one
engine's, for (p, d) = (2, 1) and (1, 2) on the tiny fixture (4 heads, 2 KV heads). Real rank processes
(gloo); each TP engine's pool is every rank's KV cache, mapped by rank 0 (engine/parallel/shared_kv.py)."""
import pytest
import torch

from engine.config import CacheConfig, EngineConfig
from engine.llm_engine import LLMEngine
from engine.sampling_params import SamplingParams
from kv_transfer import KVLayout, KVTransferConfig, TransferState, make_receiver, make_sender
from kv_transfer.sharded import ShardedKV
from tests.conftest import step_until_output

PROMPTS = [[1 + (7 * i) % 4000 for i in range(45)], [9, 8, 7, 6, 5, 4, 3, 2, 1, 10, 11, 12, 13, 14, 15, 16, 17]]
PARAMS = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)


def engine(model_dir, tp: int) -> LLMEngine:
    return LLMEngine(EngineConfig(model=str(model_dir), dtype="float32", tensor_parallel_size=tp,
                                  cache=CacheConfig(kv_cache_memory_bytes=8 << 20)))


def pool(e: LLMEngine):
    shards = e.runner.kv_shards()
    return shards[0] if len(shards) == 1 else ShardedKV(shards)


@pytest.fixture(scope="module")
def expected(tiny_qwen2_dir):
    one = engine(tiny_qwen2_dir, 1)
    return [o.completions[0].token_ids for o in one.generate(PROMPTS, PARAMS)]


@pytest.mark.parametrize("p,d", [(2, 1), (1, 2)])
def test_kv_moves_between_tensor_parallel_sizes(tiny_qwen2_dir, expected, p, d):
    prefill, decode = engine(tiny_qwen2_dir, p), engine(tiny_qwen2_dir, d)
    try:
        src, dst = pool(prefill), pool(decode)
        layout = KVLayout.of_kv_cache(src, "tiny")
        assert layout == KVLayout.of_kv_cache(dst, "tiny") and layout.num_kv_heads == 2
        cfg = KVTransferConfig(backend="auto", host="127.0.0.1")
        with make_sender(src, layout, cfg) as sender, make_receiver(dst, layout, cfg) as receiver:
            for i, prompt in enumerate(PROMPTS):
                rid = f"r{i}"
                prefill.add_request(rid, prompt, PARAMS, prefill_only=True)
                first = step_until_output(prefill)[0]
                table, _ = decode.reserve_kv(rid, prompt)
                lease = sender.expect(rid, first.kv_block_ids, timeout_s=30)
                pull = receiver.read(sender.peer_info(), rid, first.kv_block_ids, table, timeout_s=30,
                                     capability=lease.capability)
                assert pull.wait(30) == TransferState.DONE, pull.error
                assert lease.wait(10) == TransferState.DONE
                prefill.release_kv(rid)
                decode.add_request(rid, prompt, PARAMS, first_token_id=first.token_ids[0])
                tokens = list(first.token_ids)
                while decode.has_unfinished():
                    for delta in decode.step():
                        tokens += delta.token_ids
                assert tokens == expected[i], (p, d, i)
        assert prefill.num_kv_blocks_used == 0
        # the decode side's KV really is split: every rank holds its head of the pulled blocks
        assert all(bool(torch.any(shard != 0)) for shard in decode.runner.kv_shards())
    finally:
        prefill.shutdown()
        decode.shutdown()
