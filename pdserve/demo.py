"""`make demo`: start the local cluster (`pdserve serve`), stream chat answers through it, run a short
SLO load test against it, stop it."""
from __future__ import annotations

import asyncio
import os
import re
import signal
import subprocess
import sys
import time

from common.client import build_request, generate_one
from common.grpc_common import insecure_channel
from common.protocol import generate_pb2_grpc
from engine.sampling_params import SamplingParams

PROMPTS = [
    "What is the capital of France?",
    "Give me three tips for staying focused while studying.",
    "Write a haiku about the sea.",
    "Explain in two sentences what a KV cache is in a language model.",
]
SERVE = [sys.executable, "-m", "pdserve.cli", "serve", "--model", "default", "--prefill", "1", "--decode", "1",
         "--port", "0", "--kv-cache-memory-gib", "1"]


def start_cluster() -> tuple[subprocess.Popen, str]:
    print("$ pdserve serve --model default --prefill 1 --decode 1   (Ray places the workers; first run converts "
          "the model and builds the CPU kernel)", flush=True)
    proc = subprocess.Popen(SERVE, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env=dict(os.environ, PYTHONUNBUFFERED="1"))
    for line in proc.stdout:
        if "ready" in line:
            print(line.rstrip(), flush=True)
            return proc, re.search(r"ready: .*? at (\S+)", line).group(1)
    raise SystemExit(f"the cluster did not start (exit {proc.wait()})")


async def ask_all(address: str) -> None:
    params = SamplingParams(temperature=0.0, max_tokens=96)
    async with insecure_channel(address) as channel:
        stub = generate_pb2_grpc.GenerationStub(channel)
        start = time.perf_counter()
        first_token_at: dict[int, float] = {}

        def on_chunk(i: int):
            def show(_index, chunk) -> None:
                first_token_at.setdefault(i, time.perf_counter() - start)
                if i == 0:  # stream the first answer as it arrives
                    sys.stdout.write(chunk.text)
                    sys.stdout.flush()
            return show

        print(f"\n### {PROMPTS[0]}  (streaming; the others run concurrently)", flush=True)
        calls = [generate_one(stub, build_request(str(i), params, messages=[{"role": "user", "content": p}]),
                              on_chunk(i)) for i, p in enumerate(PROMPTS)]
        results = await asyncio.gather(*calls)
        elapsed = time.perf_counter() - start
    print("\n")
    num_tokens = 0
    for i, (prompt, samples) in enumerate(zip(PROMPTS, results, strict=True)):
        num_tokens += len(samples[0].token_ids)
        print(f"### {prompt}   [first token {first_token_at[i] * 1000:.0f} ms]\n{samples[0].text.strip()}\n")
    print(f"{len(PROMPTS)} concurrent requests through router -> prefill -> KV transfer -> decode: "
          f"{num_tokens} tokens in {elapsed:.1f} s")


def load_test(address: str) -> int:
    """A short `pdserve loadtest` (the real command) with CPU-sized SLOs; prints its SLO table."""
    from pdserve.cli import main as pdserve_main
    argv = ["loadtest", "--url", address, "--dataset", "random", "--num-prompts", "20", "--request-rate", "1",
            "--random-input-len", "64", "--random-output-len", "16", "--goodput", "ttft:2000", "tpot:300"]
    print(f"\n$ pdserve {' '.join(argv)}", flush=True)
    return pdserve_main(argv)


def main() -> int:
    proc, address = start_cluster()
    try:
        asyncio.run(ask_all(address))
        load_test(address)
    finally:
        proc.send_signal(signal.SIGINT)
        code = proc.wait(60)
        print(f"cluster stopped (exit {code})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
