"""Slow and idle HTTP clients cut off on the OpenAI front: deadlines on reading each request, and a cap
on connections waiting for one.

uvicorn closes a connection idle between requests (`timeout_keep_alive`) and bounds a request head's
size (h11, 16 KiB), but has no deadline on a request being sent: a client trickling its request line
or headers (slowloris) or its body holds the connection and its buffers open indefinitely, before
any API key is checked. `GuardedH11Protocol` (uvicorn's h11 protocol) adds, per connection:
- *headers*: a request's line and headers must be complete within `header_timeout_s` of the moment
  the connection could send them (opened, or its previous response finished);
- *body*: its body within `body_timeout_s` after the headers;
past either deadline the connection is closed (an app reading the body sees a disconnect). Responses
are not limited (a stream may take minutes). And at most `max_pending_connections` connections may
wait for their request's headers at once: one more closes the one that has waited longest (a client
that is not an attacker sends its headers in its first packets, so it is rarely the oldest), so
strangers cannot hold every slot. TLS handshakes come before all this (asyncio's 60 s handshake
timeout bounds them).
"""
from __future__ import annotations

import asyncio
from collections import OrderedDict

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol

from router.openai.http_limits import HttpLimits


class PendingConnections:
    """The connections of one server waiting for a request's headers, oldest first."""

    def __init__(self, limits: HttpLimits) -> None:
        self.limits = limits
        self._waiting: OrderedDict[GuardedH11Protocol, None] = OrderedDict()

    def add(self, protocol: GuardedH11Protocol) -> None:
        self._waiting[protocol] = None
        if len(self._waiting) > self.limits.max_pending_connections:
            self._waiting.popitem(last=False)[0].cut_off()

    def discard(self, protocol: GuardedH11Protocol) -> None:
        self._waiting.pop(protocol, None)


class GuardedH11Protocol(H11Protocol):
    """uvicorn's h11 protocol with the header and body deadlines and the pending cap above."""

    def __init__(self, *args, pending: PendingConnections, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self._pending = pending
        self._phase: object = None
        """The h11 state of the client's side that the deadline was armed for."""
        self._deadline: asyncio.TimerHandle | None = None

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._follow()

    def data_received(self, data: bytes) -> None:
        super().data_received(data)
        self._follow()

    def on_response_complete(self) -> None:
        super().on_response_complete()
        self._follow()  # kept alive: now waiting for the next request's headers

    def connection_lost(self, exc: Exception | None) -> None:
        self._pending.discard(self)
        self._disarm()
        super().connection_lost(exc)

    def cut_off(self) -> None:
        """Close at once: no response, nothing more read."""
        self._pending.discard(self)
        self._disarm()
        self.transport.abort()

    def _follow(self) -> None:
        """Arm the deadline of what the client is sending now (headers or body); none once it has sent
        a whole request."""
        state = self.conn.their_state
        if self.transport.is_closing() or state is self._phase:
            return
        self._disarm()
        self._phase = state
        if state is h11.IDLE:
            self._arm(self._pending.limits.header_timeout_s)
            self._pending.add(self)
        elif state is h11.SEND_BODY:
            self._pending.discard(self)
            self._arm(self._pending.limits.body_timeout_s)
        else:
            self._pending.discard(self)

    def _arm(self, timeout_s: float) -> None:
        self._deadline = self.loop.call_later(timeout_s, self.cut_off)

    def _disarm(self) -> None:
        if self._deadline is not None:
            self._deadline.cancel()
            self._deadline = None
