"""KV cache tiers through the cluster: workers restarted with the same --kv-offload-dir find their disk tier
again, announce it to the router (KV events with medium "disk") and serve a returning prompt's prefix from it."""
import random
import time

import pytest

from tests.cluster.harness import (
    assert_no_leaks,
    free_port,
    generate_routed,
    metric_value,
    start_cluster,
    stop_all,
    wait_until_idle,
)


@pytest.mark.slow  # a long scenario: `make test-fast` leaves it out
def test_restarted_workers_serve_a_prefix_from_their_disk_tier(tmp_path, tiny_qwen2_dir):
    rng = random.Random(7)
    prompt = [rng.randrange(1000, 40000) for _ in range(200)]  # 12 full blocks
    ports = {"prefill": free_port(), "decode": free_port()}
    # the tiers, not the model's tokens, are the point: the tiny checkpoint loads and prefills faster
    tiers = {role: ["--model", str(tiny_qwen2_dir), "--kv-offload-cpu-gib", "0.05",
                    "--kv-offload-dir", str(tmp_path / role), "--kv-offload-disk-gib", "0.2",
                    "--metrics-port", str(ports[role])]
             for role in ("prefill", "decode")}
    prefill, decode, router = start_cluster([["prefill", *tiers["prefill"]], ["decode", *tiers["decode"]]])
    try:
        first = generate_routed(router, prompt, max_tokens=6)
        assert first["cached"] == 0
        wait_until_idle([prefill.address, decode.address])
        for worker in (prefill, decode):  # the device pools are gone; the disk files stay
            worker.stop()
            worker.restart()
        disk_blocks, healthy, url = 0.0, 0.0, router.metrics_url
        for _ in range(100):  # the router resyncs from the restarted workers' snapshots and polls them back
            disk_blocks = sum(metric_value(url, "pdserve:kv_index_blocks", worker=w.address, medium="disk") or 0
                              for w in (prefill, decode))
            healthy = sum(metric_value(url, "pdserve:worker_healthy", worker=w.address) or 0 for w in (prefill, decode))
            if disk_blocks >= 24 and healthy == 2:
                break
            time.sleep(0.2)
        assert disk_blocks >= 24  # both workers announced the prompt's 12 blocks on disk
        assert healthy == 2  # and are back in rotation (the index can resync before the next health poll)
        again = generate_routed(router, prompt, max_tokens=6)
        assert again["tokens"] == first["tokens"]
        assert again["cached"] == 192  # every full block but none computed again
        hits = sum(metric_value(f"http://127.0.0.1:{ports[role]}/metrics", "pdserve:kv_tier_hits_total",
                                medium="disk") or 0 for role in ("prefill", "decode"))
        assert hits >= 12
        assert_no_leaks([prefill, decode])
    finally:
        stop_all([router, prefill, decode])
