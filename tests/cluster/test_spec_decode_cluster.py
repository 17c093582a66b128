"""Speculative decoding in the cluster: a decode worker started with `--speculative-method ngram`
continues KV it pulled from a plain prefill worker, verifying proposals; greedy outputs (free and
constrained by a JSON schema) over gRPC
and the OpenAI HTTP front equal the offline engine without speculation, token for token, and the
worker's metrics count drafted and accepted tokens."""
from __future__ import annotations

import httpx2 as httpx
import pytest

from engine.config import CacheConfig, EngineConfig, SchedulerConfig
from engine.llm_engine import LLMEngine
from engine.sampling_params import SamplingParams
from engine.structured_output.spec import StructuredOutput
from loadtest.chaos.processes import stop_all
from tests.cluster.harness import assert_no_leaks, free_port, generate_routed, grpc_samples, metric_value, start_cluster

# Text that repeats itself, so the n-gram proposer finds what comes next in the prompt.
PROMPT = [1, 504, 3575, 282, 4649, 314, 7042, 30, 504, 3575, 282, 4649, 314] * 6
MAX_TOKENS = 24


@pytest.fixture(scope="module")
def spec_cluster(smollm2_dir):
    metrics_port, http_port = free_port(), free_port()
    speculative = ["--speculative-method", "ngram", "--num-speculative-tokens", "4"]
    procs = start_cluster(["prefill", ["decode", *speculative, "--metrics-port", str(metrics_port)]],
                          router_flags=("--http-port", str(http_port)))
    prefill, decode, router = procs
    try:
        router.http_url = f"http://127.0.0.1:{http_port}"
        decode.metrics_url = f"http://127.0.0.1:{metrics_port}/metrics"
        yield {"prefill": prefill, "decode": decode, "router": router}
    finally:
        stop_all(procs)


def test_ngram_speculation_in_a_decode_worker_equals_plain_greedy(spec_cluster, smollm2_dir):
    engine = LLMEngine(EngineConfig(model=str(smollm2_dir), dtype="float32",
                                    cache=CacheConfig(kv_cache_memory_bytes=256 << 20),
                                    scheduler=SchedulerConfig(max_num_batched_tokens=512)))
    [want] = engine.generate([PROMPT], SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True))
    want_tokens = want.completions[0].token_ids

    got = generate_routed(spec_cluster["router"], PROMPT, max_tokens=MAX_TOKENS)
    assert got["tokens"] == want_tokens

    # constrained: proposals the grammar forbids are never accepted, the output is the same
    constrained = SamplingParams(temperature=0.0, max_tokens=60, structured_output=StructuredOutput.json_schema(
        {"type": "array", "minItems": 3, "maxItems": 6, "items": {"enum": ["fox", "dog", "quick brown fox"]}}))
    [want_constrained] = engine.generate([PROMPT], constrained)
    [got_constrained] = grpc_samples(spec_cluster["router"].address, constrained, token_ids=PROMPT)
    assert got_constrained.token_ids == want_constrained.completions[0].token_ids

    response = httpx.post(spec_cluster["router"].http_url + "/v1/completions", timeout=120,
                          json={"model": "default", "prompt": PROMPT, "max_tokens": MAX_TOKENS, "temperature": 0,
                                "ignore_eos": True})
    assert response.status_code == 200, response.text
    body = response.json()
    assert body["usage"]["completion_tokens"] == MAX_TOKENS
    assert body["choices"][0]["text"] == engine.tokenizer.decode(want_tokens)

    url = spec_cluster["decode"].metrics_url
    drafted = metric_value(url, "pdserve:spec_decode_num_draft_tokens_total")
    accepted = metric_value(url, "pdserve:spec_decode_num_accepted_tokens_total")
    assert drafted and drafted > 0 and accepted and accepted > 0, (drafted, accepted)
    assert_no_leaks([spec_cluster["prefill"], spec_cluster["decode"]])
