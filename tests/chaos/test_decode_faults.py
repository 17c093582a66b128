"""Chaos scenarios 1, 3 and 5: a decode worker killed (SIGKILL) under 32 concurrent streams, stopped
(SIGSTOP past the router's stream timeout, then SIGCONT) and drained past its timeout (SIGTERM,
--drain-timeout-s 1). Its samples continue on another decode worker, token for token; every survivor
(and the woken worker) ends holding nothing."""
from __future__ import annotations

import signal
import threading
import time
import uuid

import grpc
import pytest

from common.client import build_request
from common.protocol import generate_pb2
from engine.sampling_params import SamplingParams
from engine.structured_output.spec import StructuredOutput
from tests.cluster.harness import assert_no_leaks, generation_stub, metric_value, worker_stats

pytestmark = pytest.mark.usefixtures("workers_restored")

MAX_TOKENS = 24
DRAINED_TOKENS = 64  # ~60 decode steps left at the SIGTERM: well past the 1 s drain timeout even when idle
PROMPTS = [f"Write a short poem about the number {i} and the sea." for i in range(16)]
GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
SEEDED = SamplingParams(temperature=0.9, top_p=0.95, seed=4321, max_tokens=MAX_TOKENS, ignore_eos=True)
ORDER = {"type": "object", "properties": {
    "id": {"type": "integer", "minimum": 1, "maximum": 99999},
    "items": {"type": "array", "minItems": 1, "maxItems": 3, "items": {"type": "object", "properties": {
        "sku": {"type": "string", "pattern": "^[A-Z]{3}-[0-9]{3}$"}, "quantity": {"type": "integer", "minimum": 1,
                                                                               "maximum": 9}},
        "required": ["sku", "quantity"], "additionalProperties": False}}},
    "required": ["id", "items"], "additionalProperties": False}
CONSTRAINED = [SamplingParams(temperature=0.0, max_tokens=120, structured_output=StructuredOutput.json_schema(ORDER)),
               SamplingParams(temperature=0.9, seed=77, max_tokens=120,
                              structured_output=StructuredOutput.json_schema(ORDER))]
"""Structured outputs across a migration: the new worker's fresh matcher replays the streamed tokens."""


@pytest.fixture(scope="module")
def cluster(chaos_cluster):
    return chaos_cluster


@pytest.fixture(scope="module")
def offline_greedy(offline_engine):
    """The offline engine's greedy tokens for PROMPTS (the reference every migrated stream must equal)."""
    prompts = [offline_engine.tokenizer.encode(p) for p in PROMPTS]
    outputs = offline_engine.generate(prompts, GREEDY)
    return prompts, [o.completions[0].token_ids for o in outputs]


class Stream:
    """One Generate call read in a thread: its tokens, final Complete or error code."""

    def __init__(self, router, token_ids: list[int], params: SamplingParams) -> None:
        self.tokens: list[int] = []
        self.complete = None
        self.code: str | None = None
        self.details = ""
        self.started = threading.Event()
        """Set once the first tokens arrived (the sample is decoding)."""
        request = build_request(uuid.uuid4().hex, params, token_ids=token_ids)
        self._thread = threading.Thread(target=self._run, args=(generation_stub(router.address), request))
        self._thread.start()

    def _run(self, stub, request) -> None:
        try:
            for msg in stub.Generate(request, timeout=180):
                if msg.HasField("complete"):
                    self.complete = msg.complete
                else:
                    self.tokens.extend(msg.chunk.token_ids)
                    if len(self.tokens) >= 3:
                        self.started.set()
        except grpc.RpcError as exc:
            self.code = exc.code().name
            self.details = exc.details()
        finally:
            self.started.set()

    def join(self) -> None:
        self._thread.join(200)
        assert not self._thread.is_alive()


def alive(procs):
    return [p for p in procs if p.popen.poll() is None]


def busiest_decode(cluster):
    """The (live) decode worker holding the most requests now, and how many."""
    workers = alive(cluster["decode"])
    count, index = max((worker_stats(w.address, cluster["secret"]).num_requests, i) for i, w in enumerate(workers))
    return workers[index], count


def migrations(cluster, reason: str) -> float:
    return metric_value(cluster["router"].metrics_url, "pdserve:request_migrations_total", reason=reason) or 0.0


def stopped_until_migrated(cluster, streams: list[Stream], reason_before: float):
    """SIGSTOP the decode worker holding the streams until the router counted a stream-timeout migration
    for each of the samples it held; returns that worker (SIGCONT'ed again)."""
    for s in streams:
        assert s.started.wait(120) and s.code is None, s.code
    victim, held = busiest_decode(cluster)
    assert held >= 1
    victim.popen.send_signal(signal.SIGSTOP)
    try:
        deadline = time.monotonic() + 60
        while migrations(cluster, "stream_timeout") < reason_before + held:
            assert time.monotonic() < deadline, "no stream-timeout migration"
            time.sleep(0.2)
        for s in streams:
            s.join()
    finally:
        victim.popen.send_signal(signal.SIGCONT)
    return victim


def test_seeded_sampling_continues_exactly_across_a_migration(cluster, offline_greedy):
    prompt = offline_greedy[0][0]
    reference = Stream(cluster["router"], prompt, SEEDED)
    reference.join()
    assert reference.code is None and len(reference.tokens) == MAX_TOKENS
    before = migrations(cluster, "stream_timeout")
    moved = Stream(cluster["router"], prompt, SEEDED)
    stopped_until_migrated(cluster, [moved], before)
    assert moved.code is None
    assert moved.tokens == reference.tokens  # the resumed sampler skipped exactly the draws already made
    assert moved.complete.usage.completion_tokens == MAX_TOKENS and moved.complete.usage.prompt_tokens == len(prompt)
    assert moved.complete.finish_reason == reference.complete.finish_reason
    constrained = Stream(cluster["router"], prompt, CONSTRAINED[1])
    constrained.join()
    before = migrations(cluster, "stream_timeout")
    moved = Stream(cluster["router"], prompt, CONSTRAINED[1])
    stopped_until_migrated(cluster, [moved], before)
    assert moved.code is None and moved.tokens == constrained.tokens
    assert moved.complete.finish_reason == constrained.complete.finish_reason == generate_pb2.FINISH_REASON_STOP
    assert_no_leaks([*cluster["prefill"], *cluster["decode"]], secret_file=cluster["secret"])


def test_a_stopped_decode_worker_loses_its_streams_and_frees_them_when_it_wakes(cluster, offline_greedy):
    prompts, expected = offline_greedy
    before = migrations(cluster, "stream_timeout")
    streams = [Stream(cluster["router"], p, GREEDY) for p in prompts[:4]]
    stopped_until_migrated(cluster, streams, before)
    for s, want in zip(streams, expected[:4], strict=True):
        assert s.code is None and s.tokens == want
        assert s.complete.usage.completion_tokens == len(want)
    # the woken worker freed what it held
    assert_no_leaks([*cluster["prefill"], *cluster["decode"]], secret_file=cluster["secret"])


def test_max_migrations_0_fails_the_sample_unavailable(cluster, offline_greedy):
    stream = Stream(cluster["no_migration"], offline_greedy[0][0], GREEDY)
    assert stream.started.wait(120)
    victim, held = busiest_decode(cluster)
    assert held == 1
    victim.popen.send_signal(signal.SIGSTOP)
    try:
        stream.join()
    finally:
        victim.popen.send_signal(signal.SIGCONT)
    assert stream.code == "UNAVAILABLE" and 3 <= len(stream.tokens) < MAX_TOKENS
    assert_no_leaks([*cluster["prefill"], *cluster["decode"]], secret_file=cluster["secret"])


def test_killed_decode_worker_every_stream_completes_equal_to_the_offline_engine(cluster, offline_engine,
                                                                                offline_greedy):
    """Kills a decode worker under 32 concurrent greedy streams (each prompt twice) and 2 constrained ones
    (greedy and seeded, JSON schema): the constrained ones equal the offline engine too."""
    prompts, expected = offline_greedy
    constrained = offline_engine.generate(prompts[:2], CONSTRAINED)
    params = [GREEDY] * len(prompts) * 2 + CONSTRAINED
    prompts, expected = prompts * 2 + prompts[:2], expected * 2 + [o.completions[0].token_ids for o in constrained]
    before = migrations(cluster, "worker_lost")
    streams = [Stream(cluster["router"], p, sp) for p, sp in zip(prompts, params, strict=True)]
    for s in streams:
        assert s.started.wait(120) and s.code is None, s.code
    victim, held = busiest_decode(cluster)
    assert held >= 1
    victim.kill()
    for s in streams:
        s.join()
    for i, (s, want) in enumerate(zip(streams, expected, strict=True)):
        assert s.code is None, (i, s.code, s.details)
        assert s.tokens == want, i
        assert s.complete.usage.completion_tokens == len(want) and s.complete.usage.prompt_tokens == len(prompts[i])
    assert migrations(cluster, "worker_lost") >= before + 1
    survivors = [*cluster["prefill"], *(w for w in cluster["decode"] if w is not victim)]
    assert_no_leaks(survivors, secret_file=cluster["secret"])


def test_a_decode_worker_drained_past_its_timeout_hands_its_streams_over(cluster, offline_engine, offline_greedy):
    """SIGTERM with --drain-timeout-s 1 under streams of DRAINED_TOKENS tokens (so that an idle machine
    does not finish them within the second); what still runs at the timeout ends as "draining" and migrates."""
    params = SamplingParams(temperature=0.0, max_tokens=DRAINED_TOKENS, ignore_eos=True)
    prompts = offline_greedy[0][:4]
    expected = [o.completions[0].token_ids for o in offline_engine.generate(prompts, params)]
    before = migrations(cluster, "drained")
    streams = [Stream(cluster["router"], p, params) for p in prompts]
    for s in streams:
        assert s.started.wait(120) and s.code is None, s.code
    victim, held = busiest_decode(cluster)
    assert held >= 1
    victim.popen.terminate()
    for s in streams:
        s.join()
    assert victim.popen.wait(30) == 0
    for i, (s, want) in enumerate(zip(streams, expected, strict=True)):
        assert s.code is None, (i, s.code, s.details)
        assert s.tokens == want and s.complete.usage.completion_tokens == len(want), i
    assert migrations(cluster, "drained") >= before + 1
    assert_no_leaks(alive([*cluster["prefill"], *cluster["decode"]]), secret_file=cluster["secret"])
