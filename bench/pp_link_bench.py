"""Pipeline parallelism across two hosts: decode throughput and ITL of PP=2 over a shaped link against PP=1 on
one host, the bubble measured against (K-1)/(M+K-1), and the activation bytes per step against what TP=2 across
the same link would all-reduce.

Two network namespaces on a bridge (tests/multihost/netns.py) are two 1-core hosts, each a Ray node. A
STRICT_SPREAD placement group puts a benchmark actor on host 1; it runs the engine with one stage there and, with
PP=2, the other stage as a Ray actor on host 2 (`distributed_executor_backend="ray"`, what `serve --pipeline-
across-nodes` runs). Each link profile shapes both veth ends with `tbf` (rate only). Per profile and shape: a batch
of greedy decode sequences, tokens/s and the median/p99 inter-token latency; the bytes each host sent per decode
step (its eth0 counters over the decode steps only, Ray's own traffic included) and the model of what crosses
(hidden states [tokens, hidden] one way, the argmax of each greedy row back: 8 bytes, where whole logits would be
vocab x dtype); and the busy fraction of each stage = PP=K's tokens/s / (K x PP=1's) (each stage runs 1/K of the
layers on a core of its own), so the bubble = 1 - busy, against (K-1)/(M+K-1) with M steps in flight
(`pipeline_microbatches`: 1, one step at a time, and K, the default: each micro-batch is 1/M of the running
sequences). TP=2 across the same link would all-reduce 2 x layers x [tokens, hidden] per step (attention and MLP
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
SHAPES = [(1, 1), (2, 1), (2, 2)]
"""(pipeline stages, steps in flight): one host; two hosts one step at a time; two hosts, a step per stage."""


class Bench:
    """The benchmark actor (host 1, bundle 0): one engine per shape, a decode batch each."""

    def run(self, model: str, pp: int, microbatches: int, batch: int, prompt_len: int, max_tokens: int) -> dict:
        import torch

        from engine.config import CacheConfig, EngineConfig, SchedulerConfig
        from engine.llm_engine import LLMEngine
        from engine.sampling_params import SamplingParams
        torch.set_num_threads(1)  # one core per host
        engine = LLMEngine(EngineConfig(model=model, pipeline_parallel_size=pp, distributed_executor_backend="ray",
                                        pipeline_microbatches=microbatches,
                                        cache=CacheConfig(num_blocks=batch * (prompt_len + max_tokens) // 16 + 64),
                                        scheduler=SchedulerConfig(max_num_seqs=batch)))
        try:
            params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
            prompts = [[(7 * i + j) % 5000 + 100 for j in range(prompt_len)] for i in range(batch)]
            engine.generate(prompts[:2], SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True))  # warm
            for i, p in enumerate(prompts):
                engine.add_request(f"r{i}", p, params)
            last: dict[str, float] = {}
            while len(last) < batch:  # prefill every prompt first: then time decode only
                for delta in engine.step():
                    last[delta.request_id] = time.perf_counter()
            link = link_bytes()
            start, tokens, gaps, steps, decoded = time.perf_counter(), 0, [], 0, set()
            while engine.has_unfinished():
                deltas = engine.step()
                now = time.perf_counter()
                steps += 1
                for delta in deltas:
                    tokens += len(delta.token_ids)
                    if delta.request_id in decoded:  # (a first decode gap spans the other micro-batch's prefill)
                        gaps.append(now - last[delta.request_id])
                    decoded.add(delta.request_id)
                    last[delta.request_id] = now
            config, dtype = engine.model_config, engine.runner.dtype
            sent, received = (after - before for after, before in zip(link_bytes(), link, strict=True))
            return {"wall_s": time.perf_counter() - start, "tokens": tokens, "itl": gaps, "steps": steps,
                    "host1_bytes_per_step": sent / steps, "host2_bytes_per_step": received / steps,
                    "hidden": config.hidden_size, "vocab": config.vocab_size, "layers": config.num_layers,
                    "dtype_bytes": torch.empty((), dtype=dtype).element_size()}
        finally:
            engine.shutdown()


def link_bytes() -> tuple[int, int]:
    """(sent, received) bytes of this host's link: its namespace's eth0 (this process runs inside it)."""
    def read(kind: str) -> int:
        with open(f"/sys/class/net/eth0/statistics/{kind}_bytes") as f:
            return int(f.read())
    return read("tx"), read("rx")


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
    for pp, microbatches in SHAPES:
        sys.stdin.readline()  # the parent has read the link counters
        out[f"{pp}x{microbatches}"] = ray.get(bench.run.remote(args.model, pp, microbatches, args.batch,
                                                               args.prompt_len, args.max_tokens))
        print(json.dumps({"pp": pp, "microbatches": microbatches}), flush=True)
    print(json.dumps(out), flush=True)


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
            for _ in SHAPES:
                proc.stdin.write("go\n")
                proc.stdin.flush()
                json.loads(proc.stdout.readline())
            runs = json.loads(proc.stdout.readline())
            proc.wait(120)
            profile = results["profiles"][label] = {}
            rate1 = runs["1x1"]["tokens"] / runs["1x1"]["wall_s"]
            for (pp, microbatches), key in ((shape, f"{shape[0]}x{shape[1]}") for shape in SHAPES):
                run = runs[key]
                itl = sorted(run["itl"])
                rate = run["tokens"] / run["wall_s"]
                busy = rate / (pp * rate1)  # each stage runs 1/pp of the layers on a core of its own
                per_step = args.batch / microbatches  # decode rows per step
                hidden_bytes = per_step * run["hidden"] * run["dtype_bytes"]
                crossing = (hidden_bytes, 8 * per_step) if pp > 1 else (0, 0)  # greedy rows: the argmax crosses
                tp_bytes = 2 * run["layers"] * hidden_bytes
                profile[key] = {"pp": pp, "microbatches": microbatches, "tokens_per_s": rate,
                               "itl_median_s": statistics.median(itl), "itl_p99_s": itl[int(0.99 * (len(itl) - 1))],
                               "busy": busy, "bubble": 1 - busy,
                               "bubble_formula": (pp - 1) / (microbatches + pp - 1),
                               "host1_bytes_per_step": run["host1_bytes_per_step"],
                               "host2_bytes_per_step": run["host2_bytes_per_step"],
                               "model_forward_bytes_per_step": crossing[0], "model_back_bytes_per_step": crossing[1],
                               "tp2_allreduce_bytes_per_step": tp_bytes, "logits_row_bytes": run["vocab"] *
                               run["dtype_bytes"]}
                rows.append((label, f"{pp} x {microbatches}", profile[key]))
    finally:
        for host in (2, 1):
            hosts.kill_all(host)
        hosts.close()
    print(f"Decode of {args.batch} sequences ({args.prompt_len}-token prompts, {args.max_tokens} tokens), "
          f"{os.path.basename(model)}, one core per host; PP=2 stage 1 on host 2 over the link")
    print(f"{'link':<20} {'PP x M':>6} {'tok/s':>8} {'ITL p50 ms':>11} {'ITL p99 ms':>11} {'bubble':>7} "
          f"{'(K-1)/(M+K-1)':>14} {'h1->h2 B/step':>14} {'model':>7} {'h2->h1 B/step':>14} {'model':>6} "
          f"{'TP=2 AR B/step':>15}")
    for label, pp, r in rows:
        print(f"{label:<20} {pp:>6} {r['tokens_per_s']:>8.1f} {r['itl_median_s'] * 1e3:>11.1f} "
              f"{r['itl_p99_s'] * 1e3:>11.1f} {r['bubble']:>7.2f} {r['bubble_formula']:>14.2f} "
              f"{r['host1_bytes_per_step']:>14,.0f} {r['model_forward_bytes_per_step']:>7,.0f} "
              f"{r['host2_bytes_per_step']:>14,.0f} {r['model_back_bytes_per_step']:>6,.0f} "
              f"{r['tp2_allreduce_bytes_per_step']:>15,.0f}")
    os.makedirs(os.path.dirname(args.json) or ".", exist_ok=True)
    with open(args.json, "w") as f:
        json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
