"""Micro-benchmark: what a cluster token costs per router -> worker call (issue 35).

Times, for Decode requests of --prompt-lens tokens, the router's side (serialize the request once
more for its body digest, mint the token) and the worker's side (check method, audience, time and
MAC from the metadata; replay guard; hash the received bytes), against the same steps of a token
bound to its method only (the pre-issue-35 scheme: one HMAC each side), side by side in one run.

  PYTHONPATH=. .venv/bin/python bench/auth_token_cost.py [--output bench/results/auth_token_cost.json]
"""
from __future__ import annotations

import argparse
import hashlib
import hmac
import json
import secrets
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from common.cluster_auth import ClusterKeys, tokens  # noqa: E402
from common.protocol import generate_pb2, worker_pb2  # noqa: E402

METHOD = "/pdserve.v1.Worker/Decode"
WORKER = "10.0.0.7:7002"
NAMES = (WORKER, "pdserve-decode:7002")  # the advertised address first, as on a worker


def bound(key: bytes, request) -> None:
    """Today's token, both sides: mint for worker + body, check from metadata, then the body's digest."""
    body = request.SerializeToString()
    token = tokens.mint(key, METHOD, WORKER, body)
    claim = tokens.check(key, METHOD, NAMES, token)
    assert claim is not None and hmac.compare_digest(tokens.body_digest(body), claim.body_digest)


def method_only(key: bytes, request) -> None:
    """The baseline: HMAC(method | time | nonce) minted and checked, the body not covered."""
    ts, nonce = str(int(time.time())), secrets.token_hex(8)
    mac = hmac.new(key, f"{METHOD}\n{ts}\n{nonce}".encode(), hashlib.sha256).hexdigest()
    again = hmac.new(key, f"{METHOD}\n{ts}\n{nonce}".encode(), hashlib.sha256).hexdigest()
    assert hmac.compare_digest(mac, again)


def per_call_us(fn, key: bytes, request, seconds: float) -> float:
    calls, start = 0, time.perf_counter()
    while (elapsed := time.perf_counter() - start) < seconds:
        for _ in range(50):
            fn(key, request)
        calls += 50
    return elapsed / calls * 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--prompt-lens", default="128,2048,8192,32768")
    parser.add_argument("--seconds", type=float, default=1.0, help="time spent per cell")
    parser.add_argument("--output", default="bench/results/auth_token_cost.json")
    args = parser.parse_args()
    key = ClusterKeys.from_secret(secrets.token_bytes(32)).grpc
    rows = []
    print(f"{'prompt tokens':>13} {'request bytes':>13} {'method-only us':>14} {'bound us':>9} {'extra us':>9}")
    for n in map(int, args.prompt_lens.split(",")):
        request = worker_pb2.DecodeRequest(request_id="bench", prompt_token_ids=[(i * 7919) % 150000 for i in range(n)],
                                           params=generate_pb2.SamplingParams(max_tokens=128))
        base = per_call_us(method_only, key, request, args.seconds)
        now = per_call_us(bound, key, request, args.seconds)
        rows.append({"prompt_tokens": n, "request_bytes": request.ByteSize(), "method_only_us": round(base, 2),
                     "bound_us": round(now, 2), "extra_us": round(now - base, 2)})
        print(f"{n:>13} {request.ByteSize():>13} {base:>14.1f} {now:>9.1f} {now - base:>9.1f}")
    Path(args.output).parent.mkdir(parents=True, exist_ok=True)
    Path(args.output).write_text(json.dumps({"rows": rows}, indent=2) + "\n")


if __name__ == "__main__":
    main()
