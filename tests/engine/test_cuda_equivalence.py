"""On a CUDA GPU: greedy outputs equal transformers' on the same GPU, token for token (float32,
tiny random Qwen2 with q/k/v bias), plain, with chunked prefill and under preemption, through
the Triton backend with decode CUDA graphs and through the torch backend. Runs only where CUDA is."""
import random

import pytest
import torch

from engine.config import CacheConfig, EngineConfig, SchedulerConfig
from engine.llm_engine import LLMEngine
from engine.sampling_params import SamplingParams
from tests.conftest import hf_greedy

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
NEW_TOKENS = 48


@pytest.fixture(scope="module")
def case(tiny_qwen2_dir):
    rng = random.Random(11)
    prompts = [[rng.randrange(3, 49152) for _ in range(rng.randint(3, 300))] for _ in range(14)]
    prompts += [prompts[0][:64] + [5] * 20, [7]]
    return prompts, hf_greedy(tiny_qwen2_dir, prompts, NEW_TOKENS, device="cuda")


@pytest.mark.parametrize("backend", ["triton", "torch"])
@pytest.mark.parametrize("variant", ["plain", "chunked", "preempt"])
def test_cuda_greedy_equals_transformers(tiny_qwen2_dir, case, backend, variant):
    prompts, expected = case
    scheduler = SchedulerConfig(max_num_batched_tokens=64 if variant == "chunked" else 2048)
    cache = CacheConfig(num_blocks=40, enable_prefix_caching=False) if variant == "preempt" else CacheConfig()
    engine = LLMEngine(EngineConfig(model=str(tiny_qwen2_dir), dtype="float32", device="cuda",
                                    attention_backend=backend, scheduler=scheduler, cache=cache))
    assert (engine.runner.graphs is not None) == (backend == "triton")
    outputs = engine.generate(prompts, SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True))
    got = [o.completions[0].token_ids for o in outputs]
    if variant == "preempt":
        assert engine.scheduler.num_preemptions > 0
    if backend == "triton":  # decode steps really replayed the captured graphs
        assert engine.runner.num_graph_steps > 0
    for i, (g, e) in enumerate(zip(got, expected, strict=True)):
        assert g == e, f"prompt {i} differs"
    assert engine.kv.pool.num_used_blocks == 0


def test_gpu_memory_utilization_sizes_the_kv_cache(tiny_qwen2_dir):
    free, total = torch.cuda.mem_get_info()
    small = LLMEngine(EngineConfig(model=str(tiny_qwen2_dir), dtype="float32", device="cuda",
                                   cache=CacheConfig(gpu_memory_utilization=0.1)))
    blocks_small = small.num_kv_blocks_total
    kv_bytes = small.runner.kv_cache.numel() * 4
    del small
    torch.cuda.empty_cache()
    assert 0 < kv_bytes <= 0.1 * total
    large = LLMEngine(EngineConfig(model=str(tiny_qwen2_dir), dtype="float32", device="cuda",
                                   cache=CacheConfig(gpu_memory_utilization=0.2)))
    assert large.num_kv_blocks_total > 1.5 * blocks_small
