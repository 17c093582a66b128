"""Structured outputs through the disaggregated path (router -> prefill worker -> KV hand-off -> decode worker)
on the default model, over gRPC and through the official `openai` client: every constrained output
validates; greedy constrained output equals the offline engine's; tools with `required`, a named function
and `auto` (Hermes parser) come back as tool calls whose arguments validate, streamed and not; bad
constraints are refused INVALID_ARGUMENT / 400 naming the field before any worker is touched; prompt
logprobs come back from the prefill worker."""
from __future__ import annotations

import asyncio
import json
from pathlib import Path

import grpc
import jsonschema
import openai
import pytest

from common.client import build_request, generate_one
from common.grpc_common import insecure_channel
from common.protocol import generate_pb2_grpc
from engine.config import CacheConfig, EngineConfig
from engine.llm_engine import LLMEngine
from engine.sampling_params import SamplingParams
from engine.structured_output.spec import StructuredOutput
from tests.cluster.harness import assert_no_leaks, free_port, start_router

SCHEMAS = json.loads((Path(__file__).parents[1] / "data/json_schemas.json").read_text())
CHAT = [{"role": "user", "content": "Describe a person as a JSON object."}]
WEATHER = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 16},
                                            "unit": {"enum": ["celsius", "fahrenheit"]}},
           "required": ["city", "unit"], "additionalProperties": False}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Current weather in a city",
                                           "parameters": WEATHER}},
         {"type": "function", "function": {"name": "get_time", "parameters": {
             "type": "object", "properties": {"zone": {"enum": ["UTC", "CET"]}}, "required": ["zone"],
             "additionalProperties": False}}}]


@pytest.fixture(scope="module")
def router(workers):
    port = free_port()
    proc = start_router(workers["prefill"][:1], workers["decode"][:1], "--http-port", str(port),
                        "--tool-call-parser", "hermes")
    proc.http_url = f"http://127.0.0.1:{port}"
    yield proc
    proc.stop()


@pytest.fixture(scope="module")
def offline(smollm2_dir):
    engine = LLMEngine(EngineConfig(model=str(smollm2_dir), dtype="float32",
                                    cache=CacheConfig(kv_cache_memory_bytes=256 << 20)))
    yield engine
    engine.shutdown()


def grpc_generate(router, params: SamplingParams, request_id: str, **prompt) -> list:
    async def run():
        async with insecure_channel(router.address) as channel:
            return await generate_one(generate_pb2_grpc.GenerationStub(channel),
                                      build_request(request_id, params, **prompt), timeout=300)
    return asyncio.run(run())


def client(router) -> openai.OpenAI:
    return openai.OpenAI(base_url=router.http_url + "/v1", api_key="unused", max_retries=0, timeout=300)


@pytest.mark.slow
def test_200_seeded_samples_of_10_schemas_validate_through_prefill_and_decode(router, workers):
    async def run():
        async with insecure_channel(router.address) as channel:
            stub = generate_pb2_grpc.GenerationStub(channel)
            calls = [generate_one(stub, build_request(f"schema-{name}-{half}", SamplingParams(
                n=10, temperature=1.0, seed=100 + 10 * (2 * i + half), max_tokens=200,
                structured_output=StructuredOutput.json_schema(schema)), messages=CHAT), timeout=600)
                for i, (name, schema) in enumerate(SCHEMAS.items()) for half in (0, 1)]
            results = await asyncio.gather(*calls)
            return [results[i] + results[i + 1] for i in range(0, len(results), 2)]
    for (name, schema), samples in zip(SCHEMAS.items(), asyncio.run(run()), strict=True):
        assert len(samples) == 20
        for sample in samples:
            assert sample.finish_reason == "stop", (name, sample.text)
            jsonschema.validate(json.loads(sample.text), schema)
    assert_no_leaks(workers["prefill"][:1] + workers["decode"][:1])


@pytest.mark.parametrize("spec", [StructuredOutput.json_schema(SCHEMAS["order"]), StructuredOutput.json_object(),
                                  StructuredOutput.regex(r"(yes|no), because [a-z ]{5,30}\."),
                                  StructuredOutput.choice(["Paris", "London", "Berlin"])],
                         ids=["json_schema", "json_object", "regex", "choice"])
def test_greedy_constrained_output_equals_the_offline_engine(router, offline, spec):
    chat = [{"role": "user", "content": "Give a JSON object with a name and an age."}] if spec.kind == "json_object" \
        else CHAT  # (asked for a person, SmolLM2's free-form object repeats one address key to any length)
    params = SamplingParams(temperature=0.0, max_tokens=150, structured_output=spec)
    want = offline.generate([offline.tokenizer.apply_chat_template(chat)], params)[0].completions[0]
    [got] = grpc_generate(router, params, f"greedy-{spec.kind}", messages=chat)
    assert got.token_ids == want.token_ids and got.finish_reason == want.finish_reason == "stop"
    if spec.kind == "json_object":
        assert isinstance(json.loads(got.text), dict)


@pytest.mark.parametrize(("spec", "field"), [
    (StructuredOutput.regex("a(b"), "params.structured_output.regex"),
    (StructuredOutput.json_schema({"type": "object", "properties": {"a": {"type": "nonsense"}}}),
     "params.structured_output.json_schema"),
])
def test_a_constraint_that_does_not_compile_is_refused_by_the_router(router, spec, field):
    with pytest.raises(grpc.RpcError) as err:
        grpc_generate(router, SamplingParams(structured_output=spec), "bad-constraint", prompt="hi")
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and field in err.value.details()


def test_response_format_json_schema_returns_parsed_json(router):
    response = client(router).chat.completions.create(
        model="default", messages=CHAT, temperature=0, max_tokens=150,
        response_format={"type": "json_schema", "json_schema": {"name": "person", "schema": SCHEMAS["person"],
                                                                 "strict": True}})
    jsonschema.validate(json.loads(response.choices[0].message.content), SCHEMAS["person"])


def _arguments_validate(calls, names=("get_weather", "get_time")) -> None:
    assert calls
    for call in calls:
        assert call.function.name in names
        schema = next(t["function"]["parameters"] for t in TOOLS if t["function"]["name"] == call.function.name)
        jsonschema.validate(json.loads(call.function.arguments), schema)


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
@pytest.mark.parametrize("tool_choice", ["required", {"type": "function", "function": {"name": "get_weather"}}],
                         ids=["required", "named"])
def test_tool_calls_with_required_or_a_named_function_validate(router, tool_choice, stream):
    messages = [{"role": "user", "content": "What is the weather in Paris?"}]
    kwargs = dict(model="default", messages=messages, tools=TOOLS, tool_choice=tool_choice, temperature=0,
                  max_tokens=120)
    if not stream:
        choice = client(router).chat.completions.create(**kwargs).choices[0]
        calls, reason = choice.message.tool_calls, choice.finish_reason
    else:
        calls_by_index, reason = {}, None
        for chunk in client(router).chat.completions.create(stream=True, **kwargs):
            delta = chunk.choices[0].delta
            for part in delta.tool_calls or []:  # assembled as the openai client's own helpers do
                call = calls_by_index.setdefault(part.index, {"name": "", "arguments": ""})
                call["name"] += part.function.name or ""
                call["arguments"] += part.function.arguments or ""
            reason = chunk.choices[0].finish_reason or reason
        calls = [openai.types.chat.ChatCompletionMessageToolCall(
            id=f"c{i}", type="function", function={"name": c["name"], "arguments": c["arguments"]})
            for i, c in sorted(calls_by_index.items())]
    _arguments_validate(calls, ("get_weather",) if isinstance(tool_choice, dict) else ("get_weather", "get_time"))
    assert reason == ("stop" if isinstance(tool_choice, dict) else "tool_calls")


def test_auto_tool_choice_parses_hermes_tool_calls(router):
    """The model's text (held to the Hermes shape by a grammar, as an untuned model would not write it) is
    read by the router's Hermes parser into tool calls; the text before them is the content."""
    grammar = ('start: "Let me check." "\\n<tool_call>\\n" call "\\n</tool_call>"\n'
               'call: %json {"type": "object", "properties": {"name": {"const": "get_weather"}, '
               '"arguments": ' + json.dumps(WEATHER) + '}, "required": ["name", "arguments"], '
               '"additionalProperties": false}')
    response = client(router).chat.completions.create(
        model="default", messages=[{"role": "user", "content": "Weather in Oslo?"}], tools=TOOLS,
        tool_choice="auto", temperature=0, max_tokens=120, extra_body={"structured_outputs": {"grammar": grammar}})
    choice = response.choices[0]
    assert choice.message.content == "Let me check."
    _arguments_validate(choice.message.tool_calls, ("get_weather",))
    assert choice.finish_reason == "tool_calls"


def test_tokenize_and_detokenize_round_trip(router, offline):
    import httpx2 as httpx
    body = httpx.post(router.http_url + "/v1/tokenize", json={"prompt": "Hello there"}, timeout=60).json()
    assert body["tokens"] == offline.tokenizer.encode("Hello there") and body["count"] == len(body["tokens"])
    text = httpx.post(router.http_url + "/v1/detokenize", json={"tokens": body["tokens"]}, timeout=60).json()
    assert text == {"prompt": "Hello there"}
    bad = httpx.post(router.http_url + "/v1/detokenize", json={"tokens": [10 ** 9]}, timeout=60)
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "tokens"


@pytest.mark.parametrize(("extra", "param"), [
    ({"guided_regex": "a(b"}, "guided_regex"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nonsense"}}}},
     "response_format"),
    ({"structured_outputs": {"grammar": "start: missing_rule"}}, "structured_outputs.grammar"),
    ({"logit_bias": {"not-a-token": 1}}, "logit_bias"),
    ({"presence_penalty": 3}, "presence_penalty"),
    ({"guided_choice": ["a"], "guided_regex": "b"}, "guided_choice"),
    ({"tool_choice": "auto"}, "tool_choice"),
], ids=["regex", "response_format", "grammar", "logit_bias", "penalty", "two constraints", "tool_choice no tools"])
def test_http_refuses_bad_structured_parameters_naming_them(router, extra, param):
    import httpx2 as httpx
    for path, body in (("/v1/chat/completions", {"messages": CHAT}), ("/v1/completions", {"prompt": "Hi"})):
        if path == "/v1/completions" and param == "tool_choice":
            continue
        reply = httpx.post(router.http_url + path, json={**body, "max_tokens": 4, **extra}, timeout=60)
        assert reply.status_code == 400 and reply.json()["error"]["param"] == param, (path, reply.text)


def test_prompt_logprobs_come_back_through_prefill_and_decode_and_http(router, offline):
    """The prefill worker computes them with the prompt; they arrive with the first token, equal to the
    offline engine's; the OpenAI front shapes them as vLLM does."""
    prompt = offline.tokenizer.encode("Paris is the capital of France and Rome the capital of Italy. " * 4
                                      + "The capital of Spain is")  # over --skip-prefill-tokens: prefilled remotely
    params = SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True, prompt_logprobs=2)
    want = offline.generate([prompt], params)[0].completions[0].prompt_logprobs
    [got] = grpc_generate(router, params, "prompt-logprobs", token_ids=prompt)
    assert [e["token_id"] for e in got.prompt_logprobs] == prompt[1:]
    assert [e["logprob"] for e in got.prompt_logprobs] == pytest.approx([e["logprob"] for e in want], abs=1e-4)
    body = client(router).completions.create(model="default", prompt=prompt, max_tokens=2, temperature=0,
                                             extra_body={"prompt_logprobs": 1}).model_dump()
    shaped = body["choices"][0]["prompt_logprobs"]
    assert shaped[0] is None and len(shaped) == len(prompt)
    for token_id, entry in zip(prompt[1:], shaped[1:], strict=True):
        assert entry[str(token_id)]["rank"] >= 1 and len(entry) <= 2
