"""`pdserve serve`: Ray places the workers, the router answers, SIGINT leaves no process behind."""
from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import grpc
import jsonschema
import psutil
import pytest

from common.protocol import generate_pb2, worker_pb2, worker_pb2_grpc
from tests.cluster.harness import WORKER_FLAGS, free_port, generation_stub, metric_value, start

PERSON = json.loads((Path(__file__).parents[1] / "data/json_schemas.json").read_text())["person"]


def with_model(model_dir) -> list[str]:
    """WORKER_FLAGS with `--model MODEL_DIR` in place of the default model."""
    flags = list(WORKER_FLAGS)
    flags[flags.index("--model") + 1] = str(model_dir)
    return flags


def assert_plaintext_callers_refused(proc, code: grpc.StatusCode) -> None:
    """A caller with neither the cluster secret nor a certificate gets `code` from every worker serve started."""
    line = next(x for x in proc.output if x.startswith("workers:"))
    workers = re.findall(r"(?:prefill|decode) (\S+:\d+)", line)
    assert len(workers) == 2
    for address in workers:
        with grpc.insecure_channel(address) as channel, pytest.raises(grpc.RpcError) as refused:
            worker_pb2_grpc.WorkerStub(channel).GetStats(worker_pb2.StatsRequest(), timeout=10)
        assert refused.value.code() == code


def test_serve_places_workers_with_ray_and_stops_cleanly(tmp_path, tiny_qwen2_dir):
    metrics_port, http_port = free_port(), free_port()
    # The JSON line is the workers' first constraint to compile; on a busy machine that may pass the 10 s default
    # (a stated slack: 120 s)
    proc = start("serve", ["serve", "--prefill", "1", "--decode", "1", "--port", "0", "--metrics-port",
                           str(metrics_port), "--http-port", str(http_port), "--grammar-timeout-s", "120",
                           *with_model(tiny_qwen2_dir)])
    try:
        assert any(f"OpenAI API at http://127.0.0.1:{http_port}/v1" in line for line in proc.output)
        models = json.load(urllib.request.urlopen(f"http://127.0.0.1:{http_port}/v1/models", timeout=30))
        assert [m["id"] for m in models["data"]] == [str(tiny_qwen2_dir)]  # the model the workers serve
        descendants = psutil.Process(proc.popen.pid).children(recursive=True)
        assert len(descendants) >= 3, descendants  # Ray's own processes plus the two worker actors
        lines = [{"id": "a", "messages": [{"role": "user", "content": "Name a color."}], "temperature": 0,
                  "max_tokens": 12},
                 {"id": "b", "prompt": "1, 2, 3,", "temperature": 0, "max_tokens": 8, "ignore_eos": True},
                 {"id": "bad", "prompt": "x", "temperature": -1},
                 {"id": "json", "prompt": "A person:", "json_schema": PERSON, "n": 10, "seed": 3, "temperature": 1.0,
                  "max_tokens": 200},
                 {"id": "pick", "prompt": "Pick one:", "choice": ["red", "green", "light blue"], "temperature": 0}]
        (tmp_path / "in.jsonl").write_text("".join(json.dumps(x) + "\n" for x in lines))
        done = subprocess.run([sys.executable, "-m", "pdserve.cli", "generate", "--url", proc.address, "--stream",
                               "--input", str(tmp_path / "in.jsonl"), "--output", str(tmp_path / "out.jsonl")],
                              capture_output=True, text=True, timeout=300)
        assert done.returncode == 1  # the bad line
        assert "line 3: field 'temperature'" in done.stderr
        out = [json.loads(x) for x in (tmp_path / "out.jsonl").read_text().splitlines()]
        assert [o["id"] for o in out] == ["a", "b"] + ["json"] * 10 + ["pick"], (
            done.stderr[-3000:] + "".join(proc.output[-30:]))  # why a line failed: the client's and serve's words
        for o in out[2:12]:  # structured outputs through serve's 1P1D: every sample validates
            assert o["finish_reason"] == "stop"
            jsonschema.validate(json.loads(o["text"]), PERSON)
        assert out[12]["text"] in ("red", "green", "light blue") and out[12]["finish_reason"] == "stop"
        assert out[1]["usage"]["completion_tokens"] == 8 and out[1]["finish_reason"] == "length"
        streamed = [json.loads(x) for x in done.stdout.splitlines()]
        assert "".join(s["text"] for s in streamed if s["id"] == "b") == out[1]["text"]
        url = f"http://127.0.0.1:{metrics_port}/metrics"
        deadline = time.monotonic() + 10
        while True:  # the contract's leak check: the router's view of every worker
            used = [metric_value(url, "pdserve:worker_kv_blocks_used", role=r) for r in ("prefill", "decode")]
            held = [metric_value(url, "pdserve:worker_num_requests", role=r) for r in ("prefill", "decode")]
            if used == [0.0, 0.0] and held == [0.0, 0.0]:
                break
            assert time.monotonic() < deadline, (used, held)
            time.sleep(0.3)
        # Each worker serves its own metrics; decode generated b's 7 tokens after the first at least.
        worker_metrics = dict(re.findall(r"(prefill|decode) worker metrics at (\S+)", "".join(proc.output)))
        assert metric_value(worker_metrics["decode"], "pdserve:generation_tokens_total", role="decode") >= 7
        assert metric_value(worker_metrics["prefill"], "pdserve:prompt_tokens_total", role="prefill") > 0
        # Internal links are authenticated by default: a caller without the generated secret is refused.
        assert_plaintext_callers_refused(proc, grpc.StatusCode.UNAUTHENTICATED)
    finally:
        code = proc.stop(signal.SIGINT, timeout=60)
    assert code == 0, "".join(proc.output[-30:])
    psutil.wait_procs(descendants, timeout=30)  # every process serve started is gone (or a zombie)
    alive = [p for p in descendants if p.is_running() and p.status() != psutil.STATUS_ZOMBIE]
    assert not alive, [(p.pid, p.name()) for p in alive]


def serve_over_mutual_tls(tls_flags: list[str], tmp_path: Path, model_dir) -> None:
    """Run `serve` with `tls_flags` over the model at `model_dir` (which one is not the point): a prompt is
    prefilled on one worker and decoded on the other, gRPC and the KV link both under TLS, plaintext
    callers are refused; SIGINT stops it cleanly."""
    proc = start("serve", ["serve", "--prefill", "1", "--decode", "1", "--port", "0", *tls_flags,
                           "--metrics-port", str(free_port()), *with_model(model_dir)])
    try:
        line = next(x for x in proc.output if x.startswith("workers:"))
        assert "mutual TLS" in line
        prompt = ", ".join(str(i) for i in range(40))  # long enough to be prefilled by the prefill worker
        (tmp_path / "in.jsonl").write_text(json.dumps({"id": "t", "prompt": prompt, "temperature": 0,
                                                       "max_tokens": 6, "ignore_eos": True}) + "\n")
        done = subprocess.run([sys.executable, "-m", "pdserve.cli", "generate", "--url", proc.address,
                               "--input", str(tmp_path / "in.jsonl"), "--output", str(tmp_path / "out.jsonl")],
                              capture_output=True, text=True, timeout=300)
        assert done.returncode == 0, done.stderr
        [out] = [json.loads(x) for x in (tmp_path / "out.jsonl").read_text().splitlines()]
        assert out["usage"]["completion_tokens"] == 6
        worker_metrics = dict(re.findall(r"(prefill|decode) worker metrics at (\S+)", "".join(proc.output)))
        assert metric_value(worker_metrics["prefill"], "pdserve:prompt_tokens_total", role="prefill") >= 40
        assert_plaintext_callers_refused(proc, grpc.StatusCode.UNAVAILABLE)  # refused at the TLS handshake
    finally:
        code = proc.stop(signal.SIGINT, timeout=60)
    assert code == 0, "".join(proc.output[-30:])


def test_serve_with_internal_tls_speaks_mutual_tls_inside(tmp_path, tiny_qwen2_dir):
    serve_over_mutual_tls(["--internal-tls"], tmp_path, tiny_qwen2_dir)  # a throwaway CA made by serve


@pytest.mark.slow  # a long scenario: `make test-fast` leaves it out
def test_serve_starts_a_private_ray_cluster_beside_a_running_ray_start(tmp_path, tiny_qwen2_dir):
    """`ray.init()` without an address joins the cluster a `ray start` left on this machine (its
    address file); serve without --ray-address must start its own instead, as it says."""
    ray, address_file = str(Path(sys.executable).with_name("ray")), Path("/tmp/ray/ray_current_cluster")
    stale = address_file.exists()
    head = subprocess.Popen([ray, "start", "--head", "--block", "--port", str(free_port()), "--num-cpus", "1",
                             "--include-dashboard=false", "--disable-usage-stats"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    try:
        deadline = time.monotonic() + 120
        while not address_file.exists() or stale and address_file.stat().st_mtime < time.time() - 60:
            assert head.poll() is None and time.monotonic() < deadline, "ray start did not come up"
            time.sleep(0.5)
        proc = start("serve", ["serve", "--prefill", "0", "--decode", "1", "--port", "0",
                               *with_model(tiny_qwen2_dir)])  # which model it serves is not the point
        try:
            request = generate_pb2.GenerateRequest(request_id="own-ray", text="Hi", params=generate_pb2.SamplingParams(
                max_tokens=3, ignore_eos=True))
            out = list(generation_stub(proc.address).Generate(request, timeout=120))
            assert out[-1].complete.usage.completion_tokens == 3
        finally:
            assert proc.stop(signal.SIGINT, timeout=60) == 0, "".join(proc.output[-30:])
    finally:  # SIGKILL: `ray start --block` takes ~30 s over a SIGTERM; its processes share its group
        os.killpg(head.pid, signal.SIGKILL)
        head.wait(60)
        address_file.unlink(missing_ok=True)  # what `ray stop` would remove
