"""Remote prefill over a slow link: the router's link-aware skip against always-remote and co-located.

Two network namespaces on a bridge (tests/multihost/netns.py): host 1 runs the prefill worker and the
routers, host 2 the decode worker; the link between them is shaped (`tc` tbf, or netem with a delay
where the kernel has it). Three routers over the same workers, measured one after the other, each
with its own prompts (distinct random token ids, so no prefix-cache hit anywhere):

- `always-remote`: `--no-link-aware-prefill`: every prompt is prefilled on host 1 and its KV crosses
  the link;
- `link-aware`: the default: once the router has seen the decode worker's pulls (its stats'
  `kv_pull_bytes` / `kv_pull_seconds`) and timed the prefill worker, it skips remote prefill when a
  token's KV would move slower than it is prefilled (one prompt in 16 still goes remote, a probe);
- `co-located`: a router with no prefill worker: the decode worker prefills everything.

The workers use the TCP backend: on one machine UCX (NIXL) and the shared staging buffers see
through network namespaces (same kernel, same boot id), and would move the KV through memory,
not across the shaped veth.

Requests go one at a time (TTFT is then prefill + transfer, not queueing), after 2 unmeasured warm-up
requests per router (which also give the link-aware router its first timings). Reported per router, as
medians: TTFT, the time to the second token and end to end, how many samples were prefilled remotely,
and the router's skip counters. With remote prefill the router streams the first token as soon as the
prefill worker returns it, so the KV transfer shows in the second token, not in TTFT.

    PYTHONPATH=. .venv/bin/python bench/link_aware_prefill.py --rates 20mbit 1gbit --requests 12 --prompt-len 512
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import threading
import time
import uuid

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
WARMUP = 2
ENGINE = ["--model", "default", "--dtype", "bfloat16", "--kv-cache-memory-gib", "0.5", "--num-threads", "1",
          "--kv-transfer-backend", "tcp"]


def client(address: str, prompts: list[list[int]], max_tokens: int) -> None:
    """Host 1: the requests one by one; prints [{ttft_s, e2e_s, remote}] as JSON."""
    import grpc

    from common.client import build_request
    from common.protocol import generate_pb2_grpc
    from engine.sampling_params import SamplingParams
    stub = generate_pb2_grpc.GenerationStub(grpc.insecure_channel(address))
    rows = []
    for i, prompt in enumerate(prompts):
        start = time.perf_counter()
        token_times = []
        call = stub.Generate(build_request(uuid.uuid4().hex, SamplingParams(temperature=0, max_tokens=max_tokens,
                                                                            ignore_eos=True), token_ids=prompt),
                             timeout=600)
        for msg in call:
            if msg.HasField("chunk"):
                token_times += [time.perf_counter() - start] * len(msg.chunk.token_ids)
        meta = dict(call.trailing_metadata())
        if i < WARMUP:
            continue  # the first calls warm the workers' code paths (and give routers their first timings)
        rows.append({"ttft_s": token_times[0], "second_token_s": token_times[1], "e2e_s": time.perf_counter() - start,
                     "remote": meta.get("pdserve-prefill-worker", "-") != "-"})
    print(json.dumps(rows), flush=True)


def start(hosts, host: int, args: list[str], env: dict) -> tuple[subprocess.Popen, str]:
    """`pdserve ARGS` in namespace `host`; waits for its `ready: ... at ADDRESS` line."""
    proc = hosts.popen(host, [sys.executable, "-m", "pdserve.cli", *args], env=env, stdout=subprocess.PIPE,
                       stderr=subprocess.STDOUT, text=True)
    lines = []
    for line in proc.stdout:
        lines.append(line)
        if line.startswith("ready:"):
            threading.Thread(target=lambda: [None for _ in proc.stdout], daemon=True).start()
            return proc, line.rsplit(" at ", 1)[1].strip()
    raise RuntimeError(f"pdserve {args[0]} did not start:\n{''.join(lines[-30:])}")


def router_link(hosts, metrics_url: str) -> dict:
    """The router's remote-prefill skips by reason, from its /metrics (read inside host 1)."""
    done = hosts.run(1, [sys.executable, "-c", f"import urllib.request;print(urllib.request.urlopen("
                                               f"'{metrics_url}').read().decode())"],
                     timeout=30, capture_output=True, text=True)
    skipped = {}
    for line in done.stdout.splitlines():
        if line.startswith("pdserve:remote_prefill_skipped_total{"):
            reason = line.split('reason="', 1)[1].split('"', 1)[0]
            skipped[reason] = float(line.rsplit(" ", 1)[1])
    return skipped


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--role", choices=["client"], help=argparse.SUPPRESS)
    ap.add_argument("--address", help=argparse.SUPPRESS)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--rates", nargs="+", default=["20mbit", "1gbit"], help="link rates (tc syntax: 100mbit, 1gbit)")
    ap.add_argument("--delay", default="0.5ms", help="one-way delay (netem only)")
    ap.add_argument("--requests", type=int, default=24, help="per router")
    ap.add_argument("--prompt-len", type=int, default=512)
    ap.add_argument("--max-tokens", type=int, default=8)
    ap.add_argument("--json", default="bench/results/link_aware_prefill.json")
    args = ap.parse_args()
    import random
    rng = random.Random(args.seed)
    configs = ["always-remote", "link-aware", "co-located"]
    prompts = {c: [[1000 + 300 * i + k] + [rng.randrange(1000, 40000) for _ in range(args.prompt_len - 1)]
                   for i in range(WARMUP + args.requests)] for k, c in enumerate(configs)}
    if args.role == "client":
        config = sys.stdin.readline().strip()
        return client(args.address, prompts[config], args.max_tokens)

    from bench.kv_link_netem import shape
    from tests.multihost.netns import Hosts
    env = dict(os.environ, PYTHONPATH=REPO)
    hosts = Hosts(2)
    a, b = hosts.addresses
    results, rows = {}, []
    try:
        _, prefill = start(hosts, 1, ["prefill-worker", *ENGINE, "--host", a, "--kv-transfer-host", a], env)
        _, decode = start(hosts, 2, ["decode-worker", *ENGINE, "--host", b, "--kv-transfer-host", b], env)
        for n, rate in enumerate(args.rates):
            delayed = shape(hosts, rate, args.delay)
            link = f"{rate}" + (f", {args.delay} each way (netem)" if delayed else " (tbf, no delay)")
            measure_link(hosts, env, args, configs, prefill, decode, link, n, results, rows)
    finally:
        hosts.close()
    kv_mb = args.prompt_len * 30 * 2 * 3 * 64 * 2 / 1e6
    print(f"Remote prefill over a shaped link: SmolLM2-135M bf16, {args.requests} requests per router one at a "
          f"time, {args.prompt_len}-token prompts ({kv_mb:.1f} MB of KV each), {args.max_tokens} output tokens")
    print(f"{'link':<24} {'router':<14} {'TTFT p50 ms':>12} {'2nd token p50 ms':>17} {'E2E p50 ms':>11} "
          f"{'remote':>7}  skipped")
    for link, config, r in rows:
        print(f"{link:<24} {config:<14} {r['ttft_p50_s'] * 1e3:>12.0f} {r['second_token_p50_s'] * 1e3:>17.0f} "
              f"{r['e2e_p50_s'] * 1e3:>11.0f} {r['remote']:>4}/{args.requests}  {r['skipped']}")
    os.makedirs(os.path.dirname(args.json) or ".", exist_ok=True)
    with open(args.json, "w") as f:
        json.dump({"args": vars(args), "cpus": os.cpu_count(), "links": results}, f, indent=1)
    print(f"wrote {args.json}")


def measure_link(hosts, env, args, configs, prefill, decode, link, n, results, rows) -> None:
    """The three routers in turn over the workers, on the link as shaped now (prompts of their own seed)."""
    a = hosts.addresses[0]
    for i, config in enumerate(configs):
        port = 47100 + 10 * n + i
        metrics = f"http://{a}:{port}/metrics"
        flags = {"always-remote": ["--no-link-aware-prefill"], "link-aware": [], "co-located": []}[config]
        router, address = start(hosts, 1, [
            "router", "--host", a, "--port", "0", "--route-metadata", "--health-interval-s", "0.5",
            "--metrics-port", str(port), "--prefill-workers", "" if config == "co-located" else prefill,
            "--decode-workers", decode, *flags], env)
        done = hosts.run(1, [sys.executable, os.path.abspath(__file__), "--role", "client", "--address", address,
                             "--seed", str(args.seed + 100 * n), "--requests", str(args.requests),
                             "--prompt-len", str(args.prompt_len), "--max-tokens", str(args.max_tokens)],
                         timeout=3600, env=env, input=config + "\n", capture_output=True, text=True)
        if done.returncode != 0:
            raise RuntimeError(done.stderr[-3000:])
        samples = json.loads(done.stdout.strip().splitlines()[-1])
        skipped = router_link(hosts, metrics)
        router.terminate()
        router.wait(60)
        res = results.setdefault(link, {})[config] = {
            **{f"{key}_p50_s": statistics.median(s[f"{key}_s"] for s in samples)
               for key in ("ttft", "second_token", "e2e")},
            "remote": sum(s["remote"] for s in samples), "skipped": skipped, "samples": samples}
        rows.append((link, config, res))


if __name__ == "__main__":
    main()
