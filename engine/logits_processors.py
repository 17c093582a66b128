"""Per-row edits of the logits before a token is drawn, with vLLM's formulas and order.

The sampler calls them on its gathered rows (one row per sample), in this order, as vLLM v1 does:
the grammar's token bitmask and the min_tokens suppression; bad words; logit bias; the repetition,
frequency and presence penalties; then (for random rows, after the temperature) min_p. Greedy rows
take the argmax after the penalties (min_p never changes the argmax).
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from engine import cpu_kernels
from engine.host_lists import on_device
from engine.sampling_params import SamplingParams


@dataclass
class SampleContext:
    """What the history-dependent edits read: the sample's tokens so far and its bad words as token ids."""

    prompt_token_ids: list[int]
    output_token_ids: list[int]
    bad_words_token_ids: list[list[int]] = field(default_factory=list)


def needs_context(params: SamplingParams) -> bool:
    """The request has an edit that reads its tokens or its own table (so its row goes through `apply`)."""
    return params.penalized or bool(params.logit_bias) or bool(params.bad_words)


def allowed_by_bitmask(bitmask: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """Bool (rows, vocab_size) from an int32 bitmask (rows, ceil(vocab/32)): bit j of word i allows token 32*i + j.
    Token ids past the bitmask's end (a model vocabulary padded beyond the tokenizer's) are not allowed."""
    shifts = torch.arange(32, dtype=torch.int32, device=bitmask.device)
    allowed = ((bitmask.unsqueeze(-1) >> shifts) & 1).bool().flatten(1)
    if allowed.shape[1] >= vocab_size:
        return allowed[:, :vocab_size]
    return torch.nn.functional.pad(allowed, (0, vocab_size - allowed.shape[1]), value=False)


def apply_bitmask(logits: torch.Tensor, bitmask: torch.Tensor, rows: list[int]) -> None:
    """In place: -inf on every token the bitmask rows (one per entry of `rows`) do not allow. On CPU the C++
    kernel (engine/csrc/token_bitmask.cpp) when it is built; the torch path otherwise (and on GPUs)."""
    if not rows:
        return
    kernels = cpu_kernels.load() if logits.device.type == "cpu" else None
    if kernels is not None and logits.dtype == torch.float32 and logits.is_contiguous():
        kernels.apply_token_bitmask(logits, bitmask.contiguous(), torch.tensor(rows, dtype=torch.long))
    else:
        apply_bitmask_torch(logits, bitmask, rows)


def apply_bitmask_torch(logits: torch.Tensor, bitmask: torch.Tensor, rows: list[int]) -> None:
    index = torch.tensor(rows, device=logits.device)
    allowed = allowed_by_bitmask(bitmask.to(logits.device), logits.shape[1])
    logits[index] = logits[index].masked_fill(~allowed, float("-inf"))


def apply(logits: torch.Tensor, rows: list[tuple[int, SamplingParams, SampleContext]]) -> None:
    """In place, for each (row, params, context): bad words, logit bias, then the penalties."""
    vocab = logits.shape[1]
    for i, params, context in rows:
        banned = banned_by_bad_words(context.bad_words_token_ids, context.output_token_ids)
        if banned:
            logits[i, banned] = float("-inf")
        if params.logit_bias:
            ids = [t for t in params.logit_bias if t < vocab]
            logits[i, ids] += torch.tensor([params.logit_bias[t] for t in ids], dtype=logits.dtype,
                                           device=logits.device)
        if params.penalized:
            logits[i] = penalized_row(logits[i], params, context)


def banned_by_bad_words(bad_words_token_ids: list[list[int]], output_token_ids: list[int]) -> list[int]:
    """The last token of each bad word whose other tokens end the output (a one-token word: always)."""
    banned = []
    for word in bad_words_token_ids:
        prefix = word[:-1]
        if not prefix or (len(output_token_ids) >= len(prefix) and output_token_ids[-len(prefix):] == prefix):
            banned.append(word[-1])
    return banned


def penalized_row(row: torch.Tensor, params: SamplingParams, context: SampleContext) -> torch.Tensor:
    """vLLM's penalties on one row of logits: repetition over prompt and output tokens (divide positive logits,
    multiply negative ones), then frequency times each output token's count and presence once per output token."""
    vocab = row.shape[0]
    output = torch.tensor([t for t in context.output_token_ids if t < vocab], dtype=torch.long, device=row.device)
    counts = torch.bincount(output, minlength=vocab).to(row.dtype)
    if params.repetition_penalty != 1.0:
        seen = counts > 0
        prompt = torch.tensor([t for t in context.prompt_token_ids if t < vocab], dtype=torch.long,
                              device=row.device)
        seen[prompt] = True
        penalty = params.repetition_penalty
        row = torch.where(seen, torch.where(row > 0, row / penalty, row * penalty), row)
    if params.frequency_penalty or params.presence_penalty:
        row = row - params.frequency_penalty * counts - params.presence_penalty * (counts > 0).to(row.dtype)
    return row


def apply_min_p(logits: torch.Tensor, min_ps: list[float]) -> torch.Tensor:
    """Rows of temperature-scaled logits with tokens less likely than min_p x the top token's probability
    set to -inf (min_p 0 leaves a row alone)."""
    min_p = on_device(min_ps, logits.device, logits.dtype)
    probs = logits.softmax(dim=-1)
    threshold = probs.amax(dim=-1, keepdim=True) * min_p[:, None]
    return logits.masked_fill(probs < threshold, float("-inf"))
