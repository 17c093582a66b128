"""gRPC interceptors carrying the cluster token: the worker checks, the router adds.

A worker started with a cluster secret answers every call without a valid token with
UNAUTHENTICATED before its handler runs; only grpc.health.v1 stays open (Kubernetes probes
carry no token, and it reveals nothing but SERVING / NOT_SERVING).
"""
from __future__ import annotations

import logging
import secrets
from collections.abc import Sequence

import grpc

from pdserve.cluster_auth import tokens
from pdserve.grpc_common import CHANNEL_OPTIONS

logger = logging.getLogger(__name__)
METADATA_KEY = "x-pdserve-cluster-token"
CHALLENGE_KEY = "x-pdserve-worker-challenge"
"""Router -> worker (GetStats): a fresh nonce the worker must answer under PROOF_KEY."""
PROOF_KEY = "x-pdserve-worker-proof"
MAX_CHALLENGE_CHARS = 64
OPEN_PREFIXES = ("/grpc.health.v1.Health/",)
REFUSAL = "this internal endpoint needs the cluster secret (no valid cluster token)"


class ClusterAuthServerInterceptor(grpc.aio.ServerInterceptor):
    """Refuses (UNAUTHENTICATED) calls without a valid token for their method."""

    def __init__(self, key: bytes) -> None:
        self._key = key
        self._seen = tokens.ReplayGuard()
        self.num_refused = 0

    async def intercept_service(self, continuation, handler_call_details):
        method = handler_call_details.method
        handler = await continuation(handler_call_details)
        if handler is None or method.startswith(OPEN_PREFIXES):
            return handler
        token = next((v for k, v in handler_call_details.invocation_metadata or () if k == METADATA_KEY), None)
        valid = tokens.check(self._key, method, token)
        if valid and self._seen.first_use(token):
            return handler
        self.num_refused += 1
        logger.warning("refused %s: %s", method, "a replayed cluster token" if valid else "no valid cluster token")
        return _refusing(handler)


def _refusing(handler: grpc.RpcMethodHandler) -> grpc.RpcMethodHandler:
    """A handler of the same shape as `handler` that only aborts with UNAUTHENTICATED."""
    async def unary(request, context):
        await context.abort(grpc.StatusCode.UNAUTHENTICATED, REFUSAL)

    async def streaming(request, context):
        await context.abort(grpc.StatusCode.UNAUTHENTICATED, REFUSAL)
        yield  # pragma: no cover - makes this an async generator

    codec = {"request_deserializer": handler.request_deserializer,
             "response_serializer": handler.response_serializer}
    if handler.request_streaming and handler.response_streaming:
        return grpc.stream_stream_rpc_method_handler(streaming, **codec)
    if handler.request_streaming:
        return grpc.stream_unary_rpc_method_handler(unary, **codec)
    if handler.response_streaming:
        return grpc.unary_stream_rpc_method_handler(streaming, **codec)
    return grpc.unary_unary_rpc_method_handler(unary, **codec)


def _with_token(key: bytes, details: grpc.aio.ClientCallDetails) -> grpc.aio.ClientCallDetails:
    """`details` plus a fresh token for the call's method in its metadata."""
    method = details.method.decode() if isinstance(details.method, bytes) else details.method
    metadata = grpc.aio.Metadata(*(details.metadata or ()), (METADATA_KEY, tokens.mint(key, method)))
    return details._replace(metadata=metadata)


# Two classes: grpc.aio files an interceptor under the first call kind it implements only.
class _UnaryUnaryToken(grpc.aio.UnaryUnaryClientInterceptor):
    def __init__(self, key: bytes) -> None:
        self._key = key

    async def intercept_unary_unary(self, continuation, client_call_details, request):
        return await continuation(_with_token(self._key, client_call_details), request)


class _UnaryStreamToken(grpc.aio.UnaryStreamClientInterceptor):
    def __init__(self, key: bytes) -> None:
        self._key = key

    async def intercept_unary_stream(self, continuation, client_call_details, request):
        return await continuation(_with_token(self._key, client_call_details), request)


async def answer_challenge(context, key: bytes | None) -> None:
    """Worker side of the mutual check: answer a router's challenge in the initial metadata."""
    if key is None:
        return
    challenge = next((v for k, v in context.invocation_metadata() or () if k == CHALLENGE_KEY), None)
    if isinstance(challenge, str) and 0 < len(challenge) <= MAX_CHALLENGE_CHARS:
        await context.send_initial_metadata([(PROOF_KEY, tokens.worker_proof(key, challenge))])


async def call_with_challenge(rpc, request, key: bytes | None, timeout: float):
    """Router side: call a unary `rpc` with a fresh challenge; returns (response, proven), where
    proven says the worker answered with the cluster secret's proof (always True without a key)."""
    if key is None:
        return await rpc(request, timeout=timeout), True
    challenge = secrets.token_hex(16)
    call = rpc(request, timeout=timeout, metadata=((CHALLENGE_KEY, challenge),))
    response = await call
    proof = next((v for k, v in await call.initial_metadata() or () if k == PROOF_KEY), None)
    return response, tokens.worker_proof_ok(key, challenge, proof)


def server_interceptors(key: bytes | None) -> Sequence[grpc.aio.ServerInterceptor]:
    return [ClusterAuthServerInterceptor(key)] if key is not None else []


def worker_channel(address: str, key: bytes | None, credentials: grpc.ChannelCredentials | None = None,
                   tls_options: Sequence[tuple[str, str]] = ()) -> grpc.aio.Channel:
    """A channel to a worker; with a key every call carries a cluster token, with credentials it is mTLS
    (``tls_options``: e.g. the name checked in the worker's certificate)."""
    interceptors = [_UnaryUnaryToken(key), _UnaryStreamToken(key)] if key is not None else None
    if credentials is not None:
        return grpc.aio.secure_channel(address, credentials, options=[*CHANNEL_OPTIONS, *tls_options],
                                       interceptors=interceptors)
    return grpc.aio.insecure_channel(address, options=CHANNEL_OPTIONS, interceptors=interceptors)
