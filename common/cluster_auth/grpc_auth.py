"""gRPC interceptors carrying the cluster token: the worker checks, the router adds.

A worker started with a cluster secret answers every call without a valid token (for the method, for
this worker's address, unexpired, unused) with UNAUTHENTICATED before its handler runs and before the
request body is read; only grpc.health.v1 stays open (Kubernetes probes carry no token, and it reveals
nothing but SERVING / NOT_SERVING). No internal method streams requests: one that did could not be
bound to its body, and is refused.
"""
from __future__ import annotations

import hmac
import logging
import secrets
from collections.abc import Collection, Sequence

import grpc

from common.cluster_auth import tokens
from common.grpc_common import CHANNEL_OPTIONS

logger = logging.getLogger(__name__)
METADATA_KEY = "x-pdserve-cluster-token"
CHALLENGE_KEY = "x-pdserve-worker-challenge"
"""Router -> worker (GetStats): a fresh nonce the worker must answer under PROOF_KEY."""
PROOF_KEY = "x-pdserve-worker-proof"
MAX_CHALLENGE_CHARS = 64
OPEN_PREFIXES = ("/grpc.health.v1.Health/",)
REFUSAL = "this internal endpoint needs the cluster secret (no valid cluster token)"


class ClusterAuthServerInterceptor(grpc.aio.ServerInterceptor):
    """Refuses (UNAUTHENTICATED) calls without a valid token for their method and for this worker,
    from the metadata alone: a refused call's body is never read. An accepted call's body must be the
    one its token covers (checked as it is deserialized), and a router's challenge in its metadata is
    answered for the address the token named."""

    def __init__(self, key: bytes, audiences: Collection[str] = ()) -> None:
        self._key = key
        self.audiences: Collection[str] = audiences
        """The names this worker answers to (``host:port``; set once its port is bound)."""
        self._seen = tokens.ReplayGuard()
        self.num_refused = 0

    async def intercept_service(self, continuation, handler_call_details):
        method = handler_call_details.method
        handler = await continuation(handler_call_details)
        if handler is None or method.startswith(OPEN_PREFIXES):
            return handler
        metadata = handler_call_details.invocation_metadata or ()
        token = next((v for k, v in metadata if k == METADATA_KEY), None)
        claim = tokens.check(self._key, method, self.audiences, token)
        if claim is None:
            why = "no valid cluster token for this method and worker"
        elif handler.request_streaming:
            why = "a request stream cannot be bound to a token"
        elif not self._seen.first_use(claim):
            why = "a replayed cluster token"
        else:
            challenge = next((v for k, v in metadata if k == CHALLENGE_KEY), None)
            return _bound_to_body(handler, claim, self._proof(challenge, claim.audience))
        self.num_refused += 1
        logger.warning("refused %s: %s", method, why)
        return _refusing(handler)

    def _proof(self, challenge: object, audience: str) -> str | None:
        if isinstance(challenge, str) and 0 < len(challenge) <= MAX_CHALLENGE_CHARS:
            return tokens.worker_proof(self._key, challenge, audience)
        return None


_FOREIGN_BODY = object()
"""What the checking deserializer yields for a body its token does not cover."""


def _bound_to_body(handler: grpc.RpcMethodHandler, claim: tokens.Claim, proof: str | None) -> grpc.RpcMethodHandler:
    """`handler`, whose request must hash to the token's body digest (else UNAUTHENTICATED) and whose
    initial metadata carries `proof` when the router sent a challenge."""
    def deserialize(raw: bytes):
        if not hmac.compare_digest(tokens.body_digest(raw), claim.body_digest):
            return _FOREIGN_BODY
        return handler.request_deserializer(raw) if handler.request_deserializer else raw

    async def admit(request, context) -> None:
        if request is _FOREIGN_BODY:
            logger.warning("refused a call whose body its cluster token does not cover")
            await context.abort(grpc.StatusCode.UNAUTHENTICATED, REFUSAL)
        if proof is not None:
            await context.send_initial_metadata([(PROOF_KEY, proof)])

    async def unary(request, context):
        await admit(request, context)
        return await handler.unary_unary(request, context)

    async def streaming(request, context):
        await admit(request, context)
        responses = handler.unary_stream(request, context)
        try:
            async for response in responses:
                yield response
        finally:
            await responses.aclose()

    if handler.response_streaming:
        return grpc.unary_stream_rpc_method_handler(streaming, deserialize, handler.response_serializer)
    return grpc.unary_unary_rpc_method_handler(unary, deserialize, handler.response_serializer)


def _refusing(handler: grpc.RpcMethodHandler) -> grpc.RpcMethodHandler:
    """A handler that aborts with UNAUTHENTICATED without reading the request: it takes the request as
    a stream it never asks for, so gRPC reads no more of the body than its flow-control window."""
    async def unary(requests, context):
        await context.abort(grpc.StatusCode.UNAUTHENTICATED, REFUSAL)

    async def streaming(requests, context):
        await context.abort(grpc.StatusCode.UNAUTHENTICATED, REFUSAL)
        yield  # pragma: no cover - makes this an async generator

    if handler.response_streaming:
        return grpc.stream_stream_rpc_method_handler(streaming, None, handler.response_serializer)
    return grpc.stream_unary_rpc_method_handler(unary, None, handler.response_serializer)


def _with_token(key: bytes, audience: str, details: grpc.aio.ClientCallDetails, request) -> grpc.aio.ClientCallDetails:
    """`details` plus a fresh token for the call's method, the worker dialled and the request, in its metadata."""
    method = details.method.decode() if isinstance(details.method, bytes) else details.method
    token = tokens.mint(key, method, audience, request.SerializeToString())
    return details._replace(metadata=grpc.aio.Metadata(*(details.metadata or ()), (METADATA_KEY, token)))


# Two classes: grpc.aio files an interceptor under the first call kind it implements only.
class _UnaryUnaryToken(grpc.aio.UnaryUnaryClientInterceptor):
    def __init__(self, key: bytes, audience: str) -> None:
        self._key, self._audience = key, audience

    async def intercept_unary_unary(self, continuation, client_call_details, request):
        return await continuation(_with_token(self._key, self._audience, client_call_details, request), request)


class _UnaryStreamToken(grpc.aio.UnaryStreamClientInterceptor):
    def __init__(self, key: bytes, audience: str) -> None:
        self._key, self._audience = key, audience

    async def intercept_unary_stream(self, continuation, client_call_details, request):
        return await continuation(_with_token(self._key, self._audience, client_call_details, request), request)


async def call_with_challenge(rpc, request, key: bytes | None, address: str, timeout: float):
    """Router side: call a unary `rpc` of the worker dialled as `address` with a fresh challenge; returns
    (response, proven), where proven says the worker answered with the cluster secret's proof for that
    address (always True without a key)."""
    if key is None:
        return await rpc(request, timeout=timeout), True
    challenge = secrets.token_hex(16)
    call = rpc(request, timeout=timeout, metadata=((CHALLENGE_KEY, challenge),))
    response = await call
    proof = next((v for k, v in await call.initial_metadata() or () if k == PROOF_KEY), None)
    return response, tokens.worker_proof_ok(key, challenge, address, proof)


def worker_channel(address: str, key: bytes | None, credentials: grpc.ChannelCredentials | None = None,
                   tls_options: Sequence[tuple[str, str]] = ()) -> grpc.aio.Channel:
    """A channel to a worker; with a key every call carries a cluster token addressed to `address`, with
    credentials it is mTLS
    (``tls_options``: e.g. the name checked in the worker's certificate)."""
    interceptors = [_UnaryUnaryToken(key, address), _UnaryStreamToken(key, address)] if key is not None else None
    if credentials is not None:
        return grpc.aio.secure_channel(address, credentials, options=[*CHANNEL_OPTIONS, *tls_options],
                                       interceptors=interceptors)
    return grpc.aio.insecure_channel(address, options=CHANNEL_OPTIONS, interceptors=interceptors)
