"""The /metrics HTTP endpoint of every pdserve process, always in the Prometheus text format.

Workers also answer probes here (``/health``: the process serves HTTP; ``/ready``: it takes work),
for Kubernetes when their gRPC port speaks mutual TLS, which the kubelet's gRPC probes cannot.

prometheus_client's own server answers Prometheus (which asks for OpenMetrics
first) with OpenMetrics, and its OpenMetrics writer (0.26) turns the ':' of our
`pdserve:` names into '_' in sample lines. The text format keeps names as they
are, and Prometheus reads it just as well.

The port is unauthenticated, so strangers must not be able to fill it: it is served by one asyncio
loop on one thread (an idle connection costs a socket, not a thread), each connection gets
`REQUEST_TIMEOUT_S` to send its request head (at most `MAX_HEAD_BYTES`) and is closed after one
response, and beyond `MAX_CONNECTIONS` open at once the oldest is closed, so a scraper or a probe
always gets in.
"""
from __future__ import annotations

import asyncio
import threading
from collections import OrderedDict
from collections.abc import Callable
from http import HTTPStatus

from prometheus_client import CollectorRegistry, generate_latest

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
REQUEST_TIMEOUT_S = 10.0
"""How long a connection may take to send its request line and headers."""
MAX_HEAD_BYTES = 8192
"""Largest request line plus headers read; more is answered 431 and closed."""
MAX_CONNECTIONS = 64
"""Connections open at once; one more closes the oldest (which has waited longest for its request)."""


class MetricsServer:
    def __init__(self, registry: CollectorRegistry, host: str, port: int,
                 ready: Callable[[], bool] | None = None) -> None:
        self._registry = registry
        self._ready = ready
        self._open: OrderedDict[asyncio.StreamWriter, None] = OrderedDict()
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="metrics-http", daemon=True)
        self._thread.start()  # its own loop: the caller's (if any) is not blocked by scrapes
        try:
            self._server = asyncio.run_coroutine_threadsafe(
                asyncio.start_server(self._serve, host, port, limit=MAX_HEAD_BYTES), self._loop).result()
        except BaseException:
            self._stop_loop()
            raise
        self.port = self._server.sockets[0].getsockname()[1]

    def close(self) -> None:
        """Stop listening, close every open connection and the loop's thread."""
        asyncio.run_coroutine_threadsafe(self._shutdown(), self._loop).result(timeout=10)
        self._stop_loop()

    def _stop_loop(self) -> None:
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=10)
        self._loop.close()

    async def _shutdown(self) -> None:
        self._server.close()
        for writer in list(self._open):
            writer.transport.abort()
        await self._server.wait_closed()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self._open[writer] = None
        if len(self._open) > MAX_CONNECTIONS:
            self._open.popitem(last=False)[0].transport.abort()
        try:
            status, body, content_type = await self._answer(reader)
            head = (f"HTTP/1.1 {status.value} {status.phrase}\r\nContent-Type: {content_type}\r\n"
                    f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n")
            writer.write(head.encode("latin-1") + body)
            await asyncio.wait_for(writer.drain(), REQUEST_TIMEOUT_S)
        except (OSError, asyncio.TimeoutError, asyncio.IncompleteReadError):
            pass  # the client went away, or took too long: nothing to answer
        finally:
            self._open.pop(writer, None)
            writer.transport.abort()

    async def _answer(self, reader: asyncio.StreamReader) -> tuple[HTTPStatus, bytes, str]:
        try:
            head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), REQUEST_TIMEOUT_S)
        except asyncio.LimitOverrunError:
            return HTTPStatus.REQUEST_HEADER_FIELDS_TOO_LARGE, b"request head too large\n", "text/plain"
        method, _, rest = head.partition(b" ")
        path = rest.split(b" ", 1)[0].split(b"?", 1)[0].decode("latin-1")
        if method != b"GET":
            return HTTPStatus.METHOD_NOT_ALLOWED, b"GET only\n", "text/plain"
        if self._ready is not None and path in ("/health", "/ready"):
            ok = path == "/health" or self._ready()
            return (HTTPStatus.OK, b"ok\n", "text/plain") if ok else \
                (HTTPStatus.SERVICE_UNAVAILABLE, b"not ready\n", "text/plain")
        if path not in ("/metrics", "/"):
            return HTTPStatus.NOT_FOUND, b"not found\n", "text/plain"
        return HTTPStatus.OK, generate_latest(self._registry), CONTENT_TYPE
