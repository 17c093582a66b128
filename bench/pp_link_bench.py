"""Pipeline parallelism across two hosts: decode throughput and ITL of PP=2 over a shaped link against PP=1 on
one host, the bubble measured against (K-1)/(M+K-1), and the activation bytes per step against what TP=2 across
the same link would all-reduce.

Two network namespaces on a bridge (tests/multihost/netns.py) are two 1-core hosts, each a Ray node. A STRICT_SPREAD
placement group puts a benchmark actor on host 1; it runs the engine with one stage there and, with PP=2, the
other stage as a Ray actor on host 2 (`distributed_executor_backend="ray"`, what `serve --pipeline-across-nodes`
runs). Each link profile shapes both veth ends with `tbf` (rate only). Per profile and shape: a batch of greedy
decode sequences, tokens/s and the median/p99 inter-token latency; the bytes each host sent per decode step (veth
counters, Ray's own traffic included) and the model of what crosses (hidden states [tokens, hidden] one way, the
argmax of each greedy row back: 8 bytes, where whole logits would be vocab x dtype); and the
busy fraction of each stage = PP=1's step time / (K x PP=K's step time) (each stage runs 1/K of the layers), so the
bubble = 1 - busy, against (K-1)/(M+K-1) with M micro-batches in flight (M=1 here: the engine runs one step at a
time). TP=2 across the same link would all-reduce 2 x layers x [tokens, hidden] per step (attention and MLP
outputs; a ring of 2 sends each rank's whole tensor once).

    PYTHONPATH=. .venv/bin/python bench/pp_link_bench.py [--json bench/results/pp_link.json]
"""
from __future__ import annotations

import argparse
import json
import os
import secrets
import statistics
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

PROFILES = [("veth, no shaping", None), ("10 Gbit/s (tbf)", "10gbit"), ("1 Gbit/s (tbf)", "1gbit")]
HEAD_PORT = 6391


class Bench:
    """The benchmark actor (host 1, bundle 0): one engine per shape, a decode batch each."""

    def run(self, model: str, pp: int, batch: int, prompt_len: int, max_tokens: int) -> dict:
        import torch

        from engine.config import CacheConfig, EngineConfig, SchedulerConfig
        from engine.llm_engine import LLMEngine
        from engine.sampling_params import SamplingParams
        torch.set_num_threads(1)  # one core per host
        engine = LLMEngine(EngineConfig(model=model, pipeline_parallel_size=pp, distributed_executor_backend="ray",
                                        cache=CacheConfig(num_blocks=batch * (prompt_len + max_tokens) // 16 + 64),
                                        scheduler=SchedulerConfig(max_num_seqs=batch)))
        try:
            params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
            prompts = [[(7 * i + j) % 5000 + 100 for j in range(prompt_len)] for i in range(batch)]
            engine.generate(prompts[:2], SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True))  # warm
            for i, p in enumerate(prompts):
                engine.add_request(f"r{i}", p, params)
            while engine.scheduler.num_waiting:  # prefill every prompt first: then time decode steps only
                engine.step()
            steps, tokens = [], 0
            while engine.has_unfinished():
                start = time.perf_counter()
                for delta in engine.step():
                    tokens += len(delta.token_ids)
                steps.append(time.perf_counter() - start)
            config, dtype = engine.model_config, engine.runner.dtype
            return {"steps": steps, "tokens": tokens, "hidden": config.hidden_size, "vocab": config.vocab_size,
                    "layers": config.num_layers, "dtype_bytes": torch.empty((), dtype=dtype).element_size()}
        finally:
            engine.shutdown()


def driver(args) -> None:
    """Host 1, in the Ray cluster: the placement group, then each shape on the benchmark actor."""
    import ray
    from ray.util.placement_group import placement_group
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy
    ray.init(address=f"{args.head}:{HEAD_PORT}", log_to_driver=False)
    group = placement_group([{"CPU": 1, "host1": 1}, {"CPU": 1, "host2": 1}], strategy="STRICT_SPREAD")
    ray.get(group.ready(), timeout=120)
    bench = ray.remote(Bench).options(num_cpus=1, scheduling_strategy=PlacementGroupSchedulingStrategy(
        group, placement_group_bundle_index=0)).remote()
    out = {}
    for pp in (1, 2):
        before = int(sys.stdin.readline())  # host 2's veth byte count, read by the parent
        out[pp] = ray.get(bench.run.remote(args.model, pp, args.batch, args.prompt_len, args.max_tokens))
        print(json.dumps({"pp": pp, "before": before}), flush=True)
    print(json.dumps(out), flush=True)


def veth_tx(hosts, host: int) -> int:
    """Bytes the namespace `host` sent (its veth peer's rx on the bridge side)."""
    with open(f"/sys/class/net/{hosts._veths[host - 1]}/statistics/rx_bytes") as f:
        return int(f.read())


def shape(hosts, rate: str | None) -> None:
    from bench.kv_link_netem import _bits_per_s
    for name in hosts.names:
        tc = ["ip", "netns", "exec", name, "tc", "qdisc"]
        subprocess.run([*tc, "del", "dev", "eth0", "root"], capture_output=True)
        if rate:
            burst = max(64 << 10, int(_bits_per_s(rate) / 8 / 100))
            subprocess.run([*tc, "add", "dev", "eth0", "root", "tbf", "rate", rate, "burst", str(burst),
                            "latency", "50ms"], check=True, capture_output=True)


def start_ray(hosts, env: dict, temp: str) -> None:
    ray = os.path.join(os.path.dirname(sys.executable), "ray")
    for host in (1, 2):  # each declares itself: the benchmark's stage 0 on host 1, stage 1 on host 2
        common = ["--num-cpus", "1", "--disable-usage-stats", "--resources", json.dumps({f"host{host}": 1})]
        argv = ([ray, "start", "--head", "--port", str(HEAD_PORT), "--include-dashboard=false"] if host == 1 else
                [ray, "start", "--address", f"{hosts.addresses[0]}:{HEAD_PORT}"])
        done = hosts.run(host, [*argv, "--node-ip-address", hosts.addresses[host - 1], *common, "--temp-dir",
                                f"{temp}/h{host}"], timeout=180, env=env, capture_output=True, text=True)
        if done.returncode != 0:
            raise RuntimeError(f"ray start on host {host}: {done.stderr[-2000:]}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--role", choices=["driver"], help=argparse.SUPPRESS)
    ap.add_argument("--head", help=argparse.SUPPRESS)
    ap.add_argument("--model", default=None, help="checkpoint directory (default: the converted SmolLM2-135M)")
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--prompt-len", type=int, default=64)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--json", default="bench/results/pp_link.json")
    args = ap.parse_args()
    if args.role == "driver":
        return driver(args)

    from engine.model_files import resolve_model_path
    from tests.multihost.netns import Hosts
    model = str(resolve_model_path(args.model or "default"))
    here = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    temp = tempfile.mkdtemp(prefix="pdpp", dir="/tmp")
    env = dict(os.environ, PYTHONPATH=here, RAY_AUTH_MODE="token", RAY_AUTH_TOKEN=secrets.token_hex(32),
               RAY_USAGE_STATS_ENABLED="0")
    hosts = Hosts(2)
    results = {"model": model, "batch": args.batch, "prompt_len": args.prompt_len, "profiles": {}}
    rows = []
    try:
        start_ray(hosts, env, temp)
        for label, rate in PROFILES:
            shape(hosts, rate)
            proc = hosts.popen(1, [sys.executable, os.path.abspath(__file__), "--role", "driver", "--head",
                                   hosts.addresses[0], "--model", model, "--batch", str(args.batch), "--prompt-len",
                                   str(args.prompt_len), "--max-tokens", str(args.max_tokens)],
                               env=env, text=True, stdin=subprocess.PIPE, stdout=subprocess.PIPE)
            sent = {}
            for pp in (1, 2):
                before = [veth_tx(hosts, 1), veth_tx(hosts, 2)]
                proc.stdin.write(f"{before[1]}\n")
                proc.stdin.flush()
                json.loads(proc.stdout.readline())
                sent[pp] = [veth_tx(hosts, h) - before[h - 1] for h in (1, 2)]
            runs = {int(k): v for k, v in json.loads(proc.stdout.readline()).items()}
            proc.wait(120)
            profile = results["profiles"][label] = {}
            step1 = statistics.median(runs[1]["steps"])
            for pp, run in runs.items():
                steps = run["steps"]
                wall = sum(steps)
                median, p99 = statistics.median(steps), sorted(steps)[int(0.99 * (len(steps) - 1))]
                busy = step1 / (pp * median)
                hidden_bytes = args.batch * run["hidden"] * run["dtype_bytes"]
                crossing = (hidden_bytes, 8 * args.batch) if pp > 1 else (0, 0)  # greedy rows: the argmax crosses
                tp_bytes = 2 * run["layers"] * hidden_bytes
                profile[pp] = {"tokens_per_s": run["tokens"] / wall, "itl_median_s": median, "itl_p99_s": p99,
                               "busy": busy, "bubble": 1 - busy, "bubble_formula": (pp - 1) / (1 + pp - 1),
                               "host1_bytes_per_step": sent[pp][0] / len(steps),
                               "host2_bytes_per_step": sent[pp][1] / len(steps),
                               "model_forward_bytes_per_step": crossing[0], "model_back_bytes_per_step": crossing[1],
                               "tp2_allreduce_bytes_per_step": tp_bytes, "logits_row_bytes": run["vocab"] *
                               run["dtype_bytes"]}
                rows.append((label, pp, profile[pp]))
    finally:
        for host in (2, 1):
            hosts.kill_all(host)
        hosts.close()
    print(f"Decode of {args.batch} sequences ({args.prompt_len}-token prompts, {args.max_tokens} tokens), "
          f"{os.path.basename(model)}, one core per host; PP=2 stage 1 on host 2 over the link")
    print(f"{'link':<20} {'PP':>3} {'tok/s':>8} {'ITL p50 ms':>11} {'ITL p99 ms':>11} {'bubble':>7} "
          f"{'(K-1)/(M+K-1)':>14} {'h1->h2 B/step':>14} {'model':>7} {'h2->h1 B/step':>14} {'model':>6} "
          f"{'TP=2 AR B/step':>15}")
    for label, pp, r in rows:
        print(f"{label:<20} {pp:>3} {r['tokens_per_s']:>8.1f} {r['itl_median_s'] * 1e3:>11.1f} "
              f"{r['itl_p99_s'] * 1e3:>11.1f} {r['bubble']:>7.2f} {r['bubble_formula']:>14.2f} "
              f"{r['host1_bytes_per_step']:>14,.0f} {r['model_forward_bytes_per_step']:>7,} "
              f"{r['host2_bytes_per_step']:>14,.0f} {r['model_back_bytes_per_step']:>6,} "
              f"{r['tp2_allreduce_bytes_per_step']:>15,}")
    os.makedirs(os.path.dirname(args.json) or ".", exist_ok=True)
    with open(args.json, "w") as f:
        json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
