"""Turn logits into tokens: greedy, temperature, top-k, top-p, seeds, logprobs.

Random rows sample by the exponential race (argmax of p / E with E ~ Exp(1)),
which is exact categorical sampling and lets each seeded request draw its
noise from its own generator, so its tokens do not depend on the batch.
Logits come in the model's dtype: greedy rows take the argmax as they are
(widening bf16 to float32 is exact, so the argmax is the same), and only the
rows that sample at random or report logprobs are widened to float32.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from engine import logits_processors
from engine.logits_processors import SampleContext
from engine.sampling_params import SamplingParams
from engine.spec_decode.rejection import greedy_verify, rejection_sample


@dataclass
class SampleRow:
    """One token to draw from one row of logits."""

    logits_row: int
    params: SamplingParams
    generator: torch.Generator | None
    suppress_token_ids: list[int]
    """Token ids masked out (EOS/stop ids before min_tokens is reached)."""
    context: SampleContext | None = None
    """For penalties, logit bias and bad words (None: the request uses none of them)."""
    bitmask_row: int | None = None
    """The row of the step's grammar bitmask that constrains this sample (None: unconstrained)."""


@dataclass
class SpecRow:
    """A sequence that computed K proposed tokens: its K + 1 consecutive rows of logits to verify them."""

    logits_row: int
    """The first of the rows (the one after the sequence's last accepted token)."""
    params: SamplingParams
    generator: torch.Generator | None
    draft_token_ids: list[int]
    bitmask_rows: list[int | None] | None = None
    """Per row of logits (K + 1), the bitmask row that constrains it (None: unconstrained)."""


@dataclass
class SampledToken:
    token_id: int
    logprob: float | None = None
    top_logprobs: list[tuple[int, float]] | None = None


class Sampler:
    def __init__(self, default_seed: int, device: torch.device) -> None:
        self.generator = torch.Generator(device=device).manual_seed(default_seed)

    def sample(self, logits: torch.Tensor, rows: list[SampleRow],
               bitmask: torch.Tensor | None = None) -> list[SampledToken]:
        """One token per row; `bitmask` holds the grammar rows the rows' `bitmask_row` point at."""
        if not rows:
            return []
        order = [r.logits_row for r in rows]
        edited = [r.context is not None or r.bitmask_row is not None for r in rows]
        if order != list(range(logits.shape[0])):  # rows repeat (parallel samples) or skip: gather them
            logits = logits[torch.tensor(order, device=logits.device)]
        elif any(r.suppress_token_ids for r in rows) or any(edited):
            logits = logits.clone()  # masked below; the model's (inference-mode) output stays as it was
        if any(edited):
            logits = logits.float()  # penalties and biases in float32, as vLLM's formulas are
        for i, row in enumerate(rows):
            if row.suppress_token_ids:
                logits[i, row.suppress_token_ids] = float("-inf")
        masked = [i for i, r in enumerate(rows) if r.bitmask_row is not None]
        if masked:
            logits_processors.apply_bitmask(logits, bitmask[[rows[i].bitmask_row for i in masked]], masked)
        with_context = [(i, r.params, r.context) for i, r in enumerate(rows) if r.context is not None]
        if with_context:
            logits_processors.apply(logits, with_context)
        token_ids = logits.argmax(dim=-1)
        random_rows = [i for i, r in enumerate(rows) if not r.params.greedy]
        if random_rows:
            token_ids[random_rows] = self._sample_random(logits[random_rows].float(),
                                                         [rows[i] for i in random_rows])
        token_list = token_ids.tolist()
        results = [SampledToken(t) for t in token_list]
        want = [i for i, r in enumerate(rows) if r.params.logprobs is not None]
        if want:
            self._add_logprobs(logits[want].float(), [rows[i] for i in want], [results[i] for i in want])
        return results

    def verify(self, logits: torch.Tensor, rows: list[SpecRow],
               bitmask: torch.Tensor | None = None) -> list[list[int]]:
        """For each row: the proposed tokens the target accepts plus one token of its own (exact: greedy rows
        equal greedy decoding, random rows follow the target's distribution; see spec_decode/rejection.py).
        A grammar's bitmask rows constrain the target first: a draft token it forbids is never accepted."""
        results = []
        for row in rows:
            k = len(row.draft_token_ids)
            target = logits[row.logits_row:row.logits_row + k + 1]
            if row.bitmask_rows is not None:
                positions = [i for i, b in enumerate(row.bitmask_rows) if b is not None]
                target = target.to(torch.float32, copy=True)  # the model's output stays as it was
                logits_processors.apply_bitmask(target, bitmask[[row.bitmask_rows[i] for i in positions]], positions)
            if row.params.greedy:
                results.append(greedy_verify(target.argmax(dim=-1).tolist(), row.draft_token_ids))
                continue
            target = target.float() / row.params.temperature  # logits come in the model's dtype
            if row.params.top_k or row.params.top_p < 1.0:
                target = _apply_top_k_top_p(target, [row.params.top_k] * (k + 1), [row.params.top_p] * (k + 1))
            generator = row.generator if row.generator is not None else self.generator
            results.append(rejection_sample(target.softmax(dim=-1), row.draft_token_ids, generator))
        return results

    @staticmethod
    def skip_draw(generator: torch.Generator, vocab_size: int) -> None:
        """Advance a request's generator past one random token, as if drawn here
        (a decode engine continuing a seeded request whose first token was drawn
        by the prefill engine)."""
        torch.empty(1, vocab_size, device=generator.device).exponential_(generator=generator)

    def _sample_random(self, logits: torch.Tensor, rows: list[SampleRow]) -> torch.Tensor:
        temps = torch.tensor([r.params.temperature for r in rows], device=logits.device)
        logits = logits / temps[:, None]
        min_ps = [r.params.min_p for r in rows]
        if any(min_ps):
            logits = logits_processors.apply_min_p(logits, min_ps)
        top_ks = [r.params.top_k for r in rows]
        top_ps = [r.params.top_p for r in rows]
        if any(top_ks) or any(p < 1.0 for p in top_ps):
            logits = _apply_top_k_top_p(logits, top_ks, top_ps)
        probs = logits.softmax(dim=-1)
        noise = torch.empty_like(probs)
        unseeded = [i for i, r in enumerate(rows) if r.generator is None]
        if unseeded:
            noise[unseeded] = torch.empty(len(unseeded), probs.shape[1], device=probs.device).exponential_(
                generator=self.generator)
        for i, r in enumerate(rows):
            if r.generator is not None:
                noise[i].exponential_(generator=r.generator)
        return (probs / noise).argmax(dim=-1)

    def _add_logprobs(self, logits, rows, results) -> None:
        logprobs = logits.log_softmax(dim=-1)
        max_n = max(r.params.logprobs for r in rows)
        top_vals, top_ids = logprobs.topk(max(max_n, 1), dim=-1)
        chosen = logprobs.gather(1, torch.tensor([[res.token_id] for res in results], device=logits.device))
        for i, (row, res) in enumerate(zip(rows, results, strict=True)):
            n = row.params.logprobs
            res.logprob = float(chosen[i, 0])
            res.top_logprobs = list(zip(top_ids[i, :n].tolist(), top_vals[i, :n].tolist(), strict=True))


def _apply_top_k_top_p(logits: torch.Tensor, top_ks: list[int], top_ps: list[float]) -> torch.Tensor:
    vocab = logits.shape[1]
    sorted_logits, sorted_ids = logits.sort(dim=-1, descending=True)
    ks = torch.tensor([k if k > 0 else vocab for k in top_ks], device=logits.device)
    ranks = torch.arange(vocab, device=logits.device)[None, :]
    sorted_logits = sorted_logits.masked_fill(ranks >= ks[:, None], float("-inf"))
    ps = torch.tensor(top_ps, device=logits.device, dtype=logits.dtype)
    probs = sorted_logits.softmax(dim=-1)
    mass_before = probs.cumsum(dim=-1) - probs
    sorted_logits = sorted_logits.masked_fill(mass_before >= ps[:, None], float("-inf"))
    return torch.full_like(logits, float("-inf")).scatter(1, sorted_ids, sorted_logits)
