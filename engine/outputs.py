"""What the engine hands back: per-step deltas and finished completions."""
from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class SampleDelta:
    """New tokens and text of one sample (of one request) from one engine step."""

    request_id: str
    index: int
    token_ids: list[int]
    text: str
    logprobs: list[dict] = field(default_factory=list)
    finished: bool = False
    finish_reason: str | None = None
    num_cached_tokens: int = 0
    """Prompt tokens whose KV was reused rather than computed."""
    kv_block_ids: list[int] | None = None
    """Prefill role: the request stopped after its first token; these blocks hold
    its prompt's KV and stay allocated until `LLMEngine.release_kv`."""
    prompt_logprobs: list[dict] | None = None
    """With the first token: an entry per prompt token after the first (engine/prompt_logprobs.py)."""


@dataclass
class Completion:
    """A finished sample."""

    index: int
    token_ids: list[int]
    text: str
    finish_reason: str
    logprobs: list[dict] | None = None
    prompt_logprobs: list[dict] | None = None


@dataclass
class RequestOutput:
    request_id: str
    prompt_token_ids: list[int]
    completions: list[Completion]
    num_cached_tokens: int = 0

    @property
    def usage(self) -> dict:
        return {"prompt_tokens": len(self.prompt_token_ids),
                "completion_tokens": sum(len(c.token_ids) for c in self.completions),
                "cached_tokens": self.num_cached_tokens}


class CompletionCollector:
    """Folds per-step deltas into whole completions, per request and sample index."""

    def __init__(self) -> None:
        self._completions: dict[str, dict[int, Completion]] = {}
        self.cached_tokens: dict[str, int] = {}

    def add(self, d: SampleDelta) -> None:
        samples = self._completions.setdefault(d.request_id, {})
        c = samples.get(d.index)
        if c is None:
            c = samples[d.index] = Completion(d.index, [], "", "")
        c.token_ids.extend(d.token_ids)
        c.text += d.text
        if d.logprobs:
            c.logprobs = (c.logprobs or []) + d.logprobs
        if d.prompt_logprobs is not None:
            c.prompt_logprobs = d.prompt_logprobs
        if d.finished:
            c.finish_reason = d.finish_reason
            self.cached_tokens[d.request_id] = max(self.cached_tokens.get(d.request_id, 0), d.num_cached_tokens)

    def completions(self, request_id: str) -> list[Completion]:
        return [c for _, c in sorted(self._completions.get(request_id, {}).items())]


def generate_all(engine, prompts: list[list[int]], params, request_ids: list[str] | None = None) -> list[RequestOutput]:
    """`LLMEngine.generate`: submit every prompt (one SamplingParams or one per prompt), step until the engine is
    idle, and return the outputs in prompt order."""
    if not isinstance(params, list):
        params = [params] * len(prompts)
    request_ids = request_ids or [str(i) for i in range(len(prompts))]
    for rid, prompt, p in zip(request_ids, prompts, params, strict=True):
        engine.add_request(rid, prompt, p)
    collector = CompletionCollector()
    while engine.has_unfinished():
        for d in engine.step():
            collector.add(d)
    return [RequestOutput(rid, list(prompt), collector.completions(rid), collector.cached_tokens.get(rid, 0))
            for rid, prompt in zip(request_ids, prompts, strict=True)]
