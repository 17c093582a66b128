"""The KV link estimate and the skip-remote-prefill decision it drives (router/link_estimate.py)."""
import asyncio

import pytest

from router.link_estimate import LinkEstimate, remote_prefill_pays
from tests.router.test_worker_selector import HASHES, PROMPT, make

MB = 1 << 20


def test_bandwidth_is_the_growth_of_the_pull_counters_between_polls():
    link = LinkEstimate(alpha=0.5)
    link.observe(0, 0.0)
    assert link.bytes_per_s is None  # one poll is no rate
    link.observe(100 * MB, 0.1)
    assert link.bytes_per_s == pytest.approx(1000 * MB)
    link.observe(100 * MB + 1000, 0.2)  # too few bytes to time: ignored, the base is kept
    assert link.bytes_per_s == pytest.approx(1000 * MB)
    link.observe(200 * MB, 0.6)  # 100 MB more in 0.5 s: 200 MB/s, averaged in with weight 0.5
    assert link.bytes_per_s == pytest.approx(600 * MB, rel=1e-3)
    link.observe(0, 0.0)  # the worker restarted: counters start over, the estimate stays
    link.observe(50 * MB, 1.0)
    assert link.bytes_per_s == pytest.approx(0.5 * 600 * MB + 0.5 * 50 * MB, rel=1e-3)


def test_remote_prefill_pays_while_the_link_outpaces_the_prefill():
    # 36,864 B of KV per token (SmolLM2 bf16) at 1 Gbit/s: 0.29 ms per token
    per_token = 36_864
    assert remote_prefill_pays(per_token, 125e6, prefill_token_s=1e-3)  # prefill 1 ms/token: slower than the link
    assert not remote_prefill_pays(per_token, 125e6, prefill_token_s=1e-4)  # a fast prefill: the link loses
    assert remote_prefill_pays(per_token, None, 1e-4) and remote_prefill_pays(per_token, 125e6, None)


def test_a_slow_link_makes_the_decode_worker_prefill_itself_and_is_probed_again():
    async def scenario():
        pool, _, selector = make(max_requests=100)
        decode, prefill = pool.get("d1:1"), pool.get("p1:1")
        decode.stats.kv_block_bytes = 16 * 36_864
        for w in (pool.get("p1:1"), pool.get("p2:1")):
            w.speed.observe(1000, 1000 * 1e-4)  # 0.1 ms per prompt token, measured
        route = await selector.route(PROMPT, HASHES)
        assert route.remote_prefill  # no pull observed yet: the link is unknown
        selector.release(route)
        decode.link.observe(0, 0.0)
        decode.link.observe(100 * MB, 100 * MB / 125e6)  # pulls ran at 1 Gbit/s: 0.29 ms per token
        routes = [await selector.route(PROMPT, HASHES) for _ in range(decode.link.probe_every)]
        assert [r.skip_reason for r in routes[:-1]] == ["slow_link"] * (decode.link.probe_every - 1)
        assert routes[-1].remote_prefill  # the probe: goes remote to re-measure the link
        for r in routes:
            selector.release(r)
        decode.link.bytes_per_s = 10e9  # the link got faster (10 GB/s: 3.7 us per token)
        assert (await selector.route(PROMPT, HASHES)).remote_prefill
        prefill.speed.token_s = 1e-7  # ... still slower than a very fast prefill on p1
        assert (await selector.route(PROMPT, HASHES)).skip_reason == "slow_link"
        selector.link_aware = False
        assert (await selector.route(PROMPT, HASHES)).remote_prefill
    asyncio.run(scenario())
