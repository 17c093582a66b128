"""`pdserve serve --ray-address` across three hosts under load: TTFT / ITL / TPOT of a real multi-node run.

The harness of tests/multihost/ (network namespaces on a bridge, a Ray cluster with auth tokens): the
Ray head and the router on host 1, a node declaring the prefill pool on host 2, one declaring the
decode pool on host 3; `pdserve serve --ray-address` places one prefill and one decode worker, so
every prompt is prefilled on host 2 and its KV crosses the veth to host 3. `pdserve loadtest` runs on
host 1 against the router and its table is printed as is; its JSON goes to `--json`. Optionally the
veths are shaped first (`--rate`, tbf or netem as bench/kv_link_netem.py does). Needs root, iproute2
and ray.

    PYTHONPATH=. .venv/bin/python bench/multihost_serve.py --request-rate 1 --num-prompts 24
"""
from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

ROUTER_PORT = 50071
ENGINE = ["--model", "default", "--dtype", "bfloat16", "--kv-cache-memory-gib", "0.5"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--request-rate", type=float, default=1.0)
    ap.add_argument("--num-prompts", type=int, default=24)
    ap.add_argument("--input-len", type=int, default=512)
    ap.add_argument("--output-len", type=int, default=64)
    ap.add_argument("--rate", default=None, help="shape the veths to this rate (e.g. 1gbit); default: unshaped")
    ap.add_argument("--kv-transfer-backend", default="tcp",
                    help="tcp (default: the bytes cross the veth; UCX would see through the namespaces)")
    ap.add_argument("--json", default="bench/results/multihost_serve.json")
    args = ap.parse_args()

    from bench.kv_link_netem import shape
    from tests.multihost.conftest import ray_cluster
    with ray_cluster(PYTHONPATH=os.path.dirname(os.path.dirname(os.path.abspath(__file__)))) as cluster:
        hosts = cluster.hosts
        link = "veth, unshaped"
        if args.rate:
            link = f"{args.rate} ({'netem' if shape(hosts, args.rate, '0.1ms') else 'tbf'})"
        with cluster.serve("--prefill", "1", "--decode", "1", "--host", cluster.head, "--port", str(ROUTER_PORT),
                           "--kv-transfer-backend", args.kv_transfer_backend, *ENGINE) as output:
            print("".join(line for line in output if line.startswith("workers:")), end="")
            os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
            done = hosts.run(1, [sys.executable, "-m", "pdserve.cli", "loadtest", "--url",
                                 f"{cluster.head}:{ROUTER_PORT}", "--dataset", "random",
                                 "--random-input-len", str(args.input_len), "--random-output-len", str(args.output_len),
                                 "--num-prompts", str(args.num_prompts), "--request-rate", str(args.request_rate),
                                 "--num-warmups", "2", "--no-progress", "--output", os.path.abspath(args.json)],
                             timeout=3600, env=cluster.env, capture_output=True, text=True)
            print(f"link: {link}; 1 prefill worker on {hosts.addresses[1]}, 1 decode worker on {hosts.addresses[2]}, "
                  f"router on {hosts.addresses[0]}, KV backend {args.kv_transfer_backend}")
            print(done.stdout)
            if done.returncode != 0:
                raise RuntimeError(done.stderr[-3000:])
    print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
