"""The OpenAI-compatible HTTP front, driven by the official `openai` client.

Outputs equal the gRPC front's for the same inputs (same router, same workers);
errors carry OpenAI's error JSON and HTTP status; a client that goes away
aborts its request on every worker.
"""
from __future__ import annotations

import json
import signal
import time
import urllib.error
import urllib.request

import httpx2 as httpx
import openai
import pytest

from engine.sampling_params import SamplingParams
from tests.cluster.harness import assert_no_leaks, free_port, grpc_samples, start_router, start_worker

CHAT = [{"role": "user", "content": "What is the capital of France?"}]
TEXT = "The quick brown fox"
TOKEN_IDS = [1, 504, 3575, 282, 4649]


def client(router, timeout: float = 120) -> openai.OpenAI:
    return openai.OpenAI(base_url=router.http_url + "/v1", api_key="unused", max_retries=0, timeout=timeout)


def one_worker_pair(workers) -> list:
    return workers["prefill"][:1] + workers["decode"][:1]


def post(url: str, body: dict) -> tuple[int, dict, dict]:
    """(status, JSON body, headers) of a POST, errors included."""
    request = urllib.request.Request(url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=120) as response:
            return response.status, json.load(response), dict(response.headers)
    except urllib.error.HTTPError as exc:
        return exc.code, json.load(exc), dict(exc.headers)


def streamed_texts(stream) -> tuple[dict, dict, list]:
    """(text by index, finish_reason by index, usage chunks) of a chat or completions stream."""
    texts, reasons, usages = {}, {}, []
    for event in stream:
        assert len(event.choices) <= 1
        for choice in event.choices:
            assert choice.index not in reasons, "nothing follows a choice's finish_reason"
            piece = choice.delta.content if hasattr(choice, "delta") else choice.text
            texts[choice.index] = texts.get(choice.index, "") + (piece or "")
            if choice.finish_reason:
                reasons[choice.index] = choice.finish_reason
        if event.usage is not None:
            assert not event.choices
            usages.append(event.usage)
    return texts, reasons, usages


def test_models_and_health(http_router):
    models = client(http_router).models.list()
    assert [m.id for m in models.data] == ["default"]
    with urllib.request.urlopen(http_router.http_url + "/health", timeout=10) as response:
        assert response.status == 200


@pytest.mark.parametrize("stream", [False, True], ids=["json", "sse"])
def test_greedy_outputs_equal_the_grpc_front(http_router, workers, stream):
    oa = client(http_router)
    cases = [
        ("chat", dict(messages=CHAT), dict(max_tokens=32)),
        ("text", dict(prompt=TEXT), dict(max_tokens=24)),
        ("token ids", dict(token_ids=TOKEN_IDS), dict(max_tokens=16, ignore_eos=True)),
    ]
    for name, prompt, sampling in cases:
        params = SamplingParams(temperature=0, **sampling)
        want = grpc_samples(http_router.address, params, **prompt)[0]
        extra = {"extra_body": {"ignore_eos": True}} if sampling.get("ignore_eos") else {}
        common = dict(model="default", temperature=0, max_tokens=sampling["max_tokens"], stream=stream, **extra)
        if stream:
            common["stream_options"] = {"include_usage": True}
        if "messages" in prompt:
            got = oa.chat.completions.create(messages=prompt["messages"], **common)
        else:
            got = oa.completions.create(prompt=prompt.get("prompt") or prompt["token_ids"], **common)
        if stream:
            events = list(got)
            texts, reasons, usages = streamed_texts(events)
            text, reason, usage = texts[0], reasons[0], usages[0]
            assert len(usages) == 1
            if reason == "length":  # one event per token; the last token's event carries finish_reason
                assert sum(1 for e in events if e.choices) == usage.completion_tokens, name
        else:
            choice = got.choices[0]
            text = choice.message.content if "messages" in prompt else choice.text
            reason, usage = choice.finish_reason, got.usage
        assert text == want.text, name
        assert reason == {"stop_string": "stop"}.get(want.finish_reason, want.finish_reason), name
        assert usage.completion_tokens == want.usage["completion_tokens"], name
        assert usage.prompt_tokens == want.usage["prompt_tokens"], name
        assert usage.total_tokens == usage.prompt_tokens + usage.completion_tokens
    assert_no_leaks(one_worker_pair(workers))


def test_n_samples_and_seed_reproducibility(http_router):
    oa = client(http_router)
    prompt = "Tell me a story about a cat"
    ask = dict(model="default", prompt=prompt, max_tokens=16, temperature=0.8, top_p=0.9, seed=7, n=2)
    want = grpc_samples(http_router.address, SamplingParams(max_tokens=16, temperature=0.8, top_p=0.9, seed=7, n=2),
                        prompt=prompt)
    first = oa.completions.create(**ask)
    again = oa.completions.create(**ask)
    by_index = sorted(first.choices, key=lambda c: c.index)
    assert [c.index for c in by_index] == [0, 1]
    texts = [c.text for c in by_index]
    assert texts == [s.text for s in want]  # sample i is seeded with seed + i, on both fronts
    assert texts[0] != texts[1]
    assert texts == [c.text for c in sorted(again.choices, key=lambda c: c.index)]
    assert first.usage.completion_tokens == sum(s.usage["completion_tokens"] for s in want)
    streamed, reasons, _ = streamed_texts(oa.completions.create(stream=True, **ask))
    assert [streamed[0], streamed[1]] == texts and set(reasons) == {0, 1}
    other_seed = oa.completions.create(**dict(ask, seed=8))
    assert [c.text for c in sorted(other_seed.choices, key=lambda c: c.index)] != texts


@pytest.mark.parametrize("stream", [False, True], ids=["json", "sse"])
def test_stop_strings(http_router, stream):
    oa = client(http_router)
    ask = dict(model="default", messages=[{"role": "user", "content": "Count from one to twenty in words."}],
               temperature=0, max_tokens=40)
    full = oa.chat.completions.create(**ask).choices[0].message.content
    stop = full[len(full) // 2:len(full) // 2 + 4]
    assert stop.strip(), full
    if stream:
        texts, reasons, _ = streamed_texts(oa.chat.completions.create(stop=[stop, "never-appears"], stream=True,
                                                                      **ask))
        text, reason = texts[0], reasons[0]
    else:
        choice = oa.chat.completions.create(stop=stop, **ask).choices[0]
        text, reason = choice.message.content, choice.finish_reason
    assert text == full[:full.index(stop)]
    assert reason == "stop"


def test_usage_reports_cached_prompt_tokens(http_router):
    oa = client(http_router)
    prompt = "You are a careful assistant that answers briefly. " * 8 + "Say hello."
    first = oa.completions.create(model="default", prompt=prompt, max_tokens=4, temperature=0)
    second = oa.completions.create(model="default", prompt=prompt, max_tokens=4, temperature=0)
    assert first.usage.prompt_tokens == second.usage.prompt_tokens > 64
    assert second.usage.prompt_tokens_details.cached_tokens >= 64  # the prefill worker's prefix cache
    assert second.usage.prompt_tokens_details.cached_tokens < second.usage.prompt_tokens


def test_logprobs(http_router):
    oa = client(http_router)
    chat = oa.chat.completions.create(model="default", messages=CHAT, temperature=0, max_tokens=6, logprobs=True,
                                      top_logprobs=3)
    content = chat.choices[0].logprobs.content
    assert len(content) == chat.usage.completion_tokens
    for entry in content:
        assert len(entry.top_logprobs) == 3
        assert entry.logprob == pytest.approx(entry.top_logprobs[0].logprob, abs=1e-4)  # greedy: the best one
        assert bytes(entry.bytes).decode() == entry.token
    assert "".join(e.token for e in content) == chat.choices[0].message.content
    text = oa.completions.create(model="default", prompt=TEXT, temperature=0, max_tokens=5, logprobs=2)
    lp = text.choices[0].logprobs
    assert "".join(lp.tokens) == text.choices[0].text
    assert len(lp.token_logprobs) == 5 and all(len(t) == 2 for t in lp.top_logprobs)
    assert lp.text_offset[0] == 0


INVALID = [
    ("completions", {"prompt": "hi", "temperature": -1}, "temperature"),
    ("completions", {"prompt": "hi", "temperature": "hot"}, "temperature"),
    ("completions", {"prompt": "hi", "top_p": 0}, "top_p"),
    ("completions", {"prompt": "hi", "max_tokens": 0}, "max_tokens"),
    ("completions", {"prompt": "hi", "max_tokens": 100000}, "max_tokens"),
    ("completions", {"prompt": "hi", "n": 0}, "n"),
    ("completions", {"prompt": "hi", "logprobs": 21}, "logprobs"),
    ("completions", {"prompt": "hi", "stop": [1]}, "stop"),
    ("completions", {"prompt": "hi", "presence_penalty": 2.5}, "presence_penalty"),
    ("completions", {"prompt": "hi", "logit_bias": {"49152": 1}}, "logit_bias"),
    ("completions", {"prompt": "hi", "echo": True}, "echo"),
    ("completions", {"prompt": ""}, "prompt"),
    ("completions", {"prompt": [1, 49152]}, "prompt"),
    ("completions", {"prompt": ["a", "b"]}, "prompt"),
    ("completions", {}, "prompt"),
    ("chat/completions", {"messages": []}, "messages"),
    ("chat/completions", {"messages": [{"role": "", "content": "hi"}]}, "messages[0].role"),
    ("chat/completions", {"messages": [{"role": "user", "content": [{"type": "image_url"}]}]},
     "messages[0].content"),
    ("chat/completions", {"messages": CHAT, "max_completion_tokens": 0}, "max_completion_tokens"),
    ("chat/completions", {"messages": CHAT, "logprobs": True, "top_logprobs": 21}, "top_logprobs"),
    ("chat/completions", {"messages": CHAT, "top_logprobs": 2}, "top_logprobs"),
    ("chat/completions", {"messages": CHAT, "min_tokens": 5, "max_tokens": 2}, "min_tokens"),
]


@pytest.mark.parametrize("path,body,param", INVALID, ids=[f"{p}:{f}" for p, _, f in INVALID])
def test_invalid_input_is_400_naming_the_parameter(http_router, path, body, param):
    status, error, _ = post(f"{http_router.http_url}/v1/{path}", dict(model="default", **body))
    assert status == 400, error
    assert error["error"]["param"] == param, error
    assert error["error"]["type"] == "invalid_request_error"
    assert error["error"]["message"].startswith(param + ":"), error


def test_errors_through_the_openai_client(http_router, workers):
    oa = client(http_router)
    with pytest.raises(openai.BadRequestError) as bad:
        oa.chat.completions.create(model="default", messages=CHAT, temperature=-1)
    assert bad.value.param == "temperature"
    with pytest.raises(openai.NotFoundError) as missing:
        oa.completions.create(model="gpt-4", prompt="hi")
    assert missing.value.param == "model" and missing.value.code == "model_not_found"
    status, error, _ = post(http_router.http_url + "/v1/completions", {"model": "default", "prompt": "hi",
                                                                        "stream": True, "top_k": -5})
    assert status == 400 and error["error"]["param"] == "top_k"  # refused before any event is streamed
    assert_no_leaks(one_worker_pair(workers))


def test_disconnect_mid_stream_aborts_on_every_worker(http_router, workers):
    body = {"model": "default", "prompt": "Tell me everything about the history of Rome.", "max_tokens": 1500,
            "temperature": 0, "ignore_eos": True, "stream": True}
    events = 0
    with httpx.Client(timeout=60) as http:
        with http.stream("POST", http_router.http_url + "/v1/completions", json=body) as response:
            assert response.status_code == 200
            assert response.headers["content-type"].startswith("text/event-stream")
            for line in response.iter_lines():
                events += line.startswith("data: {")
                if events == 5:
                    break  # leaving the block closes the connection mid-stream
    # 1500 tokens take far longer than this; only an abort frees the blocks in time
    assert_no_leaks(one_worker_pair(workers), timeout=10)


def test_disconnect_before_the_response_aborts_too(http_router, workers):
    with pytest.raises(openai.APITimeoutError):
        client(http_router, timeout=1.5).chat.completions.create(model="default", messages=CHAT, max_tokens=1500,
                                                                temperature=0, extra_body={"ignore_eos": True})
    assert_no_leaks(one_worker_pair(workers), timeout=10)


@pytest.fixture(scope="module")
def saturated_router(smollm2_dir):
    """Co-located: one decode worker that holds one request at a time, and no admission queue."""
    decode = start_worker("decode", "--max-num-requests", "1")
    port = free_port()
    router = start_router([], [decode], "--http-port", str(port), "--max-queue-len", "0", "--retry-after-s", "2.5")
    router.http_url = f"http://127.0.0.1:{port}"
    yield router, decode
    router.stop()
    decode.stop()


def test_overload_is_429_with_retry_after(saturated_router):
    router, decode = saturated_router
    oa = client(router)
    long = oa.completions.create(model="default", prompt="Tell me about Rome.", max_tokens=400, temperature=0,
                                 stream=True, extra_body={"ignore_eos": True})
    next(iter(long))  # running: the worker is full
    for stream in (False, True):
        with pytest.raises(openai.RateLimitError) as info:
            oa.completions.create(model="default", prompt="hi", max_tokens=4, stream=stream)
        assert info.value.response.headers["retry-after"] == "3"  # --retry-after-s 2.5, in whole seconds
        assert info.value.code == "rate_limit_exceeded"
    long.close()
    assert_no_leaks([decode], timeout=10)


def test_draining_router_answers_503_and_finishes_in_flight_requests(workers):
    port = free_port()
    router = start_router(workers["prefill"][:1], workers["decode"][:1], "--http-port", str(port))
    router.http_url = f"http://127.0.0.1:{port}"
    try:
        oa = client(router)
        stream = oa.completions.create(model="default", prompt="Tell me about Rome.", max_tokens=120, temperature=0,
                                       stream=True, extra_body={"ignore_eos": True})
        events = iter(stream)
        next(events)
        router.popen.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + 10
        while True:
            try:
                urllib.request.urlopen(router.http_url + "/health", timeout=5)
            except urllib.error.HTTPError as exc:
                assert exc.code == 503
                break
            assert time.monotonic() < deadline, "/health never turned 503"
            time.sleep(0.05)
        with pytest.raises(openai.InternalServerError) as info:
            oa.completions.create(model="default", prompt="hi", max_tokens=4)
        assert info.value.status_code == 503 and info.value.code == "service_unavailable"
        rest, reasons, _ = streamed_texts(events)
        assert reasons == {0: "length"}  # the in-flight request ran to its end
        assert router.popen.wait(60) == 0
    finally:
        router.stop()
    assert_no_leaks(one_worker_pair(workers))
