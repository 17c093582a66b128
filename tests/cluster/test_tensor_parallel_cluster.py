"""Prefill and decode workers of different tensor- and pipeline-parallel shapes behind a router (`pdserve
prefill-worker --tensor-parallel-size 2` ...; six workers started once, a router per pairing):
P TP=2 -> D TP=1, P TP=1 -> D TP=2, P PP=2 -> D PP=1, P PP=1 -> D PP=2 and P TP=2 -> D PP=2 on the tiny
fixture (4 heads, 2 KV heads, 2 layers). Every sample is prefilled remotely, its KV crosses between the shapes
(each head and layer from the rank or stage that holds it to the one that owns it), and the greedy tokens
equal one engine's; the workers end with no KV block, request or lease held."""
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

from engine.config import CacheConfig, EngineConfig
from engine.llm_engine import LLMEngine
from engine.sampling_params import SamplingParams
from loadtest.chaos.processes import stop_all
from tests.cluster.harness import (
    assert_no_leaks,
    free_port,
    generate_routed,
    metric_value,
    start_router,
    start_workers,
    worker_stats,
)

PROMPTS = [[1 + (13 * i) % 3000 for i in range(70)], list(range(200, 240)), [5, 6, 7] * 15]
MAX_TOKENS = 8
TP2, PP2 = ["--tensor-parallel-size", "2"], ["--pipeline-parallel-size", "2"]
WORKERS = {"P-tp2": ["prefill", *TP2], "P-pp2": ["prefill", *PP2], "P-one": ["prefill"],
           "D-one": ["decode"], "D-tp2": ["decode", *TP2], "D-pp2": ["decode", *PP2]}
PAIRS = {"tp2-tp1": ("P-tp2", "D-one"), "tp1-tp2": ("P-one", "D-tp2"), "pp2-pp1": ("P-pp2", "D-one"),
         "pp1-pp2": ("P-one", "D-pp2"), "tp2-pp2": ("P-tp2", "D-pp2")}
"""Each shape pairing: a prefill worker and a decode worker, behind a router of their own."""


def prompts_of(pair: str) -> list[list[int]]:
    """The pair's own prompts (no other pair's cached blocks to reuse: every block crosses)."""
    k = list(PAIRS).index(pair)
    return [[3 + (t + 5000 * k) % 49000 for t in p] for p in PROMPTS]


@pytest.fixture(scope="module")
def expected(tiny_qwen2_dir):
    one = LLMEngine(EngineConfig(model=str(tiny_qwen2_dir), dtype="float32",
                                 cache=CacheConfig(kv_cache_memory_bytes=8 << 20)))
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS)
    return {pair: [o.completions[0].token_ids for o in one.generate(prompts_of(pair), params)] for pair in PAIRS}


@pytest.fixture(scope="module")
def shapes(tiny_qwen2_dir):
    """The six workers, started side by side once, and a router per pair."""
    model = ("--model", str(tiny_qwen2_dir))
    workers = dict(zip(WORKERS, start_workers(list(WORKERS.values()), *model), strict=True))
    ports = {pair: free_port() for pair in PAIRS}
    with ThreadPoolExecutor(len(PAIRS)) as pool:
        futures = {pair: pool.submit(start_router, [workers[p]], [workers[d]], *model, "--metrics-port",
                                     str(ports[pair])) for pair, (p, d) in PAIRS.items()}
    routers = {pair: f.result() for pair, f in futures.items() if f.exception() is None}
    try:
        assert len(routers) == len(PAIRS), [f.exception() for f in futures.values()]
        deadline = time.monotonic() + 60
        for pair, (p, d) in PAIRS.items():  # each router sees its two workers healthy
            url = f"http://127.0.0.1:{ports[pair]}/metrics"
            while not all(metric_value(url, "pdserve:worker_healthy", worker=workers[n].address) == 1.0
                          for n in (p, d)):
                assert time.monotonic() < deadline, f"{pair}: the router did not see its workers healthy"
                time.sleep(0.1)
        yield workers, routers
    finally:
        stop_all([*routers.values(), *workers.values()])


@pytest.mark.parametrize("pair", list(PAIRS))
def test_outputs_equal_across_parallel_shapes(shapes, expected, pair):
    workers, routers = shapes
    prefill, decode = (workers[name] for name in PAIRS[pair])
    before = worker_stats(decode.address).kv_bytes_moved
    for prompt, want in zip(prompts_of(pair), expected[pair], strict=True):
        got = generate_routed(routers[pair], prompt, max_tokens=MAX_TOKENS)
        assert got["prefill"] == prefill.address  # prefilled remotely: the KV crossed the shapes
        assert got["tokens"] == want
    assert_no_leaks([prefill, decode])
    stats = worker_stats(decode.address)  # routers size a prompt's KV with it (router/link_estimate.py)
    block_bytes = 2 * 2 * 16 * 2 * 16 * 4  # layers, K/V, tokens, all KV heads, head_dim, float32
    assert stats.kv_block_bytes == block_bytes
    assert stats.kv_bytes_moved - before == sum(-(-len(p) // 16) for p in PROMPTS) * block_bytes  # all pulled
