"""A client's channel to a router's public front: TLS verified against a CA, and an API key.

The key rides as `authorization: Bearer KEY` on every call: as call credentials over TLS
(gRPC sends those only on secure channels), and through an interceptor on a plaintext
channel (a loopback router with keys). Keys come from a file or $PDSERVE_API_KEY, never
from the command line.
"""
from __future__ import annotations

import os

import grpc

from common.grpc_common import CHANNEL_OPTIONS

API_KEY_ENV = "PDSERVE_API_KEY"


def api_key(key_file: str | None = None) -> str | None:
    """The client's API key: the first line of `key_file`, else $PDSERVE_API_KEY, else None."""
    if key_file is not None:
        with open(key_file, encoding="utf-8") as f:
            return f.readline().strip() or None
    return os.environ.get(API_KEY_ENV) or None


def client_channel(address: str, tls_ca_file: str | None = None, key: str | None = None) -> grpc.aio.Channel:
    """An asyncio channel to `address`: TLS when `tls_ca_file` is given, plaintext otherwise;
    every call carries `key` when given."""
    if tls_ca_file is None:
        # grpc.aio files each interceptor under one call kind only: one object per kind.
        entry = ("authorization", f"Bearer {key}")
        interceptors = [_UnaryUnaryBearer(entry), _UnaryStreamBearer(entry)] if key else None
        return grpc.aio.insecure_channel(address, options=CHANNEL_OPTIONS, interceptors=interceptors)
    with open(tls_ca_file, "rb") as f:
        credentials = grpc.ssl_channel_credentials(root_certificates=f.read())
    if key:
        credentials = grpc.composite_channel_credentials(credentials, grpc.access_token_call_credentials(key))
    return grpc.aio.secure_channel(address, credentials, options=CHANNEL_OPTIONS)


def _with_key(details, entry: tuple[str, str]):
    return details._replace(metadata=grpc.aio.Metadata(*(details.metadata or ()), entry))


class _UnaryUnaryBearer(grpc.aio.UnaryUnaryClientInterceptor):
    def __init__(self, entry: tuple[str, str]) -> None:
        self.entry = entry

    async def intercept_unary_unary(self, continuation, client_call_details, request):
        return await continuation(_with_key(client_call_details, self.entry), request)


class _UnaryStreamBearer(grpc.aio.UnaryStreamClientInterceptor):
    def __init__(self, entry: tuple[str, str]) -> None:
        self.entry = entry

    async def intercept_unary_stream(self, continuation, client_call_details, request):
        return await continuation(_with_key(client_call_details, self.entry), request)
