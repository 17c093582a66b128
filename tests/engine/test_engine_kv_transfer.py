"""The engine's KV tensor through kv_transfer: prefill on one engine, pull, decode on another.

Both engines live in this process (the two-process backend tests are in
tests/kv_transfer); this checks the contract between them: block-major KV
tensor, block ids from the block manager, only missing blocks pulled.
"""
import pytest

from engine.config import CacheConfig, EngineConfig
from engine.llm_engine import LLMEngine
from engine.sampling_params import SamplingParams
from kv_transfer import KVLayout, KVTransferConfig, TransferState, make_receiver, make_sender


@pytest.mark.parametrize("backend", ["tcp", "nixl"])
def test_prefill_transfer_decode_equals_one_engine(smollm2_dir, backend):
    config = EngineConfig(model=str(smollm2_dir), dtype="float32", cache=CacheConfig(kv_cache_memory_bytes=64 << 20))
    prefill, decode = LLMEngine(config), LLMEngine(config)
    prompt = prefill.tokenizer.apply_chat_template([{"role": "user", "content": "Name the largest ocean on Earth."}])
    params = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
    expected = prefill.generate([prompt], params)[0].completions[0].token_ids

    prefill.add_request("p", prompt, SamplingParams(temperature=0, max_tokens=2))
    first_token = prefill.step()[0].token_ids[0]
    src_table = list(prefill.kv.block_table("p"))
    decode.generate([prompt[:33]], SamplingParams(temperature=0, max_tokens=1))  # decode caches 2 blocks itself
    dst_table, num_local = decode.reserve_kv("d", prompt)
    assert num_local == 2

    layout = KVLayout.of_kv_cache(prefill.runner.kv_cache, "SmolLM2-135M-Instruct")
    assert layout == KVLayout.of_kv_cache(decode.runner.kv_cache, "SmolLM2-135M-Instruct")
    cfg = KVTransferConfig(backend=backend, host="127.0.0.1")
    with make_sender(prefill.runner.kv_cache, layout, cfg) as sender, \
            make_receiver(decode.runner.kv_cache, layout, cfg) as receiver:
        lease = sender.expect("p", src_table, timeout_s=30)
        pull = receiver.read(sender.peer_info(), "p", src_table[num_local:], dst_table[num_local:], timeout_s=30)
        assert pull.wait(30) == TransferState.DONE
        assert lease.wait(10) == TransferState.DONE  # the prefill side may now free
        assert pull.bytes_moved == (len(src_table) - num_local) * layout.block_nbytes
    prefill.abort_request("p")
    prefill.step()

    decode.add_request("d", prompt, params, first_token_id=first_token)
    tokens = [first_token]
    while decode.has_unfinished():
        tokens += [t for d in decode.step() for t in d.token_ids]
    assert tokens == expected
    for engine in (prefill, decode):
        assert engine.kv.pool.num_used_blocks == 0 and not engine.has_unfinished()
