"""Which proposer an engine runs, and which decoding requests ask it for tokens each step."""
from __future__ import annotations

from engine.config import EngineConfig
from engine.model.model_config import ModelConfig
from engine.request import Request
from engine.spec_decode import Proposer


def make_proposer(config: EngineConfig, model_config: ModelConfig, max_model_len: int,
                  num_blocks: int) -> Proposer | None:
    spec = config.speculative
    if spec.method == "ngram":
        from engine.spec_decode.ngram import NgramProposer
        return NgramProposer(spec.ngram_min, spec.ngram_max)
    if spec.method == "draft":
        from engine.spec_decode.draft import DraftProposer
        return DraftProposer(config, model_config, max_model_len, num_blocks)
    return None


def propose(proposer: Proposer, running: list[Request], k_max: int, max_model_len: int) -> None:
    """Set `spec_token_ids` of every running request: the proposer's tokens for those decoding one token
    (no forks pending, no logprobs, past min_tokens, no penalties, biases, bad words or min_p, which the
    verification does not apply), [] for the rest. K + 1 tokens may be emitted, so K
    stays within max_tokens and the context."""
    requests, limits = [], []
    for request in running:
        request.spec_token_ids = []
        params = request.params
        if (request.num_tokens - request.num_computed_tokens != 1 or request.pending_forks
                or request.prefill_only or params.logprobs is not None
                or request.num_output_tokens < params.min_tokens
                or params.penalized or params.logit_bias or params.bad_words or params.min_p):
            continue
        k = min(k_max, params.max_tokens - request.num_output_tokens - 1, max_model_len - request.num_tokens - 1)
        if k >= 1:
            requests.append(request)
            limits.append(k)
    if requests:
        for request, proposal in zip(requests, proposer.propose(requests, limits), strict=True):
            request.spec_token_ids = proposal
