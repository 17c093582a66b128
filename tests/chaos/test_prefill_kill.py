"""Chaos scenario 2: a prefill worker SIGKILLed while it holds prompts (being prefilled, or their KV
leased to decode workers that are pulling it). Each sample is retried: an unanswered Prefill on the
other prefill worker, a failed KV pull by recomputing the prompt on the decode worker. Every stream
completes with the offline engine's greedy tokens; nothing stays held anywhere."""
from __future__ import annotations

import random
import time

import pytest

from engine.sampling_params import SamplingParams
from tests.chaos.test_decode_faults import Stream
from tests.cluster.harness import assert_no_leaks, worker_stats

pytestmark = pytest.mark.usefixtures("workers_restored")

MAX_TOKENS = 8
GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
rng = random.Random(11)
# Long, distinct prompts (no prefix hits): prefill and transfer take long enough to be caught in.
PROMPTS = [[rng.randrange(3, 49000) for _ in range(rng.randrange(200, 400))] for _ in range(10)]


def holding(cluster, worker) -> int:
    s = worker_stats(worker.address, cluster["secret"], timeout=2)
    return s.num_requests + s.num_leases


def test_killed_prefill_worker_requests_are_retried_and_equal_the_offline_engine(chaos_cluster, offline_engine):
    cluster = chaos_cluster
    expected = [o.completions[0].token_ids for o in offline_engine.generate(PROMPTS, GREEDY)]
    streams = [Stream(cluster["router"], p, GREEDY) for p in PROMPTS]
    victim, held, deadline = None, 0, time.monotonic() + 60
    while victim is None:
        assert time.monotonic() < deadline, "no prefill worker was ever seen holding a prompt"
        for w in cluster["prefill"]:
            held = holding(cluster, w)
            if held:
                victim = w
                break
    victim.kill()
    for s in streams:
        s.join()
    for i, (s, want) in enumerate(zip(streams, expected, strict=True)):
        assert s.code is None, (i, s.code, s.details)
        assert s.tokens == want, i
        assert s.complete.usage.prompt_tokens == len(PROMPTS[i])
    assert held >= 1
    assert_no_leaks([*cluster["prefill"], *cluster["decode"]], secret_file=cluster["secret"])
