"""Routing through real workers without Redis: KV events over gRPC place prompts; decode skips tiny prefills."""
from __future__ import annotations

import random

from tests.cluster.harness import assert_no_leaks, worker_stats
from tests.cluster.harness import generate_routed as generate

rng = random.Random(11)


def test_prompts_sharing_a_prefix_go_where_it_is_cached(router_2p2d, workers):
    # 16 cached blocks outweigh a request's load (8 blocks) even if a stale stats poll counts one.
    systems = [[rng.randrange(3, 49000) for _ in range(256)] for _ in range(2)]
    first = [generate(router_2p2d, s + [rng.randrange(3, 49000) for _ in range(48)]) for s in systems]
    for s, placed in zip(systems, first, strict=True):
        # A 48-token new suffix is more than --skip-prefill-tokens (32): remote prefill again,
        # on the worker whose events said it holds the 256-token prefix.
        again = generate(router_2p2d, s + [rng.randrange(3, 49000) for _ in range(48)])
        assert again["prefill"] == placed["prefill"]
        assert again["cached"] == 256
    assert_no_leaks(workers["prefill"] + workers["decode"])


def test_decode_prefills_itself_when_it_holds_almost_all_of_the_prompt(router_1p1d, workers):
    prefill = workers["prefill"][0]
    prompt = [rng.randrange(3, 49000) for _ in range(100)]
    first = generate(router_1p1d, prompt)
    assert first["prefill"] == prefill.address
    before = worker_stats(prefill.address).requests_total
    # The decode worker cached the 96 pulled tokens: 4 uncached < 32, no remote prefill.
    second = generate(router_1p1d, prompt)
    assert second["prefill"] == "-" and second["decode"] == first["decode"]
    assert second["tokens"] == first["tokens"] and second["cached"] == 96
    assert worker_stats(prefill.address).requests_total == before
    assert_no_leaks(workers["prefill"] + workers["decode"])
