"""Penalties, min_p, logit bias, bad words and the grammar bitmask against vLLM's reference formulas,
written out here element by element on fixed logits, and through the sampler."""
from __future__ import annotations

import math

import pytest
import torch

from engine import logits_processors as lp
from engine.logits_processors import SampleContext
from engine.sampler import Sampler, SampleRow
from engine.sampling_params import InvalidParameter, SamplingParams

VOCAB = 12


def fixed_logits(rows: int = 3) -> torch.Tensor:
    torch.manual_seed(7)
    return torch.randn(rows, VOCAB) * 3


def reference_penalties(row: list[float], prompt: list[int], output: list[int], rep: float, freq: float,
                        pres: float) -> list[float]:
    """vLLM's apply_penalties, one token at a time: repetition over prompt + output tokens (divide if > 0,
    else multiply), then frequency x count and presence x (count > 0) over output tokens."""
    out = []
    for token, logit in enumerate(row):
        if token in prompt or token in output:
            logit = logit / rep if logit > 0 else logit * rep
        count = output.count(token)
        out.append(logit - freq * count - pres * (1.0 if count else 0.0))
    return out


@pytest.mark.parametrize(("rep", "freq", "pres"), [(1.3, 0.0, 0.0), (1.0, 0.7, 0.0), (1.0, 0.0, -1.5),
                                                    (0.8, -0.4, 1.1)])
def test_penalties_equal_the_reference_formula(rep, freq, pres):
    logits = fixed_logits(1)
    prompt, output = [1, 4, 4, 9], [4, 2, 2, 2, 11]
    params = SamplingParams(repetition_penalty=rep, frequency_penalty=freq, presence_penalty=pres)
    got = lp.penalized_row(logits[0].clone(), params, SampleContext(prompt, output))
    want = reference_penalties(logits[0].tolist(), prompt, output, rep, freq, pres)
    assert got.tolist() == pytest.approx(want, abs=1e-5)


def test_min_p_keeps_tokens_at_least_min_p_times_the_top_probability():
    logits = fixed_logits(2)
    got = lp.apply_min_p(logits.clone(), [0.2, 0.0])
    probs = logits.softmax(-1)
    for token in range(VOCAB):
        keep = probs[0, token] >= 0.2 * probs[0].max()
        assert math.isinf(got[0, token]) != bool(keep)
    assert torch.equal(got[1], logits[1])  # min_p 0: the row is untouched


def test_bad_words_ban_the_last_token_only_after_the_words_other_tokens():
    words = [[5], [3, 7], [1, 2, 8]]
    assert lp.banned_by_bad_words(words, []) == [5]
    assert lp.banned_by_bad_words(words, [0, 3]) == [5, 7]
    assert lp.banned_by_bad_words(words, [1, 2]) == [5, 8]
    assert lp.banned_by_bad_words(words, [2, 1]) == [5]


def test_logit_bias_bad_words_and_penalties_through_the_sampler_change_greedy_tokens():
    logits = torch.zeros(1, VOCAB)
    logits[0, 3] = 5.0
    logits[0, 6] = 4.0
    sampler = Sampler(0, torch.device("cpu"))

    def greedy(params, output=()):
        context = lp.SampleContext([0], list(output), [[3]] if params.bad_words else [])
        return sampler.sample(logits, [SampleRow(0, params, None, [], context)])[0].token_id

    assert greedy(SamplingParams(temperature=0)) == 3
    assert greedy(SamplingParams(temperature=0, logit_bias={6: 2.0})) == 6
    assert greedy(SamplingParams(temperature=0, logit_bias={3: -100.0})) == 6
    assert greedy(SamplingParams(temperature=0, bad_words=["x"])) == 6
    assert greedy(SamplingParams(temperature=0, repetition_penalty=2.0), output=[3]) == 6  # 5/2 < 4
    assert greedy(SamplingParams(temperature=0, presence_penalty=1.5), output=[3]) == 6
    assert greedy(SamplingParams(temperature=0, frequency_penalty=0.4), output=[3, 3]) == 3  # 5 - 0.8 > 4
    assert torch.equal(logits[0, [3, 6]], torch.tensor([5.0, 4.0]))  # the model's logits are untouched


def test_min_p_sampling_never_draws_a_dropped_token():
    logits = torch.tensor([[4.0, 3.9, 0.0, -1.0]])
    sampler = Sampler(0, torch.device("cpu"))
    rows = [SampleRow(0, SamplingParams(temperature=1.0, min_p=0.5), None, [])]
    drawn = {sampler.sample(logits, rows)[0].token_id for _ in range(200)}
    assert drawn == {0, 1}


def test_the_bitmask_allows_exactly_its_set_bits_and_nothing_past_its_end():
    bitmask = torch.zeros(2, 1, dtype=torch.int32)
    bitmask[0, 0] = (1 << 2) | (1 << 9)
    bitmask[1, 0] = -1  # all 32 bits: tokens 0..31, but the logits have 40 tokens
    logits = torch.zeros(2, 40)
    lp.apply_bitmask(logits, bitmask, [0, 1])
    assert torch.isfinite(logits[0]).nonzero().flatten().tolist() == [2, 9]
    assert torch.isfinite(logits[1]).nonzero().flatten().tolist() == list(range(32))


def test_the_cpu_kernel_and_the_torch_path_mask_the_same_rows_alike():
    from engine import cpu_kernels
    kernels = cpu_kernels.load()
    assert kernels is not None, "the C++ CPU kernels did not build (a C++ compiler is needed)"
    torch.manual_seed(5)
    bitmask = torch.randint(-2**31, 2**31 - 1, (2, 3), dtype=torch.int32)
    bitmask[1, 1] = -1  # a word allowing all 32 tokens (skipped whole by the kernel)
    logits = torch.randn(4, 100)  # 100 tokens, the bitmask covers 96: the last 4 are never allowed
    by_kernel, by_torch = logits.clone(), logits.clone()
    kernels.apply_token_bitmask(by_kernel, bitmask, torch.tensor([3, 1]))
    lp.apply_bitmask_torch(by_torch, bitmask, [3, 1])
    assert torch.equal(by_kernel, by_torch)
    assert torch.equal(by_kernel[[0, 2]], logits[[0, 2]]) and torch.isinf(by_kernel[3, 96:]).all()


def test_the_bitmask_agrees_with_llguidance_s_own_application():
    import llguidance.torch
    torch.manual_seed(3)
    bitmask = torch.randint(-2**31, 2**31 - 1, (3, 4), dtype=torch.int32)
    logits = torch.randn(3, 128)
    ours = logits.clone()
    lp.apply_bitmask(ours, bitmask, [0, 1, 2])
    theirs = logits.clone()
    llguidance.torch.apply_token_bitmask_inplace(theirs, bitmask)
    assert torch.equal(ours, theirs)


@pytest.mark.parametrize(("kwargs", "field"), [
    ({"repetition_penalty": 0.0}, "repetition_penalty"), ({"presence_penalty": 2.5}, "presence_penalty"),
    ({"frequency_penalty": -3}, "frequency_penalty"), ({"min_p": 1.5}, "min_p"),
    ({"logit_bias": {1: 101.0}}, "logit_bias"), ({"logit_bias": {-1: 1.0}}, "logit_bias"),
    ({"logit_bias": {1: float("nan")}}, "logit_bias"), ({"bad_words": [""]}, "bad_words"),
    ({"bad_words": ["x"] * 65}, "bad_words"), ({"prompt_logprobs": 21}, "prompt_logprobs"),
])
def test_out_of_range_values_name_their_field(kwargs, field):
    with pytest.raises(InvalidParameter) as err:
        SamplingParams(**kwargs)
    assert err.value.field == field
