"""`pdserve serve --ray-address` across three hosts (network namespaces on a bridge, no default route):
the head and router on host 1, a Ray node declaring the prefill pool on host 2 and one declaring the
decode pool on host 3. Workers land on their pool's node, advertise the address Ray knows the node
by, the KV of a prompt crosses the veth from host 2 to host 3, greedy output equals the offline
engine's, and every worker ends with nothing held."""
from __future__ import annotations

import json
import re
import sys
import time

import pytest

from tests.cluster.test_cluster_outputs import run_cli
from tests.cluster.test_serve import with_model
from tests.multihost.conftest import PROBE

ROUTER_PORT, METRICS_PORT = 50061, 9461
PROMPT = ", ".join(str(i) for i in range(60))  # ~230 tokens: prefilled on host 2, not by the decode worker


@pytest.mark.slow  # a long scenario: `make test-fast` leaves it out
def test_serve_places_pools_on_their_hosts_and_kv_crosses_the_link(ray_hosts, tmp_path, tiny_qwen2_dir):
    hosts, env, head = ray_hosts.hosts, ray_hosts.env, ray_hosts.head
    worker_flags = with_model(tiny_qwen2_dir)  # which model is not the point: the same as offline
    (tmp_path / "in.jsonl").write_text(json.dumps({"id": "mh", "prompt": PROMPT, "temperature": 0, "max_tokens": 12,
                                                   "ignore_eos": True}) + "\n")
    engine_flags = [f for f in worker_flags if f not in ("--num-threads", "1")]
    offline = run_cli(["generate", "--offline", *engine_flags, "--input", str(tmp_path / "in.jsonl"),
                       "--output", str(tmp_path / "offline.jsonl")])
    assert offline.returncode == 0, offline.stderr
    with ray_hosts.serve("--prefill", "1", "--decode", "1", "--host", head, "--port", str(ROUTER_PORT),
                         "--metrics-port", str(METRICS_PORT), *worker_flags) as output:
        workers = next(line for line in output if line.startswith("workers:"))
        # each pool on the node that declares it, at the address Ray knows that node by
        assert re.search(rf"prefill {re.escape(hosts.addresses[1])}:\d+", workers), workers
        assert re.search(rf"decode {re.escape(hosts.addresses[2])}:\d+", workers), workers
        got = hosts.run(1, [sys.executable, "-m", "pdserve.cli", "generate", "--url", f"{head}:{ROUTER_PORT}",
                            "--input", str(tmp_path / "in.jsonl"), "--output", str(tmp_path / "out.jsonl")],
                        timeout=300, env=env, capture_output=True, text=True)
        assert got.returncode == 0, got.stderr[-2000:]
        [want], [have] = ([json.loads(x) for x in (tmp_path / name).read_text().splitlines()]
                          for name in ("offline.jsonl", "out.jsonl"))
        assert have["token_ids"] == want["token_ids"] and have["text"] == want["text"]
        assert have["usage"]["prompt_tokens"] > 200
        metrics = dict(re.findall(r"(prefill|decode) worker metrics at (\S+)", "".join(output)))
        assert set(metrics) == {"prefill", "decode"}
        prefill_metrics = hosts.run(1, [*PROBE, metrics["prefill"]], timeout=60, capture_output=True, text=True)
        assert metric_text_value(prefill_metrics.stdout, "pdserve:prompt_tokens_total") >= 200  # host 2 prefilled
        deadline = time.monotonic() + 30
        while True:  # the leak check, through the router's view of every worker
            router = hosts.run(1, [*PROBE, f"http://{head}:{METRICS_PORT}/metrics"], timeout=60,
                               capture_output=True, text=True).stdout
            held = [metric_text_value(router, name, role=role) for role in ("prefill", "decode")
                    for name in ("pdserve:worker_kv_blocks_used", "pdserve:worker_num_requests")]
            if held == [0.0] * 4:
                break
            assert time.monotonic() < deadline, held
            time.sleep(0.5)


def metric_text_value(text: str, name: str, **labels: str) -> float:
    """The sum of a metric's samples in Prometheus text whose labels include ``labels``."""
    total, found = 0.0, False
    for line in text.splitlines():
        if not line.startswith(name) or line[len(name):len(name) + 1] not in ("{", " "):
            continue
        if all(f'{k}="{v}"' in line for k, v in labels.items()):
            total += float(line.rsplit(" ", 1)[1])
            found = True
    assert found, f"no {name} {labels} in the metrics"
    return total
