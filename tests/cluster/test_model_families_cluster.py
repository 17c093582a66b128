"""Each dense family beyond Llama's through real processes: a prefill worker, a decode worker and a router
(`--skip-prefill-tokens 0`, so every prompt is prefilled remotely and its KV crosses to the decode worker),
on the tiny random checkpoints of the family tests (Qwen3: q/k norm and head_dim 16 where hidden / heads
is 12; Phi-3: fused qkv_proj and gate_up_proj). The greedy tokens equal transformers' own generate (fp32)
and the workers end with no KV block, request or lease held. One cluster per family, for the module.
"""
import pytest

from loadtest.chaos.processes import stop_all
from tests.cluster.harness import assert_no_leaks, generate_routed, start_router, start_workers
from tests.conftest import hf_greedy
from tests.engine.test_phi3 import tiny_phi3
from tests.engine.test_qwen3 import tiny_qwen3

BUILDERS = {"Qwen3ForCausalLM": tiny_qwen3, "Phi3ForCausalLM": tiny_phi3}
PROMPTS = [[3 + (131 * i) % 49000 for i in range(70)], [11, 400, 9000, 77] * 9 + [5]]
MAX_TOKENS = 12


@pytest.fixture(scope="module", params=sorted(BUILDERS))
def family_cluster(request, tmp_path_factory, tokenizer_dir):
    """(checkpoint, [prefill, decode], router) for one family."""
    path = BUILDERS[request.param](tmp_path_factory.mktemp(request.param), tokenizer_dir)
    started = start_workers(["prefill", "decode"], "--model", str(path), "--dtype", "float32")
    try:
        started.append(start_router(started[:1], started[1:], "--model", str(path), "--skip-prefill-tokens", "0"))
        yield path, started[:2], started[2]
    finally:
        stop_all(started)


def test_family_through_prefill_and_decode_equals_transformers(family_cluster):
    path, workers, router = family_cluster
    expected = hf_greedy(path, PROMPTS, MAX_TOKENS)
    for i, (prompt, want) in enumerate(zip(PROMPTS, expected, strict=True)):
        got = generate_routed(router, prompt, max_tokens=MAX_TOKENS)
        assert got["prefill"] == workers[0].address and got["decode"] == workers[1].address  # KV crossed
        assert got["tokens"] == want, f"prompt {i} differs"
    assert_no_leaks(workers)
