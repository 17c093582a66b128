"""Request messages protobuf cannot parse answered INVALID_ARGUMENT, not gRPC's UNKNOWN.

A protobuf string must be UTF-8: a client that sends other bytes (those of a lone surrogate, ED A0 80,
say) makes the generated deserializer raise DecodeError before any handler runs, which grpc reports
as UNKNOWN ("Unexpected <class DecodeError>"), the status of a server bug. With this interceptor the
deserializer of every unary-request method returns a marker instead, and the call is answered
INVALID_ARGUMENT with the parse error, like any other bad field.
"""
from __future__ import annotations

import inspect

import grpc
from google.protobuf.message import DecodeError


class InvalidMessages(grpc.aio.ServerInterceptor):
    async def intercept_service(self, continuation, handler_call_details):
        handler = await continuation(handler_call_details)
        if handler is None or handler.request_streaming or handler.request_deserializer is None:
            return handler
        kind = "unary_stream" if handler.response_streaming else "unary_unary"
        return handler._replace(request_deserializer=_tolerant(handler.request_deserializer),
                                **{kind: _refusing(getattr(handler, kind))})


class _Undecodable:
    def __init__(self, error: DecodeError) -> None:
        self.error = error


def _tolerant(deserialize):
    def parse(data: bytes):
        try:
            return deserialize(data)
        except DecodeError as exc:
            return _Undecodable(exc)
    return parse


async def _refuse(request, context) -> None:
    if isinstance(request, _Undecodable):
        await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"the request message is invalid: {request.error}")


def _refusing(behavior):
    if inspect.isasyncgenfunction(behavior):
        async def stream(request, context):
            await _refuse(request, context)
            async for response in behavior(request, context):
                yield response
        return stream

    async def call(request, context):
        await _refuse(request, context)
        return await behavior(request, context)
    return call
