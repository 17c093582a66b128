"""The OpenAI-compatible routes, on the same RequestRunner as the gRPC front.

POST /v1/completions, POST /v1/chat/completions (JSON, or server-sent events
ending in `data: [DONE]` with "stream": true), GET /v1/models, GET /health, and
vLLM's POST /v1/tokenize and /v1/detokenize (also at /tokenize, /detokenize).
With API keys configured every route but /health needs `Authorization: Bearer KEY`
(router/openai/auth.py); the key's tenant salts the request's prefix-cache blocks.
A streamed response's status and headers wait for the first token, so a request
refused by the pipeline (overload, draining, no worker) still gets its HTTP
status. A client that disconnects, before or during the stream, aborts the
request on every worker.
"""
from __future__ import annotations

import asyncio
import time
import uuid

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse

from common.client import collect_samples
from common.protocol import generate_pb2
from engine.sampling_params import InvalidParameter
from router.auth import ApiKeys
from router.openai import errors
from router.openai.auth import ApiKeyAuth, tenant_of
from router.openai.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    TokenizeRequest,
    message_text,
)
from router.openai.responses import ChatCompletions, Completions, SseStream, ToolChatCompletions, sse
from router.requests import RequestFailed, RequestRunner

CLIENT_CLOSED_REQUEST = 499


class ClientDisconnected(Exception):
    pass


def create_app(runner: RequestRunner, model_name: str, max_body_bytes: int = 4 << 20,
               keys: ApiKeys | None = None, tool_call_parser: str | None = None) -> FastAPI:
    app = FastAPI(title="pdserve", docs_url=None, redoc_url=None)
    app.add_middleware(BodyLimit, max_bytes=max_body_bytes)
    app.add_middleware(ApiKeyAuth, keys=keys or ApiKeys(env={}))  # the outer one: no body read before a key

    @app.exception_handler(RequestValidationError)
    async def invalid_body(request: Request, exc: RequestValidationError) -> JSONResponse:
        return errors.validation_error(exc)

    tokenizer = runner.builder.tokenizer
    created = int(time.time())

    def token_text(token_id: int) -> str:
        return tokenizer.decode([token_id], skip_special_tokens=False)

    @app.get("/health")
    async def health() -> Response:
        return Response(status_code=503 if runner.draining else 200)

    @app.get("/v1/models")
    async def models() -> dict:
        return {"object": "list", "data": [{"id": model_name, "object": "model", "created": created,
                                            "owned_by": "pdserve", "max_model_len": runner.builder.max_model_len}]}

    @app.post("/v1/tokenize")
    @app.post("/tokenize")
    async def tokenize(body: TokenizeRequest) -> Response:
        try:
            if body.model is not None and body.model != model_name:
                return errors.model_not_found(body.model)
            msg = generate_pb2.GenerateRequest()
            if (body.prompt is None) == (body.messages is None):
                raise InvalidParameter("prompt", "give one of prompt or messages")
            if body.prompt is not None:
                msg.text = body.prompt
            else:
                msg.chat.messages.extend(generate_pb2.ChatMessage(role=m.role, content=message_text(m.content))
                                         for m in body.messages)
            builder = runner.builder
            builder.check_size(msg)
            ids = await asyncio.get_running_loop().run_in_executor(None, builder.prompt_token_ids, msg)
        except InvalidParameter as exc:
            return errors.invalid(exc.field.replace("text", "prompt").replace("chat.", ""), str(exc))
        return JSONResponse({"tokens": ids, "count": len(ids), "max_model_len": runner.builder.max_model_len})

    @app.post("/v1/detokenize")
    @app.post("/detokenize")
    async def detokenize(body: DetokenizeRequest) -> Response:
        if body.model is not None and body.model != model_name:
            return errors.model_not_found(body.model)
        bad = next((t for t in body.tokens if not 0 <= t < runner.builder.vocab_size), None)
        if bad is not None:
            return errors.invalid("tokens", f"tokens: token id {bad} is outside the vocabulary")
        return JSONResponse({"prompt": tokenizer.decode(body.tokens, skip_special_tokens=False)})

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request) -> Response:
        request_id = f"cmpl-{uuid.uuid4().hex}"
        return await generate(body, request, request_id, lambda mode: Completions(request_id, model_name, token_text))

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, request: Request) -> Response:
        request_id = f"chatcmpl-{uuid.uuid4().hex}"
        return await generate(body, request, request_id, lambda mode: (
            ToolChatCompletions(request_id, model_name, token_text, mode) if mode
            else ChatCompletions(request_id, model_name, token_text)))

    async def generate(body, request: Request, request_id: str, make_api) -> Response:
        """`make_api(tool_mode)`: the response shapes, once the body's tool mode is known."""
        try:
            body.check_text()  # first: even the model-not-found error would echo an unencodable model name
        except InvalidParameter as exc:
            return errors.invalid(exc.field, str(exc))
        if body.model is not None and body.model != model_name:
            return errors.model_not_found(body.model)
        try:
            msg = body.to_generate_request(request_id, tool_call_parser)
        except InvalidParameter as exc:
            return errors.invalid(exc.field, str(exc))
        api = make_api(getattr(body, "tool_mode", None))
        want_logprobs = msg.params.HasField("logprobs")
        responses = runner.generate(msg, max_tokens_to_context=body.default_max_tokens is None,
                                    tenant=tenant_of(request.scope))
        try:
            if not body.stream:
                samples = await _until_disconnected(request, collect_samples(responses))
                return JSONResponse(api.response(samples, want_logprobs))
            first = await _until_disconnected(request, anext(responses))
        except RequestFailed as exc:
            return _failure(exc, body)
        except ClientDisconnected:
            return Response(status_code=CLIENT_CLOSED_REQUEST)
        last_at = body.requested_max_tokens or body.default_max_tokens
        stream = SseStream(api, want_logprobs, body.include_usage, last_at)
        return StreamingResponse(_events(stream, first, responses, body), media_type="text/event-stream")

    return app


class _BodyTooLarge(Exception):
    pass


class BodyLimit:
    """ASGI middleware: a request body over `max_bytes` gets 413 before it is read whole
    (a Content-Length over it at once; a chunked body as soon as it passes it)."""

    def __init__(self, app, max_bytes: int) -> None:
        self.app = app
        self.max_bytes = max_bytes

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        length = dict(scope["headers"]).get(b"content-length")
        if length is not None and (not length.isdigit() or int(length) > self.max_bytes):
            await self._refuse(scope, receive, send)
            return
        received = 0

        async def limited_receive():
            nonlocal received
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > self.max_bytes:
                    raise _BodyTooLarge()
            return message

        try:
            await self.app(scope, limited_receive, send)
        except _BodyTooLarge:
            await self._refuse(scope, receive, send)

    async def _refuse(self, scope, receive, send) -> None:
        response = errors.error_response(413, f"the request body is over {self.max_bytes} bytes",
                                         "invalid_request_error", "request_too_large")
        await response(scope, receive, send)


async def _events(stream: SseStream, first, responses, body):
    """The SSE body; an error after the first token becomes an error event before [DONE]."""
    try:
        for event in stream.on_message(first):
            yield event
        async for msg in responses:
            for event in stream.on_message(msg):
                yield event
    except RequestFailed as exc:
        yield sse(errors.failed_body(exc, *_openai_message(exc, body)))
        yield sse("[DONE]")
        return
    finally:
        await responses.aclose()  # the client went away: abort on every worker
    for event in stream.end():
        yield event


def _failure(exc: RequestFailed, body) -> JSONResponse:
    status, headers = errors.failed_status(exc)
    return JSONResponse(errors.failed_body(exc, *_openai_message(exc, body)), status_code=status, headers=headers)


def _openai_message(exc: RequestFailed, body) -> tuple[str, str | None]:
    """(message, param) with RequestBuilder's field names replaced by the OpenAI parameter names."""
    if exc.field is None:
        return str(exc), None
    param = body.openai_param(exc.field)
    return f"{param}: {str(exc).split(': ', 1)[1]}", param


async def _until_disconnected(request: Request, awaitable):
    """Await `awaitable`, cancelling it (and so the request) if the client disconnects first."""
    work = asyncio.ensure_future(awaitable)
    watch = asyncio.ensure_future(_disconnected(request))
    try:
        done, _ = await asyncio.wait({work, watch}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watch.cancel()
        if not work.done():
            work.cancel()
            await asyncio.gather(work, return_exceptions=True)
    if work not in done:
        raise ClientDisconnected()
    return work.result()


async def _disconnected(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass
