"""Verification of proposed tokens against the target's distributions (Leviathan et al. 2023, Chen et al. 2023).

Proposed token x_i (drawn from q_i) is accepted with probability min(1, p_i(x_i) / q_i(x_i)); at the first
rejection one token is drawn from the residual norm(max(0, p_i - q_i)) and verification stops; when all K are
accepted a bonus token is drawn from p_K. The emitted tokens then follow the target exactly. A proposer that
is deterministic (n-gram lookup, a greedy draft) has q_i a point mass at x_i: accept with probability p_i(x_i),
on rejection draw from p_i with x_i removed.
"""
from __future__ import annotations

import torch


def draw(probs: torch.Tensor, generator: torch.Generator | None) -> int:
    """One categorical draw by the exponential race (argmax p / E, E ~ Exp(1)), as the sampler draws."""
    noise = torch.empty_like(probs).exponential_(generator=generator)
    return int((probs / noise).argmax())


def greedy_verify(target_argmax: list[int], draft_token_ids: list[int]) -> list[int]:
    """Greedy rows: accept proposals while they equal the target's argmax; then the target's own token."""
    out = []
    for i, token in enumerate(draft_token_ids):
        if token != target_argmax[i]:
            break
        out.append(token)
    out.append(target_argmax[len(out)])
    return out


def rejection_sample(target_probs: torch.Tensor, draft_token_ids: list[int], generator: torch.Generator | None,
                     draft_probs: torch.Tensor | None = None) -> list[int]:
    """Tokens to emit (1 .. K+1): the accepted prefix of the proposals plus one drawn token.

    target_probs: [K + 1, V] the target's (temperature/top-k/top-p processed) distributions at each proposed
    position and after the last; draft_probs: [K, V] the proposer's, or None for a point mass at each proposal.
    Draws K uniforms and one exponential race from `generator`, so a seeded request stays deterministic.
    """
    k = len(draft_token_ids)
    device = target_probs.device
    out: list[int] = []
    if k:
        ids = torch.tensor(draft_token_ids, device=device)
        rows = torch.arange(k, device=device)
        ratio = target_probs[rows, ids]
        if draft_probs is not None:
            ratio = ratio / draft_probs[rows, ids]
        uniforms = torch.rand(k, generator=generator, device=device)
        accepted = (uniforms < ratio).tolist()
        for ok, token in zip(accepted, draft_token_ids, strict=True):
            if not ok:
                break
            out.append(token)
    n = len(out)
    if n == k:
        return out + [draw(target_probs[k], generator)]
    p = target_probs[n]
    if draft_probs is None:
        residual = p.clone()
        residual[draft_token_ids[n]] = 0.0
    else:
        residual = (p - draft_probs[n]).clamp_min(0.0)
    if float(residual.sum()) <= 0.0:  # only by rounding (p == q); p itself is then the right law
        residual = p
    return out + [draw(residual / residual.sum(), generator)]
