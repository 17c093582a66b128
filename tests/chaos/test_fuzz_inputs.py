"""Chaos scenario 7: bad input at every public field, fuzzed with a seeded generator — 320 gRPC
GenerateRequests and 320 OpenAI HTTP bodies, each a valid request with one to three fields replaced
by values of the wrong type, out of range, empty, huge or fine. Each is either served or refused with
INVALID_ARGUMENT / 400 naming a field it broke; the router never answers INTERNAL or 5xx, never
dies, and no worker holds anything afterwards."""
from __future__ import annotations

import asyncio
import random
import uuid

import grpc
import httpx2 as httpx
import pytest

from common.protocol import generate_pb2, generate_pb2_grpc
from tests.cluster.harness import assert_no_leaks

pytestmark = pytest.mark.usefixtures("workers_restored")

CASES_PER_FRONT = 320
VOCAB = 49152
HUGE = 2**31 - 1
NUMBERS = [0, -1, 1, 2, 3, 21, 100000, HUGE, -HUGE - 1, 0.5, 1e308, -1e-9]
FLOATS = [0.0, -1.0, 1e-9, 0.5, 1.0, 1.5, 2.0, 1e308, -1e308, float("nan"), float("inf"), float("-inf")]


def small_int(rng) -> int:
    return rng.choice([0, -1, 1, 2, 3, 16, 17, 21, 100000, HUGE, -HUGE - 1])


def text(rng) -> str:
    return rng.choice(["", " ", "hi", "\x00", "é" * 3, "a" * 300, "stop", "\ud7ff", "x" * 5000])


def token_ids(rng) -> list[int]:
    return rng.choice([[], [0], [VOCAB - 1], [VOCAB], [-1], [5, 6, 7], [2**62], list(range(3, 3 + 9000))])


# gRPC: field -> (how to set a fuzzed value on a GenerateRequest, names an error may carry)
def _grpc_mutations() -> dict:
    def param(name, draw):
        def apply(msg, rng):
            value = draw(rng)
            field = getattr(msg.params, name)
            if isinstance(value, list):
                del field[:]
                field.extend(value)
            else:
                setattr(msg.params, name, value)
        return apply, (f"params.{name}",)

    def set_tokens(msg, rng):
        msg.tokens.ids[:] = token_ids(rng)

    def set_text(msg, rng):
        msg.text = text(rng)

    def set_chat(msg, rng):
        msg.chat.SetInParent()
        del msg.chat.messages[:]
        for _ in range(rng.randrange(0, 3)):
            msg.chat.messages.add(role=rng.choice(["", "user", "system", "assistant", "robot", "x" * 100]),
                                  content=text(rng))

    def set_id(msg, rng):
        msg.request_id = rng.choice(["", "r", "x" * 257, "é" * 10, "\n"])

    def set_salt(msg, rng):
        msg.cache_salt = rng.choice(["", "tenant", "s" * 257])

    return {
        "temperature": param("temperature", lambda r: r.choice(FLOATS)),
        "top_p": param("top_p", lambda r: r.choice(FLOATS)),
        "top_k": param("top_k", small_int),
        "max_tokens": param("max_tokens", lambda r: r.choice([0, -1, 1, 2, 3, 100000, HUGE, -HUGE - 1])),
        "min_tokens": param("min_tokens", small_int),
        "stop": param("stop", lambda r: r.choice([[], [""], ["a"] * 17, ["x" * 300], ["\n", "."]])),
        "stop_token_ids": param("stop_token_ids", lambda r: r.choice([[], [-1], [VOCAB], [2] * 65, [1, 2]])),
        "seed": param("seed", lambda r: r.choice([0, -1, 2**63 - 1, -(2**63), 42])),
        "ignore_eos": param("ignore_eos", lambda r: r.random() < 0.5),
        "logprobs": param("logprobs", small_int),
        "n": param("n", lambda r: r.choice([0, -1, 1, 2, 17, HUGE])),
        "tokens": (set_tokens, ("tokens.ids", "input")),
        "text": (set_text, ("text", "input")),
        "chat": (set_chat, ("chat.messages", "input")),
        "request_id": (set_id, ("request_id",)),
        "cache_salt": (set_salt, ("cache_salt",)),
    }


def _valid_request() -> generate_pb2.GenerateRequest:
    msg = generate_pb2.GenerateRequest(request_id=uuid.uuid4().hex, tokens=generate_pb2.TokenIds(ids=[5, 6, 7]))
    msg.params.temperature, msg.params.max_tokens = 0.0, 2
    return msg


async def grpc_case(stub, rng: random.Random, mutations: dict) -> tuple[str, str, tuple]:
    msg = _valid_request()
    names = rng.sample(sorted(mutations), rng.randrange(1, 4))
    allowed: tuple = ()
    for name in names:
        apply, fields = mutations[name]
        apply(msg, rng)
        allowed += fields
    if not msg.params.HasField("max_tokens") or msg.params.max_tokens > 3 and msg.params.max_tokens < 100000:
        msg.params.max_tokens = 2  # what is served stays short
    try:
        async for _ in stub.Generate(msg, timeout=120):
            pass
        return "OK", "", allowed
    except grpc.aio.AioRpcError as exc:
        return exc.code().name, exc.details() or "", allowed


JSON_VALUES = [None, True, False, 0, -1, 1, 2, 21, 100000, HUGE, 0.5, -0.5, 1e308, "", "x", "2", [], [1], {}, {"a": 1}]
HTTP_FIELDS = ["model", "prompt", "max_tokens", "temperature", "top_p", "top_k", "n", "stop", "seed", "logprobs",
               "min_tokens", "ignore_eos", "stream", "presence_penalty", "frequency_penalty", "echo", "best_of",
               "user", "stop_token_ids", "logit_bias", "suffix"]
CHAT_FIELDS = ["model", "messages", "max_tokens", "max_completion_tokens", "temperature", "top_p", "n", "stop",
               "seed", "logprobs", "top_logprobs", "stream", "ignore_eos", "tools", "response_format"]


def http_value(rng: random.Random, field: str):
    if field == "prompt" and rng.random() < 0.5:
        return rng.choice([token_ids(rng), text(rng), [text(rng)], [[1, 2]]])
    if field == "messages" and rng.random() < 0.6:
        return [{"role": rng.choice(["user", "", 5, None, "tool"]), "content": rng.choice(["hi", "", None, 3,
                                                                                           [{"type": "text"}]])}
                for _ in range(rng.randrange(0, 3))]
    return rng.choice(JSON_VALUES)


async def http_case(http: httpx.AsyncClient, base_url: str, rng: random.Random) -> tuple[str, str, tuple]:
    chat = rng.random() < 0.4
    fields = CHAT_FIELDS if chat else HTTP_FIELDS
    body = {"model": "default", "max_tokens": 2, "temperature": 0}
    body.update({"messages": [{"role": "user", "content": "hi"}]} if chat else {"prompt": [5, 6, 7]})
    names = tuple(rng.sample(fields, rng.randrange(1, 4)))
    for name in names:
        body[name] = http_value(rng, name)
    for key in ("max_tokens", "max_completion_tokens"):  # what is served stays short
        if isinstance(body.get(key), int) and 3 < body[key] < 100000:
            body[key] = 2
    if isinstance(body.get("n"), int) and body["n"] > 2 and body["n"] < 100:
        body["n"] = 2
    path = "/v1/chat/completions" if chat else "/v1/completions"
    response = await http.post(base_url + path, json=body, timeout=120)
    if response.status_code == 200 and body.get("stream") is True:
        return "200", "", names
    try:
        error = response.json().get("error", {}) if response.status_code != 200 else {}
    except ValueError:
        error = {"param": None, "message": response.text[:200]}
    return str(response.status_code), str(error.get("param")), names


def names_a_field(detail: str, allowed: tuple) -> bool:
    leaves = {a.split(".")[-1].split("[")[0] for a in allowed} | set(allowed)
    return any(leaf and leaf in detail for leaf in leaves)


def test_fuzzed_requests_are_served_or_refused_naming_the_field(chaos_cluster):
    cluster = chaos_cluster
    router = cluster["front"]
    rng = random.Random(7)
    mutations = _grpc_mutations()

    async def run():
        slots = asyncio.Semaphore(8)
        async with grpc.aio.insecure_channel(router.address) as channel, httpx.AsyncClient() as http:
            stub = generate_pb2_grpc.GenerationStub(channel)

            async def bounded(coro):
                async with slots:
                    return await coro

            grpc_cases = [bounded(grpc_case(stub, random.Random(rng.random()), mutations))
                          for _ in range(CASES_PER_FRONT)]
            http_cases = [bounded(http_case(http, router.http_url, random.Random(rng.random())))
                          for _ in range(CASES_PER_FRONT)]
            return await asyncio.gather(*grpc_cases), await asyncio.gather(*http_cases)

    grpc_results, http_results = asyncio.run(run())
    # ALREADY_EXISTS: two concurrent cases drew the same request_id (e.g. "r"), refused by name.
    wrong = [r for r in grpc_results if r[0] not in ("OK", "INVALID_ARGUMENT", "ALREADY_EXISTS")
             or r[0] == "INVALID_ARGUMENT" and not names_a_field(r[1], r[2])
             or r[0] == "ALREADY_EXISTS" and not ("request_id" in r[2] and r[1].startswith("request_id"))]
    assert not wrong, wrong[:10]
    wrong = [r for r in http_results if r[0] not in ("200", "400", "404")
             or r[0] in ("400", "404") and not any(r[1].split(".")[0].split("[")[0] == n for n in r[2])]
    assert not wrong, wrong[:10]
    # Both outcomes occurred plenty: the fuzzer reached the validation and the serving paths.
    grpc_codes, http_codes = [r[0] for r in grpc_results], [r[0] for r in http_results]
    assert grpc_codes.count("OK") >= 30 and grpc_codes.count("INVALID_ARGUMENT") >= 100, grpc_codes
    assert http_codes.count("200") >= 20 and http_codes.count("400") >= 100, http_codes
    assert router.alive
    assert_no_leaks(cluster["prefill"] + cluster["decode"][:2], secret_file=cluster["secret"])
