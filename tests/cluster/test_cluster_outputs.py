"""Outputs through the cluster equal the offline engine's; streaming is incremental."""
from __future__ import annotations

import json
import subprocess
import sys
import time

import pytest

from common.protocol import generate_pb2
from decode_worker.decode_loop import LINK_SAMPLE_BYTES
from tests.cluster.harness import WORKER_FLAGS, assert_no_leaks, generation_stub, worker_stats

REQUESTS = [
    {"id": "chat", "messages": [{"role": "user", "content": "What is the capital of France?"}], "max_tokens": 32},
    {"id": "text", "prompt": "The quick brown fox", "max_tokens": 24},
    {"id": "ids", "token_ids": [1, 504, 3575, 282, 4649], "max_tokens": 16, "ignore_eos": True},
    {"id": "long", "prompt": "Once upon a time in a land far away, " * 40, "max_tokens": 20},
    {"id": "stop", "prompt": "Count: one, two, three,", "max_tokens": 30, "stop": [" six"]},
    {"id": "one", "prompt": "Hello", "max_tokens": 1},
    {"id": "shared-1", "prompt": "You are a helpful assistant. " * 12 + "Say hi.", "max_tokens": 12},
    {"id": "shared-2", "prompt": "You are a helpful assistant. " * 12 + "Say bye.", "max_tokens": 12},
]
SAMPLED = {"id": "seeded", "prompt": "Tell me a story about a cat", "max_tokens": 16, "temperature": 0.8,
           "top_p": 0.9, "seed": 7, "n": 2}


def run_cli(args: list[str]) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "pdserve.cli", *args], capture_output=True, text=True, timeout=900)


def read_results(path) -> dict:
    rows = [json.loads(line) for line in open(path)]
    return {(r["id"], r.get("index")): r for r in rows}


@pytest.fixture(scope="module")
def offline_results(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("offline")
    lines = [dict(r, temperature=0) for r in REQUESTS] + [SAMPLED]
    (tmp / "in.jsonl").write_text("".join(json.dumps(r) + "\n" for r in lines))
    engine_flags = [f for f in WORKER_FLAGS if f not in ("--num-threads", "1")]
    done = run_cli(["generate", "--offline", *engine_flags, "--input", str(tmp / "in.jsonl"),
                    "--output", str(tmp / "out.jsonl")])
    assert done.returncode == 0, done.stderr
    return tmp / "in.jsonl", read_results(tmp / "out.jsonl")


@pytest.mark.parametrize("topology", ["router_1p1d", "router_2p2d"])
def test_cluster_outputs_equal_offline_engine(topology, offline_results, workers, request, tmp_path):
    router = request.getfixturevalue(topology)
    input_path, expected = offline_results
    done = run_cli(["generate", "--url", router.address, "--input", str(input_path),
                    "--output", str(tmp_path / "out.jsonl")])
    assert done.returncode == 0, done.stderr
    got = read_results(tmp_path / "out.jsonl")
    assert got.keys() == expected.keys()
    for key, want in expected.items():
        assert got[key]["token_ids"] == want["token_ids"], key
        assert got[key]["text"] == want["text"], key
        assert got[key]["finish_reason"] == want["finish_reason"], key
        assert got[key]["usage"]["completion_tokens"] == want["usage"]["completion_tokens"], key
    assert got[("stop", None)]["finish_reason"] in ("stop_string", "length")
    # the long prompt's pull (25 blocks, 18 MB) is large enough to time the link (router/link_estimate.py)
    pulls = [worker_stats(w.address) for w in workers["decode"]]
    assert sum(s.kv_pull_bytes for s in pulls) >= LINK_SAMPLE_BYTES
    assert all(s.kv_pull_seconds > 0 and s.kv_pull_bytes % s.kv_block_bytes == 0 for s in pulls if s.kv_pull_bytes)
    assert got[("one", None)]["usage"]["completion_tokens"] == 1
    assert_no_leaks(workers["prefill"] + workers["decode"])


def test_streaming_is_incremental(router_1p1d, workers, smollm2_dir):
    from engine.tokenizer import Tokenizer

    stub = generation_stub(router_1p1d.address)
    request = generate_pb2.GenerateRequest(request_id="stream-me", text="Write a long essay about the ocean.",
                                           params=generate_pb2.SamplingParams(temperature=0, max_tokens=128,
                                                                              ignore_eos=True))
    start = time.perf_counter()
    arrivals, text, token_ids, complete = [], "", [], None
    for msg in stub.Generate(request, timeout=300):
        assert msg.request_id == "stream-me"
        if msg.HasField("chunk"):
            arrivals.append(time.perf_counter() - start)
            text += msg.chunk.text
            token_ids.extend(msg.chunk.token_ids)
        else:
            complete = msg.complete
    assert len(token_ids) == 128 and complete.usage.completion_tokens == 128
    assert len(arrivals) >= 100  # one chunk per decode step, not one blob
    assert arrivals[0] < 0.2 * arrivals[-1], (arrivals[0], arrivals[-1])
    assert text == Tokenizer(smollm2_dir).decode(token_ids)
    assert_no_leaks(workers["prefill"] + workers["decode"])
