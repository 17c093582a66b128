"""The engine's KV tensor through kv_transfer: prefill on one engine, pull, decode on another.

Both engines live in this process (the two-process backend tests are in
tests/kv_transfer); this checks the contract between them: block-major KV
tensor, block ids from the block manager, only missing blocks pulled.
"""
from dataclasses import replace

import pytest
import torch

from engine.config import CacheConfig, EngineConfig
from engine.llm_engine import LLMEngine
from engine.sampling_params import SamplingParams
from kv_transfer import KVLayout, KVTransferConfig, TransferState, make_receiver, make_sender
from tests.conftest import step_until_output


@pytest.mark.parametrize("backend, overlap", [("tcp", False), ("nixl", False), ("tcp", True)],
                         ids=["tcp", "nixl", "tcp-async-decode"])
def test_prefill_transfer_decode_equals_one_engine(smollm2_dir, backend, overlap):
    config = EngineConfig(model=str(smollm2_dir), dtype="float32", cache=CacheConfig(kv_cache_memory_bytes=64 << 20))
    prefill, decode = LLMEngine(config), LLMEngine(replace(config, overlap_steps=overlap))
    assert decode.async_scheduling is overlap  # the decode side schedules ahead of its tokens, as on CUDA
    prompt = prefill.tokenizer.apply_chat_template([{"role": "user", "content": "Name the largest ocean on Earth."}])
    params = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
    expected = prefill.generate([prompt], params)[0].completions[0].token_ids

    prefill.add_request("p", prompt, SamplingParams(temperature=0, max_tokens=2))
    first_token = step_until_output(prefill)[0].token_ids[0]
    src_table = list(prefill.kv.block_table("p"))
    decode.generate([prompt[:33]], SamplingParams(temperature=0, max_tokens=1))  # decode caches 2 blocks itself
    dst_table, num_local = decode.reserve_kv("d", prompt)
    assert num_local == 2

    layout = KVLayout.of_kv_cache(prefill.runner.kv_cache, "SmolLM2-135M-Instruct")
    assert layout == KVLayout.of_kv_cache(decode.runner.kv_cache, "SmolLM2-135M-Instruct")
    moved = pull_blocks(prefill, decode, layout, KVTransferConfig(backend=backend, host="127.0.0.1"), src_table,
                        dst_table, num_local)
    assert moved == (len(src_table) - num_local) * layout.block_nbytes
    finish_on_decode(prefill, decode, prompt, params, first_token, expected)


def test_prefill_only_keeps_blocks_until_released(smollm2_dir):
    engine = LLMEngine(EngineConfig(model=str(smollm2_dir), dtype="float32",
                                    cache=CacheConfig(kv_cache_memory_bytes=32 << 20)))
    prompt = list(range(100, 140))  # 40 tokens: 3 blocks
    engine.add_request("kept", prompt, SamplingParams(temperature=0, max_tokens=8), prefill_only=True)
    engine.add_request("done", prompt[:20], SamplingParams(temperature=0, max_tokens=1), prefill_only=True)
    deltas = {d.request_id: d for d in engine.step()}
    kept, done = deltas["kept"], deltas["done"]
    assert len(kept.token_ids) == 1 and not kept.finished and len(kept.kv_block_ids) == 3
    assert done.finished and done.finish_reason == "length" and done.kv_block_ids is None
    assert not engine.has_unfinished()
    assert engine.num_kv_blocks_used == 3  # only the handed-off request's blocks
    assert engine.release_kv("kept") and not engine.release_kv("kept")
    assert engine.num_kv_blocks_used == 0


def test_decode_continues_a_seeded_sample_as_one_engine_would(smollm2_dir):
    """The decode side skips the random draw the prefill side made for the first token."""
    config = EngineConfig(model=str(smollm2_dir), dtype="float32", cache=CacheConfig(kv_cache_memory_bytes=32 << 20))
    decode, prefill_side = LLMEngine(config), LLMEngine(config)
    prompt = decode.tokenizer.encode("Tell me about the moon")
    params = SamplingParams(temperature=0.9, seed=11, max_tokens=12, ignore_eos=True)
    expected = decode.generate([prompt], params)[0].completions[0].token_ids  # one engine, start to end
    prefill_side.add_request("r", prompt, params, prefill_only=True)
    first = step_until_output(prefill_side)[0]
    dst_table, _ = decode.reserve_kv("r", prompt)
    decode.runner.kv_cache[dst_table] = prefill_side.runner.kv_cache[first.kv_block_ids]  # the "pull"
    decode.add_request("r", prompt, params, first_token_id=first.token_ids[0])
    tokens = list(first.token_ids)
    while decode.has_unfinished():
        for d in decode.step():
            tokens += d.token_ids
    assert tokens == expected
    prefill_side.release_kv("r")


def test_recompute_prompt_continues_a_seeded_sample_without_the_kv(smollm2_dir):
    """A decode engine that never got the KV recomputes prompt + first token and goes on exactly."""
    engine = LLMEngine(EngineConfig(model=str(smollm2_dir), dtype="float32",
                                    cache=CacheConfig(kv_cache_memory_bytes=32 << 20)))
    prompt = engine.tokenizer.encode("Write a line about rivers")
    params = SamplingParams(temperature=0.8, seed=5, max_tokens=10, ignore_eos=True)
    expected = engine.generate([prompt], params)[0].completions[0].token_ids
    engine.kv.pool.reset_prefix_cache()
    engine.add_request("r", prompt, params, first_token_id=expected[0], recompute_prompt=True)
    tokens = [expected[0]]
    while engine.has_unfinished():
        for d in engine.step():
            tokens += d.token_ids
    assert tokens == expected
    assert engine.num_kv_blocks_used == 0


def test_fp8_blocks_transfer_and_refuse_a_bf16_peer(smollm2_dir):
    """fp8 prefill -> fp8 decode continues as one fp8 engine would, moving half of bf16's bytes per block;
    an fp8 sender and a bf16 receiver refuse each other, naming the dtype."""
    fp8_config = EngineConfig(model=str(smollm2_dir), cache=CacheConfig(kv_cache_memory_bytes=16 << 20,
                                                                        kv_cache_dtype="fp8"))
    prefill, decode = LLMEngine(fp8_config), LLMEngine(fp8_config)
    prompt = prefill.tokenizer.apply_chat_template([{"role": "user", "content": "Name the largest ocean on Earth."}])
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    expected = prefill.generate([prompt], params)[0].completions[0].token_ids
    prefill.add_request("p", prompt, SamplingParams(temperature=0, max_tokens=2))
    first_token = step_until_output(prefill)[0].token_ids[0]
    src_table = list(prefill.kv.block_table("p"))
    dst_table, num_local = decode.reserve_kv("d", prompt)
    assert num_local == 0

    layout = KVLayout.of_kv_cache(prefill.runner.kv_cache, "SmolLM2", prefill.runner.kv_scales)
    assert layout == KVLayout.of_kv_cache(decode.runner.kv_cache, "SmolLM2", decode.runner.kv_scales)
    bf16 = KVLayout(**{**layout.to_dict(), "dtype": "bfloat16", "kv_scales": ""})
    assert 2 * layout.block_nbytes == bf16.block_nbytes
    cfg = KVTransferConfig(backend="tcp", host="127.0.0.1")
    bf16_pool = torch.zeros(bf16.shape(4), dtype=torch.bfloat16)
    with make_sender(prefill.runner.kv_cache, layout, cfg) as sender:
        with make_receiver(bf16_pool, bf16, cfg) as refusing:
            lease = sender.expect("x", src_table[:1], timeout_s=30)
            refused = refusing.read(sender.peer_info(), "x", src_table[:1], [0], timeout_s=30,
                                    capability=lease.capability)
            assert refused.wait(30) == TransferState.FAILED
            assert "differs in: dtype, kv_scales" in refused.error, refused.error
        with make_receiver(decode.runner.kv_cache, layout, cfg) as receiver:
            lease = sender.expect("p", src_table, timeout_s=30)
            pull = receiver.read(sender.peer_info(), "p", src_table, dst_table, timeout_s=30,
                                 capability=lease.capability)
            assert pull.wait(30) == TransferState.DONE
            assert pull.bytes_moved == len(src_table) * bf16.block_nbytes // 2
    finish_on_decode(prefill, decode, prompt, params, first_token, expected)


def pull_blocks(prefill, decode, layout, cfg, src_table, dst_table, num_local) -> int:
    """Lease request "p"'s blocks on a sender over the prefill engine's pool and pull those past `num_local`
    into the decode engine's `dst_table`; both sides end DONE (the prefill side may then free). Bytes moved."""
    with make_sender(prefill.runner.kv_cache, layout, cfg) as sender, \
            make_receiver(decode.runner.kv_cache, layout, cfg) as receiver:
        lease = sender.expect("p", src_table, timeout_s=30)
        pull = receiver.read(sender.peer_info(), "p", src_table[num_local:], dst_table[num_local:], timeout_s=30,
                             capability=lease.capability)
        assert pull.wait(30) == TransferState.DONE
        assert lease.wait(10) == TransferState.DONE
        return pull.bytes_moved


def finish_on_decode(prefill, decode, prompt, params, first_token, expected) -> None:
    """The prefill engine lets its request go; the decode engine continues from the pulled KV and must
    produce `expected`; neither keeps a block or a request afterwards."""
    prefill.abort_request("p")
    prefill.step()
    decode.add_request("d", prompt, params, first_token_id=first_token)
    tokens = [first_token]
    while decode.has_unfinished():
        tokens += [t for d in decode.step() for t in d.token_ids]
    assert tokens == expected
    for engine in (prefill, decode):
        assert engine.kv.pool.num_used_blocks == 0 and not engine.has_unfinished()
