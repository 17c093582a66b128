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
from engine.host_lists import on_device
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


@dataclass
class Draw:
    """One step's drawn tokens (`Sampler.draw`): on the device now, read by `results`."""

    token_ids: torch.Tensor
    """[rows] int64 on the logits' device."""
    rows: list[SampleRow]
    host: torch.Tensor | None = None
    """CUDA: a pinned copy of token_ids, filled once `event` has passed (no wait on later work)."""
    event: torch.cuda.Event | None = None
    logprobs: tuple | None = None
    """(row indices wanting logprobs, chosen [n, 1], top ids [n, k], top values [n, k]) on the device."""

    def results(self) -> list[SampledToken]:
        """The tokens (and logprobs asked for), waiting for this step's sampling only."""
        if self.event is not None:
            self.event.synchronize()
            token_list = self.host.tolist()
        else:
            token_list = self.token_ids.tolist()
        results = [SampledToken(t) for t in token_list]
        if self.logprobs is not None:
            want, chosen, top_ids, top_vals = self.logprobs
            chosen, top_ids, top_vals = chosen.tolist(), top_ids.tolist(), top_vals.tolist()
            for j, i in enumerate(want):
                n = self.rows[i].params.logprobs
                results[i].logprob = chosen[j][0]
                results[i].top_logprobs = list(zip(top_ids[j][:n], top_vals[j][:n], strict=True))
        return results


class Sampler:
    def __init__(self, default_seed: int, device: torch.device) -> None:
        self.generator = torch.Generator(device=device).manual_seed(default_seed)

    def sample(self, logits: torch.Tensor, rows: list[SampleRow],
               bitmask: torch.Tensor | None = None) -> list[SampledToken]:
        """One token per row; `bitmask` holds the grammar rows the rows' `bitmask_row` point at."""
        return self.draw(logits, rows, bitmask).results()

    def draw(self, logits: torch.Tensor, rows: list[SampleRow], bitmask: torch.Tensor | None = None) -> Draw:
        """`sample` without waiting: the tokens are drawn on the logits' device (queued after the step) and read
        when `Draw.results` is called; until then `Draw.token_ids` holds them there (the next step's inputs)."""
        if not rows:
            return Draw(logits.new_empty(0, dtype=torch.long), [])
        order = [r.logits_row for r in rows]
        edited = [r.context is not None or r.bitmask_row is not None for r in rows]
        if order != list(range(logits.shape[0])):  # rows repeat (parallel samples) or skip: gather them
            logits = logits[on_device(order, logits.device)]
        elif any(r.suppress_token_ids for r in rows) or any(edited):
            logits = logits.clone()  # masked below; the model's (inference-mode) output stays as it was
        if any(edited):
            logits = logits.float()  # penalties and biases in float32, as vLLM's formulas are
        suppressed = [(i, t) for i, row in enumerate(rows) for t in row.suppress_token_ids]
        if suppressed:
            index = on_device(suppressed, logits.device)
            logits[index[:, 0], index[:, 1]] = float("-inf")
        masked = [i for i, r in enumerate(rows) if r.bitmask_row is not None]
        if masked:
            logits_processors.apply_bitmask(logits, bitmask[[rows[i].bitmask_row for i in masked]], masked)
        with_context = [(i, r.params, r.context) for i, r in enumerate(rows) if r.context is not None]
        if with_context:
            logits_processors.apply(logits, with_context)
        token_ids = logits.argmax(dim=-1)
        random_rows = [i for i, r in enumerate(rows) if not r.params.greedy]
        if random_rows:
            index = on_device(random_rows, logits.device)
            token_ids[index] = self._sample_random(logits[index].float(), [rows[i] for i in random_rows])
        draw = Draw(token_ids, rows)
        want = [i for i, r in enumerate(rows) if r.params.logprobs is not None]
        if want:
            index = on_device(want, logits.device)
            logprobs = logits[index].float().log_softmax(dim=-1)
            top_vals, top_ids = logprobs.topk(max(max(rows[i].params.logprobs for i in want), 1), dim=-1)
            chosen = logprobs.gather(1, token_ids[index][:, None])
            draw.logprobs = (want, chosen, top_ids, top_vals)
        if token_ids.is_cuda:  # the tokens come back through pinned memory; an event says when
            draw.host = torch.empty(token_ids.shape, dtype=token_ids.dtype, pin_memory=True)
            draw.host.copy_(token_ids, non_blocking=True)
            draw.event = torch.cuda.Event()
            draw.event.record()
        return draw

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
        temps = on_device([r.params.temperature for r in rows], logits.device, torch.float32)
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
            shared = torch.empty(len(unseeded), probs.shape[1], device=probs.device)
            noise[on_device(unseeded, probs.device)] = shared.exponential_(generator=self.generator)
        for i, r in enumerate(rows):
            if r.generator is not None:
                noise[i].exponential_(generator=r.generator)
        return (probs / noise).argmax(dim=-1)


def _apply_top_k_top_p(logits: torch.Tensor, top_ks: list[int], top_ps: list[float]) -> torch.Tensor:
    vocab = logits.shape[1]
    sorted_logits, sorted_ids = logits.sort(dim=-1, descending=True)
    ks = on_device([k if k > 0 else vocab for k in top_ks], logits.device)
    ranks = torch.arange(vocab, device=logits.device)[None, :]
    sorted_logits = sorted_logits.masked_fill(ranks >= ks[:, None], float("-inf"))
    ps = on_device(top_ps, logits.device, logits.dtype)
    probs = sorted_logits.softmax(dim=-1)
    mass_before = probs.cumsum(dim=-1) - probs
    sorted_logits = sorted_logits.masked_fill(mass_before >= ps[:, None], float("-inf"))
    return torch.full_like(logits, float("-inf")).scatter(1, sorted_ids, sorted_logits)
