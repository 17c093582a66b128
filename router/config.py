"""Configuration of one router process."""
from __future__ import annotations

from dataclasses import dataclass, field

ROUTING_POLICIES = ("least_loaded", "round_robin")


@dataclass
class RouterConfig:
    model: str = "default"
    """Checkpoint directory (tokenizer, chat template, context length) or 'default'."""
    host: str = "127.0.0.1"
    port: int = 0
    """gRPC port; 0 picks a free one."""
    prefill_workers: list[str] = field(default_factory=list)
    """host:port of each prefill worker; none means decode workers prefill themselves (co-located)."""
    decode_workers: list[str] = field(default_factory=list)
    """host:port of each decode worker (until one is known, requests get UNAVAILABLE)."""
    routing_policy: str = "least_loaded"
    max_model_len: int | None = None
    """Longest prompt plus output; defaults to the model's max_position_embeddings."""
    health_interval_s: float = 1.0
    """How often each worker's stats and health are polled."""
    lease_s: float = 30.0
    """How long a prefill worker holds a prompt's KV for the decode worker."""
    metrics_port: int | None = None
    """Serve Prometheus metrics at http://host:metrics_port/metrics."""
    http_port: int | None = None
    """Serve the OpenAI-compatible HTTP API at http://host:http_port/v1 (0 picks a free port)."""
    drain_timeout_s: float = 30.0
    """On SIGTERM: how long in-flight requests may take before the process exits."""

    def __post_init__(self) -> None:
        for address in [*self.prefill_workers, *self.decode_workers]:
            host, _, port = address.rpartition(":")
            if not host or not port.isdigit():
                raise ValueError(f"worker address must be host:port, got {address!r}")
        if self.routing_policy not in ROUTING_POLICIES:
            raise ValueError(f"routing_policy must be one of {ROUTING_POLICIES}, got {self.routing_policy!r}")
        if not 0 <= self.port <= 65535:
            raise ValueError(f"port out of range: {self.port}")
        for name in ("metrics_port", "http_port"):
            value = getattr(self, name)
            if value is not None and not 0 <= value <= 65535:
                raise ValueError(f"{name} out of range: {value}")
        for name in ("health_interval_s", "lease_s", "drain_timeout_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be > 0")
