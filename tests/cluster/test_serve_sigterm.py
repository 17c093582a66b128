"""SIGTERM to `pdserve serve` (what Kubernetes sends the chart's head pod) drains it: a 120-token
stream in flight finishes with every token, a new call during the drain gets UNAVAILABLE, serve
exits 0 and leaves no process behind (Ray's raylet, GCS and worker processes of its private
cluster included). Ray's own SIGTERM handler (installed by `ray.init`) must not win."""
from __future__ import annotations

import contextlib
import signal
import time

import grpc
import psutil
import pytest

from common.protocol import generate_pb2
from tests.cluster.harness import WORKER_FLAGS, Proc, generation_stub, start
from tests.cluster.test_drain import LongGeneration, health

MAX_TOKENS = 120
DRAIN_TIMEOUT_S = 120.0  # far above what 120 tokens need on a loaded 2-core machine


def readiness(proc: Proc) -> str:
    """serve's router readiness; fails with serve's last output if it is gone."""
    try:
        return health(proc.address)
    except grpc.RpcError:
        proc.wait_stopped(5)
        assert proc.alive, f"serve died (exit {proc.popen.returncode}):\n" + "".join(proc.output[-30:])
        raise


def running(proc: psutil.Process) -> bool:
    try:
        return proc.is_running() and proc.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def wait_gone(procs: list[psutil.Process], timeout: float) -> list[psutil.Process]:
    """The processes still running once all are gone or `timeout` passed."""
    deadline = time.monotonic() + timeout
    while True:
        alive = [p for p in procs if running(p)]
        if not alive or time.monotonic() > deadline:
            return alive
        time.sleep(0.2)


@pytest.mark.slow  # a long scenario: `make test-fast` leaves it out
@pytest.mark.parametrize("extra", [[], ["--planner", "--max-prefill", "2", "--max-decode", "2"]],
                         ids=["serve", "serve-planner"])
def test_sigterm_drains_serve_and_leaves_no_process(smollm2_dir, extra):
    proc = start("serve", ["serve", "--prefill", "1", "--decode", "1", "--port", "0", *extra,
                           "--router-drain-timeout-s", str(DRAIN_TIMEOUT_S), "--drain-timeout-s",
                           str(DRAIN_TIMEOUT_S), *WORKER_FLAGS])
    descendants: list[psutil.Process] = []
    try:
        stream = LongGeneration(proc.address, MAX_TOKENS)
        stream.start()
        stream.wait_for_tokens(3)
        descendants = psutil.Process(proc.popen.pid).children(recursive=True)
        assert len(descendants) >= 3, descendants  # Ray's raylet and GCS plus the two worker actors at least
        proc.popen.send_signal(signal.SIGTERM)
        tokens_at_signal = len(stream.token_times)

        deadline = time.monotonic() + 30
        while readiness(proc) != "NOT_SERVING":  # the router drains (Ray's handler would exit at once)
            assert time.monotonic() < deadline, "serve still SERVING after SIGTERM"
            time.sleep(0.05)
        late = generate_pb2.GenerateRequest(request_id="late", text="Hi",
                                            params=generate_pb2.SamplingParams(max_tokens=4))
        # the router still listens while it drains: refused by it, not by a closed port
        with pytest.raises(grpc.RpcError) as refused:
            list(generation_stub(proc.address).Generate(late, timeout=30))
        assert refused.value.code() == grpc.StatusCode.UNAVAILABLE
        assert "draining" in refused.value.details()
        assert stream.is_alive(), "the stream ended before the drain could be shown"

        stream.join(DRAIN_TIMEOUT_S + 60)
        assert stream.error is None, f"the in-flight stream failed: {stream.error}"
        assert stream.completion_tokens == MAX_TOKENS == len(stream.token_times) > tokens_at_signal
        code = proc.wait_stopped(DRAIN_TIMEOUT_S)
        alive = wait_gone(descendants, timeout=30)
    finally:
        proc.kill()
        for leftover in wait_gone(descendants, timeout=0):  # a failed run leaves no Ray cluster behind
            with contextlib.suppress(psutil.NoSuchProcess):
                leftover.kill()
    assert code == 0, "".join(proc.output[-30:])
    assert not any("SIGTERM received" in line for line in proc.output), "Ray's handler ran"
    assert not alive, [(p.pid, p.name()) for p in alive]
    with pytest.raises(grpc.RpcError) as closed:  # after the drain the port is closed
        list(generation_stub(proc.address).Generate(late, timeout=10))
    assert closed.value.code() == grpc.StatusCode.UNAVAILABLE and "Connection refused" in closed.value.details()
