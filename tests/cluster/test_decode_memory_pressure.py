"""A decode worker short of KV blocks preempts and recomputes instead of failing; outputs stay exact."""
from __future__ import annotations

import asyncio
import json

import pytest

from common.grpc_common import insecure_channel
from common.protocol import generate_pb2, generate_pb2_grpc
from loadtest.chaos.processes import stop_all
from tests.cluster.harness import assert_no_leaks, start_cluster, worker_stats
from tests.cluster.test_cluster_outputs import read_results, run_cli

MAX_TOKENS = 40
PROMPTS = [f"Story {i}: once upon a time there was a little robot who wanted to learn about {topic}."
           for i, topic in enumerate(["the sea", "stars", "music", "trees", "cities", "rain", "bridges", "snow"])]


@pytest.mark.slow  # a long scenario: `make test-fast` leaves it out
def test_decode_worker_under_memory_pressure_preempts_and_completes(tmp_path, smollm2_dir):
    # ~13 blocks of 16 tokens: room for about three of these requests at their full length; requests
    # that find no blocks for their pull within 0.3 s recompute their prompt here instead (the three
    # running take 40 steps to free theirs: longer than that even on a fast, idle AVX-512 machine, where
    # 1 s was sometimes enough for them to finish)
    # Remote prefill even for these ~20-token prompts (by default the decode worker would prefill them itself).
    prefill, decode, router = start_cluster(["prefill", ["decode", "--kv-cache-memory-gib", "0.009",
                                                         "--pull-timeout-s", "0.3"]],
                                            router_flags=("--skip-prefill-tokens", "0"))
    try:
        async def run_all():
            async with insecure_channel(router.address) as channel:
                stub = generate_pb2_grpc.GenerationStub(channel)

                async def one(i, text):
                    tokens = []
                    async for msg in stub.Generate(generate_pb2.GenerateRequest(
                            request_id=str(i), text=text, params=generate_pb2.SamplingParams(
                                temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)), timeout=600):
                        if msg.HasField("chunk"):
                            tokens.extend(msg.chunk.token_ids)
                    return tokens
                return await asyncio.gather(*(one(i, p) for i, p in enumerate(PROMPTS)))

        got = asyncio.run(run_all())
        stats = worker_stats(decode.address)
        assert stats.num_preemptions > 0, "the test must exercise preemption"
        assert stats.num_kv_recomputed > 0, "and the fallback of recomputing a prompt whose KV found no room"
        lines = [{"id": str(i), "prompt": p, "temperature": 0, "max_tokens": MAX_TOKENS, "ignore_eos": True}
                 for i, p in enumerate(PROMPTS)]
        (tmp_path / "in.jsonl").write_text("".join(json.dumps(x) + "\n" for x in lines))
        done = run_cli(["generate", "--offline", "--model", "default", "--dtype", "float32",
                        "--input", str(tmp_path / "in.jsonl"), "--output", str(tmp_path / "out.jsonl")])
        assert done.returncode == 0, done.stderr
        expected = read_results(tmp_path / "out.jsonl")
        for i, tokens in enumerate(got):
            assert tokens == expected[(str(i), None)]["token_ids"], i
        assert_no_leaks([prefill, decode])
    finally:
        stop_all((router, prefill, decode))
