"""Engine-side state of one sample (what the scheduler does not need), and the stop rules it is judged by."""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from engine.detokenizer import IncrementalDetokenizer
from engine.request import FinishReason, Request


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

    def make_text(self) -> SampleState:
        """Detokenize the tokens accepted since the last delta (and release held text once ended)."""
        for token_id in self.undetokenized:
            self.detokenizer.add_token(token_id)
        self.undetokenized.clear()
        if self.flush_text:
            self.detokenizer.flush()
            self.flush_text = False
        return self


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
