"""Prompt logprobs: each prompt token's log probability (and the top alternatives) at its position.

Position p's logits predict prompt token p + 1, so a prompt of P tokens has P - 1 entries (the first
token has none, as in vLLM). A request asking for them computes logits at every prompt position, chunk
by chunk (`ScheduledRequest.num_logits`), and skips the prefix cache; entries are written by position,
so a prompt computed again after a preemption overwrites rather than repeats them.
"""
from __future__ import annotations

import torch


def entries(logits: torch.Tensor, targets: list[int], num_top: int) -> list[dict]:
    """One entry per row of `logits` (rows of consecutive positions) for the prompt token that follows it:
    its logprob, its rank (1 = most likely) and the `num_top` most likely tokens."""
    logprobs = logits.float().log_softmax(dim=-1)
    target = torch.tensor(targets, device=logits.device)[:, None]
    chosen = logprobs.gather(1, target)
    ranks = (logprobs > chosen).sum(dim=-1) + 1
    top_values, top_ids = logprobs.topk(max(num_top, 1), dim=-1)
    return [{"token_id": t, "logprob": lp, "rank": r,
             "top_logprobs": [{"token_id": i, "logprob": v} for i, v in zip(ids[:num_top], values[:num_top],
                                                                           strict=True)]}
            for t, lp, r, ids, values in zip(targets, chosen[:, 0].tolist(), ranks.tolist(), top_ids.tolist(),
                                             top_values.tolist(), strict=True)]


def record(sample, logits: torch.Tensor, start: int, done: bool) -> None:
    """A SampleState's entries for positions start .. start + rows - 1, put in place (a chunk computed again
    overwrites its own); `done`: the prompt is complete (the entries go out with the first token)."""
    request = sample.request
    targets = request.prompt_token_ids[start + 1:start + 1 + logits.shape[0]]
    if sample.prompt_logprobs is None:
        sample.prompt_logprobs = []
    sample.prompt_logprobs[start:start + len(targets)] = entries(logits, targets, request.params.prompt_logprobs)
    if done:
        request.prompt_logprobs_pending = False
