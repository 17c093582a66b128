"""Prompts to send: random token ids, shared-prefix token ids, ShareGPT conversations, or a trace.

random and prefix prompts are token ids (exact lengths, no tokenizer needed);
ShareGPT prompts are text, measured with the model's tokenizer; mooncake trace
prompts are token ids too (loadtest/trace.py).
"""
from __future__ import annotations

import json
import random
from dataclasses import dataclass

from loadtest.config import DatasetConfig

MIN_TOKEN_ID = 100
"""Random ids start here, clear of the special tokens at the bottom of the vocabulary."""
SHAREGPT_MAX_PROMPT = 1024
SHAREGPT_MAX_TOTAL = 2048


@dataclass
class Prompt:
    prompt_len: int
    output_len: int
    token_ids: list[int] | None = None
    text: str | None = None
    session_id: str | None = None
    """Traces: the conversation this request belongs to."""
    turn: int | None = None
    """Traces: how many earlier requests of the same session there are."""
    arrival_ms: float | None = None
    """Traces: the request's timestamp in the trace (ms)."""


def load_prompts(config: DatasetConfig, num_prompts: int, seed: int) -> list[Prompt]:
    """num_prompts prompts (a trace: its selected slice, which may hold another number)."""
    if config.is_trace:
        from loadtest.trace import trace_prompts
        return trace_prompts(config, num_prompts, seed)
    rng = random.Random(seed)
    if config.name == "random":
        return random_prompts(config, num_prompts, rng)
    if config.name == "prefix":
        return prefix_prompts(config, num_prompts, rng)
    return sharegpt_prompts(config, num_prompts, rng)


def _ids(rng: random.Random, n: int, vocab_size: int) -> list[int]:
    return [rng.randrange(MIN_TOKEN_ID, vocab_size) for _ in range(n)]


def _length(rng: random.Random, mean: int, ratio: float) -> int:
    return max(1, rng.randint(int(mean * (1 - ratio)), int(mean * (1 + ratio))))


def random_prompts(config: DatasetConfig, num_prompts: int, rng: random.Random) -> list[Prompt]:
    prompts = []
    for _ in range(num_prompts):
        n_in = _length(rng, config.random_input_len, config.random_range_ratio)
        n_out = _length(rng, config.random_output_len, config.random_range_ratio)
        prompts.append(Prompt(n_in, n_out, token_ids=_ids(rng, n_in, config.vocab_size)))
    return prompts


def prefix_prompts(config: DatasetConfig, num_prompts: int, rng: random.Random) -> list[Prompt]:
    """num_prompts prompts, each one of `prefix_num_prefixes` shared prefixes + a unique suffix, shuffled."""
    prefixes = [_ids(rng, config.prefix_len, config.vocab_size) for _ in range(config.prefix_num_prefixes)]
    prompts = []
    for i in range(num_prompts):
        ids = prefixes[i % len(prefixes)] + _ids(rng, config.suffix_len, config.vocab_size)
        prompts.append(Prompt(len(ids), config.prefix_output_len, token_ids=ids))
    rng.shuffle(prompts)
    return prompts


def sharegpt_prompts(config: DatasetConfig, num_prompts: int, rng: random.Random) -> list[Prompt]:
    """First human turn as the prompt, the reply's token count as the output length (as vLLM does).

    Conversations are shuffled; too short (< 4 tokens) or too long ones are skipped; if the
    file has fewer usable conversations than num_prompts, they are reused in order."""
    from engine.model_files import resolve_model_path
    from engine.tokenizer import Tokenizer

    with open(config.path, encoding="utf-8") as f:
        data = json.load(f)
    if not isinstance(data, list):
        raise ValueError(f"{config.path}: expected a JSON list of {{'conversations': [...]}} entries")
    pairs = [(c["conversations"][0]["value"], c["conversations"][1]["value"]) for c in data
             if isinstance(c, dict) and len(c.get("conversations") or []) >= 2]
    rng.shuffle(pairs)
    tokenizer = Tokenizer(resolve_model_path(config.model))
    prompts: list[Prompt] = []
    for prompt, reply in pairs:
        n_in = len(tokenizer.encode(prompt))
        n_out = config.sharegpt_output_len or len(tokenizer.encode(reply))
        if n_in < 4 or n_out < 4 or n_in > SHAREGPT_MAX_PROMPT or n_in + n_out > SHAREGPT_MAX_TOTAL:
            continue
        prompts.append(Prompt(n_in, n_out, text=prompt))
        if len(prompts) == num_prompts:
            break
    if not prompts:
        raise ValueError(f"{config.path}: no usable conversation (need a human turn and a reply, 4..1024 tokens)")
    return [prompts[i % len(prompts)] for i in range(num_prompts)]
