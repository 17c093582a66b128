"""Node loss and rejoin under `pdserve serve --ray-address` (pdserve/cluster_supervisor.py), across the
three hosts of tests/multihost/conftest.py: with 1 prefill worker on host 2 and 1 decode worker on
host 3, every process of host 3 dies (its raylet and the worker): the router takes the decode worker
out of rotation and a request fails fast UNAVAILABLE; `ray start` on host 3 again: a new decode worker
is placed there, joins the router and serves the same greedy output, and nothing is left held."""
from __future__ import annotations

import json
import re
import subprocess
import sys
import time

import pytest

from tests.cluster.test_serve import with_model
from tests.multihost.conftest import PROBE
from tests.multihost.test_ray_across_hosts import PROMPT, metric_text_value

ROUTER_PORT, METRICS_PORT = 50062, 9462
REQUEST = {"id": "nl", "prompt": PROMPT, "temperature": 0, "max_tokens": 12, "ignore_eos": True}


def healthy_workers(metrics: str, role: str) -> dict[str, float]:
    """`pdserve:worker_healthy` of the router's workers of ``role``, by address."""
    healthy = {}
    for line in metrics.splitlines():
        if line.startswith("pdserve:worker_healthy{") and f'role="{role}"' in line:
            healthy[re.search(r'worker="([^"]+)"', line).group(1)] = float(line.rsplit(" ", 1)[1])
    return healthy


def wait_for(what: str, check, timeout: float, output: list[str]):
    deadline = time.monotonic() + timeout
    while True:
        got = check()
        if got:
            return got
        assert time.monotonic() < deadline, f"not within {timeout:.0f} s: {what}\n" + "".join(output[-40:])
        time.sleep(0.5)


@pytest.mark.slow  # a long scenario: `make test-fast` leaves it out
@pytest.mark.timeout(1200)  # three worker starts, each minutes long on a busy machine
def test_a_lost_decode_node_leaves_rotation_and_its_restart_serves_again(ray_hosts, tmp_path, tiny_qwen2_dir):
    hosts, env, head = ray_hosts.hosts, ray_hosts.env, ray_hosts.head
    decode_ip = hosts.addresses[2]
    (tmp_path / "in.jsonl").write_text(json.dumps(REQUEST) + "\n")

    def generate(name: str) -> tuple[subprocess.CompletedProcess, float]:
        start = time.monotonic()
        done = hosts.run(1, [sys.executable, "-m", "pdserve.cli", "generate", "--url", f"{head}:{ROUTER_PORT}",
                             "--input", str(tmp_path / "in.jsonl"), "--output", str(tmp_path / name)],
                         timeout=300, env=env, capture_output=True, text=True)
        return done, time.monotonic() - start

    def router_metrics() -> str:
        return hosts.run(1, [*PROBE, f"http://{head}:{METRICS_PORT}/metrics"], timeout=60,
                         capture_output=True, text=True).stdout

    def logged(text: str) -> bool:
        return any(text in line for line in output)

    with ray_hosts.serve("--prefill", "1", "--decode", "1", "--host", head, "--port", str(ROUTER_PORT),
                         "--metrics-port", str(METRICS_PORT), "--health-interval-s", "0.5",
                         *with_model(tiny_qwen2_dir)) as output:
        # 1. serving: a greedy request through host 2 (prefill) and host 3 (decode)
        workers = next(line for line in output if line.startswith("workers:"))
        old_decode = re.search(rf"decode ({re.escape(decode_ip)}:\d+)", workers).group(1)
        assert healthy_workers(router_metrics(), "decode") == {old_decode: 1.0}
        first, _ = generate("first.jsonl")
        assert first.returncode == 0, first.stderr[-2000:] + "".join(output[-40:])
        [want] = [json.loads(x) for x in (tmp_path / "first.jsonl").read_text().splitlines()]

        # 2. host 3 dies, raylet and worker: the router takes its decode worker out of rotation at once
        killed_at = time.monotonic()
        assert hosts.kill_all(3), "no process ran on host 3"
        wait_for("the decode worker out of rotation",
                 lambda: healthy_workers(router_metrics(), "decode").get(old_decode, 0.0) == 0.0, 30, output)
        out_after = time.monotonic() - killed_at
        # ... and a request fails fast, UNAVAILABLE, naming the missing pool (no hang)
        failed, failed_s = generate("failed.jsonl")
        assert failed.returncode == 1 and "UNAVAILABLE" in failed.stderr, failed.stderr[-2000:]
        assert "no healthy decode worker" in failed.stderr, failed.stderr[-2000:]
        assert failed_s < 60, failed_s
        # ... and serve notices the node is gone (Ray's health check of the raylet) and waits for one
        wait_for("serve sees the decode node lost", lambda: logged("decode worker " + old_decode + " lost"), 120,
                 output)
        lost_after = time.monotonic() - killed_at
        assert old_decode not in healthy_workers(router_metrics(), "decode")  # dropped from the pool

        # 3. host 3 comes back (a new Ray node, same address and resources): a new decode worker there
        rejoined_at = time.monotonic()
        ray_hosts.start_node(3, temp_name="h3-again", attempts=3)

        def new_decode_in_rotation():
            healthy = healthy_workers(router_metrics(), "decode")
            return [a for a, v in healthy.items() if v == 1.0 and a.startswith(decode_ip + ":")]
        # (the new worker imports and loads the model: ~15 s on an idle 2-core machine, minutes on a busy one)
        [new_decode] = wait_for("a decode worker on host 3 back in rotation", new_decode_in_rotation, 300, output)
        back_after = time.monotonic() - rejoined_at
        assert logged("back in rotation"), "".join(output[-40:])
        second, _ = generate("second.jsonl")
        assert second.returncode == 0, second.stderr[-2000:] + "".join(output[-40:])
        [have] = [json.loads(x) for x in (tmp_path / "second.jsonl").read_text().splitlines()]
        assert have["token_ids"] == want["token_ids"] and have["text"] == want["text"]
        # served by the new worker on host 3: its own metrics count the tokens
        decode_metrics = re.findall(r"decode worker metrics at (\S+)", "".join(output))
        assert len(decode_metrics) == 2 and decode_metrics[-1].startswith(f"http://{decode_ip}:"), decode_metrics
        new_worker = hosts.run(1, [*PROBE, decode_metrics[-1]], timeout=60, capture_output=True, text=True).stdout
        # (the first token comes with the prefill from host 2; the new decode worker made the others)
        assert metric_text_value(new_worker, "pdserve:generation_tokens_total") >= REQUEST["max_tokens"] - 1

        # 4. leak check, through the router's view of every worker it holds now
        def nothing_held() -> bool:
            router = router_metrics()
            return [metric_text_value(router, name, role=role) for role in ("prefill", "decode")
                    for name in ("pdserve:worker_kv_blocks_used", "pdserve:worker_num_requests")] == [0.0] * 4
        wait_for("every worker idle", nothing_held, 30, output)
        print(f"node loss: out of rotation after {out_after:.1f} s, request failed in {failed_s:.1f} s, "
              f"serve saw the node lost after {lost_after:.1f} s; rejoined worker {new_decode} in rotation "
              f"{back_after:.1f} s after `ray start`")
