"""A prefill worker whose two pipeline stages run on two hosts (`pdserve serve --pipeline-across-nodes`), its
decode worker on a third: hosts 2 and 3 declare the prefill pool, host 1 (the head) the decode pool.

The worker's placement group puts one stage on each prefill host; the stage on the other host joins over TCP
at the worker's node address and serves the KV of its layers from a sender of its own, so the decode worker on
host 1 pulls each layer range over its own host's link (`pdserve:kv_transfer_stage_bytes`, by stage and
host). Greedy output equals the offline engine's; nothing is left held. Then the second stage's host dies: the
worker leaves rotation (a request is served by the decode worker prefilling itself, or fails UNAVAILABLE, by
the usual rules); the host comes back: Ray places the stage there again and the worker is back in rotation,
serving the same output through both hosts.
"""
from __future__ import annotations

import json
import re
import subprocess
import sys

import pytest

from tests.cluster.test_serve import with_model
from tests.multihost.conftest import PROBE
from tests.multihost.test_node_loss import healthy_workers, wait_for
from tests.multihost.test_ray_across_hosts import PROMPT, metric_text_value

ROUTER_PORT, METRICS_PORT = 50063, 9463
REQUEST = {"id": "pp", "prompt": PROMPT, "temperature": 0, "max_tokens": 12, "ignore_eos": True}


@pytest.fixture
def pp_hosts(ray_clusters):
    """Hosts 2 and 3 declare the prefill pool, host 1 (the head) the decode pool. (This module runs after the
    others of the package, which share the cluster of tests/multihost/conftest.py POOLS.)"""
    return ray_clusters.get({1: "decode", 2: "prefill", 3: "prefill"})


def stage_bytes(metrics: str) -> dict[tuple[str, str], float]:
    """`pdserve:kv_transfer_stage_bytes` by (stage, host)."""
    found = {}
    for labels, value in re.findall(r"^pdserve:kv_transfer_stage_bytes_total\{([^}]*)\} (\S+)$", metrics, re.MULTILINE):
        named = dict(re.findall(r'(\w+)="([^"]*)"', labels))
        found[(named["stage"], named["host"])] = float(value)
    return found


@pytest.mark.slow  # a long scenario: `make test-fast` leaves it out
@pytest.mark.timeout(1200)
def test_prefill_stages_on_two_hosts_serve_their_layers_and_the_worker_is_replaced_with_a_lost_stage(
        pp_hosts, tmp_path, tiny_qwen2_dir):
    hosts, env, head = pp_hosts.hosts, pp_hosts.env, pp_hosts.head
    (tmp_path / "in.jsonl").write_text(json.dumps(REQUEST) + "\n")
    flags = with_model(tiny_qwen2_dir)

    def generate(name: str) -> subprocess.CompletedProcess:
        return hosts.run(1, [sys.executable, "-m", "pdserve.cli", "generate", "--url", f"{head}:{ROUTER_PORT}",
                             "--input", str(tmp_path / "in.jsonl"), "--output", str(tmp_path / name)],
                         timeout=300, env=env, capture_output=True, text=True)

    def result(name: str) -> dict:
        [line] = (tmp_path / name).read_text().splitlines()
        return json.loads(line)

    def probe(url: str) -> str:
        return hosts.run(1, [*PROBE, url], timeout=60, capture_output=True, text=True).stdout

    offline = hosts.run(1, [sys.executable, "-m", "pdserve.cli", "generate", "--offline",
                            *[f for f in flags if f not in ("--num-threads", "1")], "--input",
                            str(tmp_path / "in.jsonl"), "--output", str(tmp_path / "offline.jsonl")],
                        timeout=600, env=env, capture_output=True, text=True)
    assert offline.returncode == 0, offline.stderr[-2000:]
    want = result("offline.jsonl")
    with pp_hosts.serve("--prefill", "1", "--decode", "1", "--prefill-pipeline-parallel-size", "2",
                        "--pipeline-across-nodes", "--host", head, "--port", str(ROUTER_PORT), "--metrics-port",
                        str(METRICS_PORT), "--health-interval-s", "0.5", *flags) as output:
        workers = next(line for line in output if line.startswith("workers:"))
        prefill = re.search(r"prefill (\S+):\d+", workers).group(1)
        assert prefill in hosts.addresses[1:] and re.search(rf"decode {re.escape(head)}:\d+", workers), workers
        other = next(a for a in hosts.addresses[1:] if a != prefill)  # the second stage's host

        # 1. served through both stages, each layer range from its own host
        first = generate("first.jsonl")
        assert first.returncode == 0, first.stderr[-2000:] + "".join(output[-40:])
        have = result("first.jsonl")
        assert have["token_ids"] == want["token_ids"] and have["text"] == want["text"]
        [prefill_url] = re.findall(r"prefill worker metrics at (\S+)", "".join(output))
        per_stage = stage_bytes(probe(prefill_url))
        assert set(per_stage) == {("0", prefill), ("1", other)}, per_stage
        assert per_stage[("0", prefill)] == per_stage[("1", other)] > 0  # one layer each: the same bytes
        router = f"http://{head}:{METRICS_PORT}/metrics"
        [address] = healthy_workers(probe(router), "prefill")

        def nothing_held() -> bool:
            metrics = probe(router)
            return [metric_text_value(metrics, name, role=role) for role in ("prefill", "decode")
                    for name in ("pdserve:worker_kv_blocks_used", "pdserve:worker_num_requests")] == [0.0] * 4
        wait_for("every worker idle", nothing_held, 30, output)

        # 2. the second stage's host dies: the worker fails what it holds, leaves rotation and is restarted
        host_of_stage = hosts.addresses.index(other) + 1
        assert hosts.kill_all(host_of_stage)
        second = generate("second.jsonl")  # the step that finds the stage gone, or the decode worker alone
        assert second.returncode == 0 or "UNAVAILABLE" in second.stderr, second.stderr[-2000:]
        if second.returncode == 0:
            assert result("second.jsonl")["token_ids"] == want["token_ids"]
        wait_for("the prefill worker out of rotation",
                 lambda: healthy_workers(probe(router), "prefill").get(address, 0.0) == 0.0, 120, output)

        # 3. the host is back: Ray places the stage there again, and the restarted worker serves
        pp_hosts.start_node(host_of_stage, temp_name=f"h{host_of_stage}-again", attempts=3)
        wait_for("the prefill worker back in rotation",
                 lambda: healthy_workers(probe(router), "prefill").get(address, 0.0) == 1.0, 420, output)
        third = generate("third.jsonl")
        assert third.returncode == 0, third.stderr[-2000:] + "".join(output[-40:])
        assert result("third.jsonl")["token_ids"] == want["token_ids"]
        assert set(stage_bytes(probe(prefill_url))) == {("0", prefill), ("1", other)}
        wait_for("every worker idle", nothing_held, 30, output)
