"""Checks of token ids a caller hands the engine: each must index the vocabulary (else an IndexError on
CPU, a device-side assert that kills the process on CUDA) and the context must hold them."""
from __future__ import annotations

from engine.sampling_params import InvalidParameter, SamplingParams


def check_token_ids(token_ids: list[int], field: str, vocab_size: int) -> None:
    bad = next((t for t in token_ids if not isinstance(t, int) or not 0 <= t < vocab_size), None)
    if bad is not None:
        raise InvalidParameter(field, f"token id {bad} is outside the vocabulary [0, {vocab_size})")


def check_prompt(prompt_token_ids: list[int], vocab_size: int, max_model_len: int) -> None:
    if not prompt_token_ids:
        raise InvalidParameter("input", "the prompt is empty")
    check_token_ids(prompt_token_ids, "token_ids", vocab_size)
    if len(prompt_token_ids) >= max_model_len:
        raise InvalidParameter("input", f"the prompt has {len(prompt_token_ids)} tokens; "
                                        f"the context holds {max_model_len} (prompt plus at least one new)")


def check_params(params: SamplingParams, first_token_id: int | None, vocab_size: int) -> None:
    check_token_ids(params.stop_token_ids, "stop_token_ids", vocab_size)
    check_token_ids(list(params.logit_bias), "logit_bias", vocab_size)
    if first_token_id is not None:
        check_token_ids([first_token_id], "first_token_id", vocab_size)


def check_resume(prompt_token_ids: list[int], resume_token_ids: list[int], vocab_size: int,
                 max_model_len: int) -> None:
    """Tokens a migrated request already generated: in the vocabulary, and prompt + them within the context."""
    check_token_ids(resume_token_ids, "resume_token_ids", vocab_size)
    if len(prompt_token_ids) + len(resume_token_ids) > max_model_len:
        raise InvalidParameter("resume_token_ids", f"prompt plus resumed tokens exceed the context "
                                                   f"({max_model_len} tokens)")
