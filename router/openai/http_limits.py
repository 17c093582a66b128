"""How long the OpenAI front waits for a request, and how many connections may wait for one: the
config of router/openai/guarded_protocol.py (its fields' metadata make the router's --http-* flags)."""
from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class HttpLimits:
    """How long the OpenAI front waits for a request, and how many may be waited for."""

    header_timeout_s: float = field(default=10.0, metadata={
        "flag": "--http-header-timeout-s",
        "help": "a request's line and headers must arrive within this many seconds of the connection "
                "being ready for them (opened, or the previous response sent); else it is closed"})
    body_timeout_s: float = field(default=30.0, metadata={
        "flag": "--http-body-timeout-s",
        "help": "a request's body must arrive within this many seconds after its headers; else the "
                "connection is closed"})
    max_pending_connections: int = field(default=256, metadata={
        "flag": "--http-max-pending-connections",
        "help": "connections that may wait for a request's headers at once; one more closes the one "
                "waiting longest"})

    def __post_init__(self) -> None:
        for name in ("header_timeout_s", "body_timeout_s"):
            if not 0 < getattr(self, name) < float("inf"):
                raise ValueError(f"http {name} must be > 0 and finite, got {getattr(self, name)!r}")
        if self.max_pending_connections < 1:
            raise ValueError(f"http max_pending_connections must be >= 1, got {self.max_pending_connections!r}")

