"""KV transfer between two hosts over a shaped link: measured time vs the model bytes / bandwidth + RTT.

Two network namespaces on a bridge (tests/multihost/netns.py) stand for a prefill host and a
decode host. The sender (host 1) holds a bf16 SmolLM2-135M KV pool; the receiver (host 2) pulls
the blocks of one prompt with the TCP backend, on an open connection, for several prompt lengths.
Each link profile shapes both veth ends with `tc netem` (rate and one-way delay); on a kernel
without netem (CONFIG_NET_SCH_NETEM unset) with `tbf` (rate only: the delay is then not emulated
and left out of the model, as the table says). Reported per prompt length: KV bytes, median
transfer time, the model `bytes / rate + RTT` (one request/grant round trip, then the stream),
and their ratio. Needs root and iproute2.

    PYTHONPATH=. .venv/bin/python bench/kv_link_netem.py [--json bench/results/kv_link_netem.json]
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

SMOLLM2 = dict(model_id="HuggingFaceTB/SmolLM2-135M-Instruct", block_size=16, num_layers=30, num_kv_heads=3,
               head_dim=64, dtype="bfloat16")
PROFILES = [("veth, no shaping", None, None), ("10 Gbit/s, 0.1 ms each way", "10gbit", "0.1ms"),
            ("1 Gbit/s, 0.5 ms each way", "1gbit", "0.5ms")]
PROMPTS = [128, 512, 2048]
PORT = 47001


def _pool(num_blocks: int):
    from kv_transfer import KVLayout
    layout = KVLayout(**SMOLLM2)
    raw = np.random.default_rng(1).integers(0, 256, num_blocks * layout.block_nbytes, dtype=np.uint8)
    return layout, raw.view(np.uint16).reshape(layout.shape(num_blocks))


def run_sender(host: str, plan: list[tuple[str, list[int]]]) -> None:
    """Host 1: expose each planned transfer, print {tid: capability} and the peer info, serve until stdin closes."""
    from kv_transfer import KVTransferConfig, make_sender
    layout, pool = _pool(max(max(ids) for _, ids in plan) + 1)
    sender = make_sender(pool, layout, KVTransferConfig(backend="tcp", host=host, port=PORT))
    caps = {tid: sender.expect(tid, ids, timeout_s=3600).capability for tid, ids in plan}
    print(json.dumps({"peer_info": sender.peer_info(), "caps": caps}), flush=True)
    sys.stdin.read()
    sender.close()


def run_receiver(peer_info: dict, caps: dict, plan: list[tuple[str, list[int]]]) -> None:
    """Host 2: pull each planned transfer in order, print the seconds each took."""
    from kv_transfer import KVTransferConfig, TransferState, make_receiver
    layout, pool = _pool(max(max(ids) for _, ids in plan) + 1)
    receiver = make_receiver(pool, layout, KVTransferConfig(backend="tcp"))
    times = {}
    for tid, ids in plan:
        t0 = time.perf_counter()
        t = receiver.read(peer_info, tid, ids, ids, timeout_s=600, capability=caps[tid])
        if t.wait(600) != TransferState.DONE:
            raise RuntimeError(f"{tid}: {t.error}")
        times[tid] = time.perf_counter() - t0
    receiver.close()
    print(json.dumps(times), flush=True)


def make_plan(reps: int) -> list[tuple[str, list[int]]]:
    rng = np.random.default_rng(0)
    plan = [("warm", [0])]
    pool_blocks = 2 * max(PROMPTS) // SMOLLM2["block_size"]
    for tokens in PROMPTS:
        n = tokens // SMOLLM2["block_size"]
        plan += [(f"{tokens}-{r}", sorted(rng.choice(pool_blocks, n, replace=False).tolist())) for r in range(reps)]
    return plan


def shape(hosts, rate: str | None, delay: str | None) -> bool:
    """Shape both ends; returns whether the delay is emulated (netem) or only the rate (tbf)."""
    delayed = True
    for name in hosts.names:
        tc = ["ip", "netns", "exec", name, "tc", "qdisc"]
        subprocess.run([*tc, "del", "dev", "eth0", "root"], capture_output=True)
        if not rate:
            continue
        netem = subprocess.run([*tc, "add", "dev", "eth0", "root", "netem", "rate", rate, "delay", delay,
                                "limit", "100000"], capture_output=True, text=True)
        if netem.returncode != 0:  # no netem in this kernel: rate only
            delayed = False
            burst = max(64 << 10, int(_bits_per_s(rate) / 8 / 100))  # 10 ms at the rate
            subprocess.run([*tc, "add", "dev", "eth0", "root", "tbf", "rate", rate, "burst", str(burst),
                            "latency", "50ms"], check=True, capture_output=True)
    return delayed


def _bits_per_s(rate: str) -> float:
    for suffix, scale in (("gbit", 1e9), ("mbit", 1e6), ("kbit", 1e3)):
        if rate.endswith(suffix):
            return float(rate.removesuffix(suffix)) * scale
    raise ValueError(f"rate {rate!r}: expected a number and gbit, mbit or kbit")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--role", choices=["sender", "receiver"], help=argparse.SUPPRESS)
    ap.add_argument("--host", help=argparse.SUPPRESS)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--json", default="bench/results/kv_link_netem.json")
    args = ap.parse_args()
    plan = make_plan(args.reps)
    if args.role == "sender":
        return run_sender(args.host, plan)
    if args.role == "receiver":
        hello = json.loads(sys.stdin.readline())
        return run_receiver(hello["peer_info"], hello["caps"], plan)

    from kv_transfer import KVLayout
    from tests.multihost.netns import Hosts
    block_nbytes = KVLayout(**SMOLLM2).block_nbytes
    me = [sys.executable, os.path.abspath(__file__), "--reps", str(args.reps)]
    env = dict(os.environ, PYTHONPATH=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    hosts = Hosts(2)
    rows, out = [], {"block_nbytes": block_nbytes, "cpus": os.cpu_count(), "profiles": {}}
    try:
        for label, rate, delay in PROFILES:
            delayed = shape(hosts, rate, delay)
            if rate and not delayed:
                label = f"{label.split(',')[0]} (tbf, no delay)"
            sender = hosts.popen(1, [*me, "--role", "sender", "--host", hosts.addresses[0]], env=env, text=True,
                                 stdin=subprocess.PIPE, stdout=subprocess.PIPE)
            hello = sender.stdout.readline()
            done = hosts.run(2, [*me, "--role", "receiver"], timeout=1800, env=env, input=hello, text=True,
                             capture_output=True)
            sender.stdin.close()
            sender.wait(60)
            if done.returncode != 0:
                raise RuntimeError(done.stderr[-3000:])
            times = json.loads(done.stdout.strip().splitlines()[-1])
            rtt = 2 * float(delay.removesuffix("ms")) / 1e3 if delay and delayed else 0.0
            profile = out["profiles"][label] = {}
            for tokens in PROMPTS:
                nbytes = tokens // SMOLLM2["block_size"] * block_nbytes
                median = statistics.median(times[f"{tokens}-{r}"] for r in range(args.reps))
                model = nbytes * 8 / _bits_per_s(rate) + rtt if rate else None
                profile[tokens] = {"bytes": nbytes, "median_s": median, "model_s": model}
                rows.append((label, tokens, nbytes, median, model))
    finally:
        hosts.close()
    print("KV transfer of one prompt between two hosts (network namespaces, TCP backend, bf16 SmolLM2-135M "
          f"blocks of {block_nbytes:,} bytes, open connection, median of {args.reps})")
    print(f"{'link':<28} {'prompt':>7} {'KV MB':>8} {'measured ms':>12} {'model ms':>9} {'measured/model':>15}")
    for label, tokens, nbytes, median, model in rows:
        model_ms = f"{model * 1e3:.1f}" if model else "-"
        ratio = f"{median / model:.2f}" if model else "-"
        print(f"{label:<28} {tokens:>7} {nbytes / 1e6:>8.1f} {median * 1e3:>12.1f} {model_ms:>9} {ratio:>15}")
    os.makedirs(os.path.dirname(args.json) or ".", exist_ok=True)
    with open(args.json, "w") as f:
        json.dump(out, f, indent=1)
    print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
