"""Configuration of one router process."""
from __future__ import annotations

import os
from dataclasses import dataclass, field

from common.cluster_auth import ClusterAuthConfig
from common.cluster_auth.tls import InternalTLSConfig
from common.config_flags import comma_list
from router.front_security import FrontSecurityConfig
from router.openai.http_limits import HttpLimits
from router.openai.tool_parsers import TOOL_CALL_PARSERS
from router.routing_policy import POLICIES as ROUTING_POLICIES
from router.routing_policy import RoutingWeights


@dataclass
class RouterConfig:
    model: str = field(default="default", metadata={
        "help": "checkpoint directory (tokenizer, chat template, context length), or 'default'"})
    """Checkpoint directory (tokenizer, chat template, context length) or 'default'."""
    host: str = field(default="127.0.0.1", metadata={"help": "interface the gRPC and HTTP fronts bind to"})
    port: int = field(default=0, metadata={"flag_default": 50051, "help": "gRPC port of the Generation service"})
    """gRPC port; 0 picks a free one."""
    prefill_workers: list[str] = field(default_factory=list, metadata={
        "type": comma_list, "help": "comma-separated host:port of prefill workers"})
    """host:port of each prefill worker; none means decode workers prefill themselves (co-located)."""
    decode_workers: list[str] = field(default_factory=list, metadata={
        "type": comma_list,
        "help": "comma-separated host:port of decode workers (or let them register in --redis-url)"})
    """host:port of each decode worker (until one is known, requests get UNAVAILABLE)."""
    routing_policy: str = field(default="prefix", metadata={
        "choices": ROUTING_POLICIES, "group": "routing",
        "help": "prefix: least predicted TTFT from cached blocks (KV events) and load, caches partitioned by "
                "rendezvous hash; see router/routing_policy.py"})
    """prefix (KV-index overlap + load), least_loaded, round_robin or random (see routing_policy.py)."""
    routing_weights: RoutingWeights = field(default_factory=RoutingWeights, metadata={"group": "routing"})
    skip_prefill_tokens: int = field(default=32, metadata={
        "group": "routing",
        "help": "the decode worker prefills itself when fewer prompt tokens than this are uncached there"})
    """When the decode worker already holds all but fewer than this many prompt tokens,
    it prefills them itself (no remote prefill, no transfer). 0: always prefill remotely."""
    link_aware_prefill: bool = field(default=True, metadata={
        "flag": "--no-link-aware-prefill", "group": "routing",
        "help": "always prefill remotely, even into a decode worker whose observed KV link moves a token's KV "
                "slower than the prefill pool computes one"})
    """Skip remote prefill into a decode worker whose observed KV pull bandwidth moves a token's KV
    slower than the prefill pool computes a token (router/link_estimate.py)."""
    peer_pulls: bool = field(default=True, metadata={
        "flag": "--no-peer-pulls", "group": "routing",
        "help": "never have a prefill worker pull a cached prefix from another prefill worker: it computes what "
                "it lacks"})
    """Prefix policy: a prefill worker lacking a prefix another prefill worker holds on its device may pull it
    when that is cheaper than computing it (router/README.md, "Peer prefix pulls")."""
    redis_url: str | None = field(default=None, metadata={
        "group": "registry (Redis)",
        "help": "share the worker registry and KV events through this Redis (redis://host:port/db)"})
    """Share the worker registry and KV events through this Redis (workers register
    there themselves); without it the router knows the workers given here only."""
    registry_ttl_s: float = field(default=3.0, metadata={
        "group": "registry (Redis)",
        "help": "lifetime of a worker's registration in Redis (renewed every third of it)"})
    """Workers' registration lifetime (as they were told); after Redis reconnects,
    absent workers are kept this long before removal."""
    max_queue_len: int = field(default=256, metadata={
        "help": "requests that may wait when every worker is saturated; more get RESOURCE_EXHAUSTED"})
    """Requests that may wait for a worker with room; more get RESOURCE_EXHAUSTED at once."""
    queue_timeout_s: float = field(default=30.0, metadata={
        "help": "longest wait in that queue before RESOURCE_EXHAUSTED"})
    """Longest wait in that queue before RESOURCE_EXHAUSTED."""
    retry_after_s: float = field(default=1.0, metadata={"help": "retry advice sent with RESOURCE_EXHAUSTED"})
    """Retry advice sent with RESOURCE_EXHAUSTED."""
    max_model_len: int | None = field(default=None, metadata={
        "help": "longest prompt plus output (default: the model's max_position_embeddings)"})
    """Longest prompt plus output; defaults to the model's max_position_embeddings."""
    health_interval_s: float = field(default=1.0, metadata={
        "help": "how often each worker's stats and health are polled"})
    """How often each worker's stats and health are polled."""
    lease_s: float = field(default=30.0, metadata={
        "help": "how long a prefill worker keeps a prompt's KV for a decode worker to pull"})
    """How long a prefill worker holds a prompt's KV for the decode worker."""
    metrics_port: int | None = field(default=None, metadata={"help": "serve Prometheus metrics here"})
    """Serve Prometheus metrics at http://host:metrics_port/metrics."""
    http_port: int | None = field(default=None, metadata={
        "group": "OpenAI HTTP front",
        "help": "serve the OpenAI-compatible HTTP API here (/v1/completions, /v1/chat/completions, ...)"})
    """Serve the OpenAI-compatible HTTP API at http://host:http_port/v1 (0 picks a free port)."""
    drain_timeout_s: float = field(default=30.0, metadata={
        "flag": "--router-drain-timeout-s", "help": "on SIGTERM: how long the router's in-flight requests may take"})
    """On SIGTERM: how long in-flight requests may take before the process exits."""
    max_migrations: int = field(default=3, metadata={
        "help": "how often one sample may move to another decode worker when its decode stream breaks "
                "(worker died, connection cut, drained, silent past --stream-timeout-s); 0: never"})
    """How often one sample may move to another decode worker when its decode stream breaks
    (router/README.md, "Request migration"); 0: never (the sample fails UNAVAILABLE)."""
    stream_timeout_s: float = field(default=30.0, metadata={
        "help": "a decode stream silent this long counts as broken (migrated, or UNAVAILABLE); 0: no limit"})
    """A decode stream silent this long is broken (a hung or stopped worker): the sample migrates
    (or fails UNAVAILABLE without migrations left). 0: no limit."""
    max_n: int = field(default=16, metadata={"help": "most parallel samples (n) one request may ask for"})
    """Most parallel samples (`n`) one request may ask for; more get INVALID_ARGUMENT."""
    max_prompt_chars: int | None = field(default=None, metadata={
        "help": "longest prompt text tokenized (default: max model len x 16 characters)"})
    """Longest prompt text (chat: all contents together) tokenized; longer gets INVALID_ARGUMENT
    before any tokenizing. Default: max_model_len * PROMPT_CHARS_PER_TOKEN."""
    tool_call_parser: str | None = field(default=None, metadata={
        "choices": TOOL_CALL_PARSERS,
        "help": 'OpenAI front: read tool calls out of the model\'s text for tool_choice "auto" (the chat '
                "template's family: hermes for Hermes/Qwen, llama3_json, mistral)"})
    """How tool calls are read from output under tool_choice "auto" (router/openai/tool_parsers.py)."""
    max_request_bytes: int = field(default=4 << 20, metadata={
        "help": "largest gRPC request message / HTTP request body the router reads"})
    """Largest gRPC request message and HTTP request body the router reads."""
    http_limits: HttpLimits = field(default_factory=HttpLimits, metadata={"group": "OpenAI HTTP front"})
    """Deadlines on reading each HTTP request and the cap on connections waiting for one (slow clients)."""
    security: FrontSecurityConfig = field(default_factory=FrontSecurityConfig, metadata={"group": "security"})
    """TLS and API keys of the public fronts (router/front_security.py)."""
    route_metadata: bool = field(default=False, metadata={
        "help": "name the workers of each sample in Generate's trailing metadata (debugging)"})
    """Name the workers of each sample in Generate's trailing metadata (debugging, benchmarks). Off by
    default: internal addresses are not the clients' business."""
    redis_password_file: str | None = field(default=None, metadata={
        "group": "registry (Redis)",
        "help": "file holding the Redis password (else $REDIS_PASSWORD; keep it out of --redis-url, "
                "which any local user can read in the process list)"})
    """Redis password, read from this file (else $REDIS_PASSWORD, else the one in redis_url)."""
    cluster_auth: ClusterAuthConfig = field(default_factory=ClusterAuthConfig, metadata={"group": "security"})
    """Where the cluster secret is: tokens on calls to workers, signatures on KV handles."""
    worker_tls: InternalTLSConfig = field(default_factory=InternalTLSConfig, metadata={"group": "security"})
    """mTLS to the workers (client certificate, CA the workers' certificates chain to); none: plaintext."""

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
        if self.redis_url is not None and not self.redis_url.startswith(("redis://", "rediss://", "unix://")):
            raise ValueError(f"redis_url must start with redis://, rediss:// or unix://, got {self.redis_url!r}")
        if self.redis_password_file is not None and not os.access(self.redis_password_file, os.R_OK):
            raise ValueError(f"redis_password_file: cannot read {self.redis_password_file!r}")
        if isinstance(self.max_migrations, bool) or not isinstance(self.max_migrations, int) \
                or self.max_migrations < 0:
            raise ValueError(f"max_migrations must be an integer >= 0, got {self.max_migrations!r}")
        if not self.stream_timeout_s >= 0:
            raise ValueError(f"stream_timeout_s must be >= 0 (0: no limit), got {self.stream_timeout_s!r}")
        if self.max_n < 1:
            raise ValueError("max_n must be >= 1")
        if self.max_prompt_chars is not None and self.max_prompt_chars < 1:
            raise ValueError("max_prompt_chars must be >= 1")
        if self.max_request_bytes < 1024:
            raise ValueError("max_request_bytes must be >= 1024")
        if self.skip_prefill_tokens < 0 or self.max_queue_len < 0:
            raise ValueError("skip_prefill_tokens and max_queue_len must be >= 0")
        for name in ("health_interval_s", "lease_s", "drain_timeout_s", "registry_ttl_s", "queue_timeout_s",
                     "retry_after_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be > 0")
