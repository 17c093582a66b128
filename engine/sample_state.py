"""Engine-side state of one sample (what the scheduler does not need), and the stop rules it is judged by."""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from engine.detokenizer import IncrementalDetokenizer
from engine.logits_processors import SampleContext, needs_context
from engine.request import FinishReason, Request
from engine.structured_output.backend import SampleGrammar


@dataclass
class SampleState:
    request: Request
    detokenizer: IncrementalDetokenizer
    generator: torch.Generator | None
    new_token_ids: list[int] = field(default_factory=list)
    new_logprobs: list[dict] = field(default_factory=list)
    undetokenized: list[int] = field(default_factory=list)
    """Accepted tokens whose text is not made yet (samples without stop strings)."""
    flush_text: bool = False
    """Ended for a reason other than a stop string: release held-back text with the last delta."""
    grammar: SampleGrammar | None = None
    """The sample's matcher when its output is constrained (structured outputs)."""
    context: SampleContext | None = None
    """What penalties, logit bias and bad words read (None when the request uses none)."""
    prompt_logprobs: list[dict] | None = None
    """prompt_logprobs: the entries computed so far (engine/prompt_logprobs.py), sent with the first delta."""

    def make_text(self) -> SampleState:
        """Detokenize the tokens accepted since the last delta (and release held text once ended)."""
        for token_id in self.undetokenized:
            self.detokenizer.add_token(token_id)
        self.undetokenized.clear()
        if self.flush_text:
            self.detokenizer.flush()
            self.flush_text = False
        return self


def sample_context(request: Request, tokenizer) -> SampleContext | None:
    """The request's tokens (live lists) and bad words as token ids, for the logits edits that read them."""
    if not needs_context(request.params):
        return None
    return SampleContext(request.prompt_token_ids, request.output_token_ids,
                         bad_words_token_ids(tokenizer, request.params.bad_words))


def bad_words_token_ids(tokenizer, words: list[str]) -> list[list[int]]:
    """vLLM's reading of bad words: each word as written and, when it tokenizes to as many tokens with
    another first token, with one leading space (the word in mid-text)."""
    result = []
    for word in words:
        plain = tokenizer.encode(word.lstrip())
        spaced = tokenizer.encode(" " + word.lstrip())
        result += [plain] + ([spaced] if len(spaced) == len(plain) and spaced[:1] != plain[:1] else [])
    return [ids for ids in result if ids]


def grammar_verdict(sample: SampleState, token_id: int) -> FinishReason | None:
    """Advance the sample's grammar by an accepted token: ERROR when it forbids it, STOP when it is complete."""
    if sample.grammar is None:
        return None
    if not sample.grammar.accept(token_id):
        return FinishReason.ERROR
    return FinishReason.STOP if sample.grammar.finished else None


def stop_reason(request: Request, token_id: int, stop_string: str | None, eos_token_ids,
                max_model_len: int) -> FinishReason | None:
    """Why `request` ends with `token_id` just accepted (None: it goes on)."""
    params = request.params
    if request.num_output_tokens >= params.min_tokens:
        if token_id in params.stop_token_ids or (not params.ignore_eos and token_id in eos_token_ids):
            return FinishReason.STOP
        if stop_string is not None:
            return FinishReason.STOP_STRING
    if request.num_output_tokens >= params.max_tokens or request.num_tokens >= max_model_len:
        return FinishReason.LENGTH
    return None


def whole_logit_rows(plan, samples: dict, suppressed) -> torch.Tensor:
    """Per row of a step's logits (`plan`: the engine's (item, samples, num_logits, start) per scheduled item):
    whether sampling reads more of the row than its argmax. Only a plain greedy row does not (no logprobs,
    grammar, penalties or bias, suppressed ids, proposed tokens or forks); a pipeline's last stage sends the
    other rows whole and of it only the argmax."""
    whole = []
    for item, sampling, num_logits, _ in plan:
        request = item.request
        sample = samples.get(request.request_id)
        plain = bool(sampling) and sample is not None and request.params.greedy \
            and request.params.logprobs is None and sample.grammar is None and sample.context is None \
            and not item.spec_token_ids and not request.pending_forks and not suppressed(request)
        whole += [True] * (num_logits - 1) + [not plain] if num_logits else []
    return torch.tensor(whole, dtype=torch.bool)
