"""All per-sequence state in one object (one object per sample when n > 1)."""
from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field

from engine.sampling_params import SamplingParams


class RequestStatus(enum.IntEnum):
    WAITING = 0
    RUNNING = 1
    PREEMPTED = 2
    FINISHED = 3
    LOADING = 4
    """Waiting for prefix blocks to come back from a lower KV tier (engine/kv_offload/)."""


class FinishReason(str, enum.Enum):
    STOP = "stop"
    LENGTH = "length"
    STOP_STRING = "stop_string"
    ABORT = "abort"
    ERROR = "error"
    """The sample's grammar forbade the token drawn (structured outputs): that sample fails, nothing else."""


@dataclass
class Request:
    """One sequence being generated.

    There is no prefill or decode phase: the request knows how many of its
    tokens have KV computed (`num_computed_tokens`) and how many tokens it has.
    A request whose KV arrived from elsewhere starts with `num_computed_tokens`
    already set and its blocks already allocated.
    """

    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    group_id: str = ""
    """The user's request id; samples of one prompt share it."""
    sample_index: int = 0
    arrival_time: float = field(default_factory=time.monotonic)
    output_token_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    num_cached_tokens: int = 0
    """Prompt tokens whose KV came from the prefix cache (or a KV transfer)."""
    status: RequestStatus = RequestStatus.WAITING
    finish_reason: FinishReason | None = None
    pending_forks: int = 0
    """Samples still to split off when this request samples its first token."""
    num_preemptions: int = 0
    prefill_only: bool = False
    """Prefill role: stop after the first token and keep the blocks for a transfer."""
    cache_salt: str = ""
    """Mixed into the first block hash: only requests with the same salt share prefix-cache blocks."""
    spec_token_ids: list[int] = field(default_factory=list)
    """Proposed next tokens (speculative decoding) for the coming step; the scheduler takes them."""
    num_pending_tokens: int = 0
    """Tokens sampled by launched steps not yet collected (async scheduling): unknown here, yet a step may
    already compute the next position, its input patched in on the device (engine/engine_steps.py)."""
    prompt_logprobs_pending: bool = False
    """prompt_logprobs asked for and the prompt not computed yet: every prompt position computes logits
    (the request skips the prefix cache)."""

    def __post_init__(self) -> None:
        self.group_id = self.group_id or self.request_id
        self.all_token_ids = list(self.prompt_token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def is_finished(self) -> bool:
        return self.status == RequestStatus.FINISHED

    def append_token(self, token_id: int) -> None:
        self.output_token_ids.append(token_id)
        self.all_token_ids.append(token_id)
