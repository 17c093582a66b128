"""uvicorn serving the OpenAI app as a task on the router's own asyncio loop, with deadlines on reading
requests and a cap on connections waiting for one (router/openai/guarded_protocol.py)."""
from __future__ import annotations

import asyncio
import contextlib
import functools
import socket

import uvicorn

from router.openai.guarded_protocol import GuardedH11Protocol, PendingConnections
from router.openai.http_limits import HttpLimits


class _Server(uvicorn.Server):
    @contextlib.contextmanager
    def capture_signals(self):
        yield  # the router process owns SIGTERM/SIGINT (drain, then stop)


class HttpServer:
    def __init__(self, app, host: str, port: int, tls_cert_file: str | None = None,
                 tls_key_file: str | None = None, limits: HttpLimits | None = None) -> None:
        self.app = app
        self.host = host
        self.port = port
        self.tls_cert_file = tls_cert_file
        """With tls_key_file: serve HTTPS only (uvicorn's TLS on the same socket)."""
        self.tls_key_file = tls_key_file
        self.limits = limits or HttpLimits()
        self._server: _Server | None = None
        self._task: asyncio.Task | None = None

    async def start(self) -> int:
        """Bind and serve; returns the port (useful when 0 was asked for)."""
        family = socket.AF_INET6 if ":" in self.host else socket.AF_INET
        sock = socket.create_server((self.host, self.port), family=family)
        self.port = sock.getsockname()[1]
        protocol = functools.partial(GuardedH11Protocol, pending=PendingConnections(self.limits))
        config = uvicorn.Config(self.app, log_level="warning", lifespan="off", access_log=False, http=protocol,
                                ssl_certfile=self.tls_cert_file, ssl_keyfile=self.tls_key_file)
        self._server = _Server(config)
        self._task = asyncio.create_task(self._server.serve(sockets=[sock]))
        while not self._server.started:
            if self._task.done():
                self._task.result()
                raise RuntimeError("the HTTP server stopped while starting")
            await asyncio.sleep(0.01)
        return self.port

    @property
    def ssl_context(self):
        """The TLS context serving new connections (None without TLS)."""
        return self._server.config.ssl if self._server is not None else None

    async def stop(self, grace_s: float) -> None:
        """Close the listener; open responses get `grace_s`, then their tasks are cancelled."""
        if self._server is None:
            return
        self._server.config.timeout_graceful_shutdown = grace_s
        self._server.should_exit = True
        await self._task
