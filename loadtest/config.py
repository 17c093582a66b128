"""Settings of one load test, validated on construction."""
from __future__ import annotations

import math
import os
from dataclasses import dataclass, field

SLO_METRICS = ("ttft", "tpot", "e2el")
DATASETS = ("random", "prefix", "sharegpt", "mooncake")
TRACE_SCHEDULES = ("fixed", "order")


def parse_slos(items: list[str] | None) -> dict[str, float]:
    """`["ttft:200", "tpot:50"]` -> {"ttft": 200.0, "tpot": 50.0} (milliseconds, as `vllm bench serve --goodput`)."""
    slos: dict[str, float] = {}
    for item in items or []:
        name, sep, value = item.partition(":")
        if not sep:
            raise ValueError(f"--goodput {item!r}: expected METRIC:MS, e.g. ttft:200")
        try:
            slos[name.strip()] = float(value)
        except ValueError:
            raise ValueError(f"--goodput {item!r}: {value!r} is not a number of milliseconds") from None
    return slos


@dataclass
class DatasetConfig:
    name: str = "random"
    """"random", "prefix", "sharegpt" or "mooncake"."""
    path: str | None = None
    """sharegpt: the ShareGPT-format JSON file; mooncake: the trace's JSONL file."""
    random_input_len: int = 256
    """random: prompt tokens (before the range ratio)."""
    random_output_len: int = 32
    """random: output tokens (before the range ratio)."""
    random_range_ratio: float = 0.0
    """random: lengths are drawn uniformly from [len * (1 - r), len * (1 + r)]."""
    prefix_num_prefixes: int = 4
    """prefix: how many distinct shared prefixes."""
    prefix_len: int = 128
    """prefix: tokens of each shared prefix."""
    suffix_len: int = 32
    """prefix: unique tokens after the prefix."""
    prefix_output_len: int = 32
    """prefix: output tokens."""
    sharegpt_output_len: int | None = None
    """sharegpt: fixed output length (default: the length of the recorded reply)."""
    vocab_size: int = 49152
    """random/prefix: token ids are drawn from [100, vocab_size)."""
    model: str = "default"
    """sharegpt: checkpoint whose tokenizer measures the texts ('default': the bundled SmolLM2)."""
    trace_block_tokens: int = 16
    """mooncake: token ids each hash id stands for."""
    trace_source_block_tokens: int = 512
    """mooncake: tokens per hash id in the trace (prompts are scaled by trace_block_tokens / this)."""
    trace_output_scale: float | None = None
    """mooncake: output length = trace output_length * this (default: the prompts' scale)."""
    trace_max_output_len: int | None = None
    """mooncake: cap on the output length."""
    trace_sessions: int | None = None
    """mooncake: replay every turn of the first this many sessions (instead of the first num_prompts requests)."""
    trace_min_turns: int = 1
    """mooncake, with trace_sessions: only sessions of at least this many requests (2: conversations)."""

    @property
    def is_trace(self) -> bool:
        return self.name == "mooncake"

    def __post_init__(self) -> None:
        if self.name not in DATASETS:
            raise ValueError(f"dataset must be random, prefix, sharegpt:FILE or mooncake:FILE, got {self.name!r}")
        if self.name in ("sharegpt", "mooncake") and not self.path:
            raise ValueError(f"dataset {self.name} needs a file: --dataset {self.name}:FILE")
        for name in ("trace_block_tokens", "trace_source_block_tokens"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1")
        if self.trace_min_turns < 1:
            raise ValueError("trace_min_turns must be >= 1")
        if self.trace_min_turns > 1 and self.trace_sessions is None:
            raise ValueError("trace_min_turns picks sessions: give trace_sessions (--trace-sessions K)")
        for name in ("trace_max_output_len", "trace_sessions"):
            if getattr(self, name) is not None and getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1")
        if self.trace_output_scale is not None and not self.trace_output_scale > 0:
            raise ValueError("trace_output_scale must be > 0")
        if self.trace_sessions is not None and not self.is_trace:
            raise ValueError("trace_sessions applies to a trace: --dataset mooncake:FILE")
        for name in ("random_input_len", "random_output_len", "prefix_len", "prefix_output_len",
                     "prefix_num_prefixes"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1")
        if self.suffix_len < 0:
            raise ValueError("suffix_len must be >= 0")
        if not 0.0 <= self.random_range_ratio < 1.0:
            raise ValueError("random_range_ratio must be in [0, 1)")
        if self.sharegpt_output_len is not None and self.sharegpt_output_len < 1:
            raise ValueError("sharegpt_output_len must be >= 1")
        if self.vocab_size <= 100:
            raise ValueError("vocab_size must be > 100")

    @classmethod
    def from_spec(cls, spec: str, **kwargs) -> DatasetConfig:
        """`random`, `prefix`, `sharegpt:FILE` or `mooncake:FILE`."""
        name, _, path = spec.partition(":")
        return cls(name=name, path=path or None, **kwargs)


@dataclass
class LoadTestConfig:
    url: str
    """host:port of the router's Generation service."""
    dataset: DatasetConfig = field(default_factory=DatasetConfig)
    num_prompts: int = 100
    """Requests measured (warm-up requests come on top)."""
    request_rate: float = math.inf
    """Mean arrivals per second; inf sends every request at once."""
    rate_schedule: tuple[tuple[float, float], ...] = ()
    """(rate, seconds) phases back to back instead of one rate (num_prompts is then what arrives)."""
    burstiness: float = 1.0
    """Gamma shape of the inter-arrival times: 1 is Poisson, < 1 burstier, > 1 more regular."""
    max_concurrency: int | None = None
    """Requests in flight at most (arrivals wait for a free slot); None: unbounded."""
    num_warmups: int = 0
    """Requests sent (and awaited) before measuring; excluded from the results."""
    duration_s: float | None = None
    """Time bound: no new request starts after this many seconds (in-flight ones finish)."""
    request_timeout_s: float | None = None
    """Per-request gRPC deadline; an expired one counts as failed (DEADLINE_EXCEEDED)."""
    slos: dict[str, float] = field(default_factory=dict)
    """SLOs in ms, keyed by ttft, tpot or e2el; a request is good when it meets all of them."""
    seed: int = 0
    """Seeds the dataset and the arrival times."""
    progress: bool = True
    """Show a progress bar on stderr."""
    tls_ca_file: str | None = None
    """Reach the router over TLS, verifying it against this PEM CA."""
    api_key_file: str | None = None
    """File whose first line is the router's API key (else $PDSERVE_API_KEY; none: no key)."""
    trace_schedule: str | None = None
    """Trace datasets: "fixed" (at the trace's timestamps) or "order" (in trace order at max_concurrency);
    None: "order" with a max_concurrency, else "fixed"."""
    trace_time_scale: float = 1.0
    """fixed schedule: send times are the trace's timestamps times this (0.5: twice as fast)."""

    def __post_init__(self) -> None:
        if not self.url or ":" not in self.url:
            raise ValueError(f"url must be HOST:PORT, got {self.url!r}")
        for name in ("tls_ca_file", "api_key_file"):
            path = getattr(self, name)
            if path is not None and not os.access(path, os.R_OK):
                raise ValueError(f"{name}: cannot read {path!r}")
        if self.rate_schedule:
            from loadtest.arrivals import schedule_offsets
            self.num_prompts = len(schedule_offsets(self.rate_schedule, self.burstiness, self.seed))
        if self.num_prompts < 1:
            raise ValueError("num_prompts must be >= 1")
        if not self.request_rate > 0:
            raise ValueError("request_rate must be > 0 (inf: all at once)")
        if not self.burstiness > 0:
            raise ValueError("burstiness must be > 0")
        if self.max_concurrency is not None and self.max_concurrency < 1:
            raise ValueError("max_concurrency must be >= 1")
        if self.num_warmups < 0:
            raise ValueError("num_warmups must be >= 0")
        for name in ("duration_s", "request_timeout_s"):
            value = getattr(self, name)
            if value is not None and not value > 0:
                raise ValueError(f"{name} must be > 0")
        for key, value in self.slos.items():
            if key not in SLO_METRICS:
                raise ValueError(f"unknown SLO metric {key!r}: use {', '.join(SLO_METRICS)}")
            if not value > 0:
                raise ValueError(f"SLO {key} must be > 0 ms")
        self._check_trace()

    def _check_trace(self) -> None:
        if not self.dataset.is_trace:
            if self.trace_schedule is not None:
                raise ValueError("trace_schedule applies to a trace: --dataset mooncake:FILE")
            return
        if self.trace_schedule is None:
            self.trace_schedule = "order" if self.max_concurrency else "fixed"
        if self.trace_schedule not in TRACE_SCHEDULES:
            raise ValueError(f"trace_schedule must be fixed or order, got {self.trace_schedule!r}")
        if self.trace_schedule == "order" and not self.max_concurrency:
            raise ValueError("trace_schedule order sends at a fixed concurrency: give --max-concurrency")
        if not (self.trace_time_scale > 0 and math.isfinite(self.trace_time_scale)):
            raise ValueError("trace_time_scale must be finite and > 0")
        if not math.isinf(self.request_rate) or self.rate_schedule:
            raise ValueError("a trace brings its own send times: --request-rate and --rate-schedule do not apply "
                             "(use --trace-schedule fixed --trace-time-scale, or order --max-concurrency)")
        if self.num_warmups:
            raise ValueError("num_warmups: a trace replay has no warm-up (it would take the trace's first requests)")
