"""Speculative decoding: proposers, exact verification (greedy and rejection sampling), KV rollback, no leaks.

The statistical tests are pure torch over a small vocabulary; the engine tests run the real default model in
float32, whose greedy output with speculation must equal greedy output without it, token for token."""
import pytest
import torch

from engine.config import CacheConfig, EngineConfig, SchedulerConfig, SpeculativeConfig
from engine.kv_cache_manager import KVCacheManager
from engine.llm_engine import LLMEngine
from engine.request import FinishReason, Request
from engine.sampling_params import SamplingParams
from engine.scheduler import Scheduler
from engine.spec_decode.ngram import propose_ngram
from engine.spec_decode.rejection import greedy_verify, rejection_sample

# ---- proposers and verification rules (no model) ---------------------------


def test_ngram_proposes_what_followed_the_longest_earlier_match():
    tokens = [1, 2, 3, 4, 5, 9, 9, 2, 3, 4]
    assert propose_ngram(tokens, 3, 1, 4) == [5, 9, 9]   # suffix 2 3 4 seen at 1..3, followed by 5 9 9
    assert propose_ngram(tokens, 10, 1, 4) == [5, 9, 9, 2, 3, 4]  # stops at the end of the sequence
    assert propose_ngram([1, 2, 3, 4], 3, 1, 4) == []     # nothing repeats
    assert propose_ngram([7, 8, 7], 2, 1, 1) == [8, 7]    # n = 1: the earliest earlier 7
    assert propose_ngram([7, 8, 7], 2, 2, 3) == []        # no 2-gram repeats
    assert propose_ngram([5], 3, 1, 4) == []


def test_config_is_validated():
    with pytest.raises(ValueError):
        SpeculativeConfig(method="medusa")
    with pytest.raises(ValueError):
        SpeculativeConfig(method="ngram", num_speculative_tokens=0)
    with pytest.raises(ValueError):
        SpeculativeConfig(method="ngram", ngram_min=3, ngram_max=2)
    with pytest.raises(ValueError):
        SpeculativeConfig(method="draft")  # no draft model
    assert not SpeculativeConfig().enabled and SpeculativeConfig(method="ngram").enabled


def test_greedy_verify_keeps_the_agreeing_prefix_then_the_targets_token():
    assert greedy_verify([5, 6, 7, 8], [5, 6, 7]) == [5, 6, 7, 8]  # all accepted + bonus
    assert greedy_verify([5, 6, 7, 8], [5, 0, 7]) == [5, 6]
    assert greedy_verify([5, 6], [4]) == [5]
    assert greedy_verify([3], []) == [3]


CHI2_CRITICAL_DF7 = 24.32  # p = 0.001, 7 degrees of freedom (vocabulary of 8)


def chi2(counts: torch.Tensor, probs: torch.Tensor) -> float:
    expected = probs * counts.sum()
    return float(((counts - expected) ** 2 / expected).sum())


@pytest.mark.parametrize("with_draft_probs", [False, True], ids=["point-mass", "draft-distribution"])
def test_rejection_sampling_follows_the_target_distribution(with_draft_probs):
    """Every emitted position follows the target's distribution, whatever is proposed."""
    torch.manual_seed(0)
    vocab, k, draws = 8, 3, 6000
    target = torch.rand(k + 1, vocab) ** 2 + 0.01
    target /= target.sum(-1, keepdim=True)
    draft = torch.rand(k, vocab)
    draft /= draft.sum(-1, keepdim=True)
    generator = torch.Generator().manual_seed(1234)
    first = torch.zeros(vocab)
    second = torch.zeros(vocab)
    accepted = 0
    for _ in range(draws):
        if with_draft_probs:  # proposals drawn from the draft's distributions
            proposal = [int(torch.multinomial(draft[i], 1, generator=generator)) for i in range(k)]
            out = rejection_sample(target, proposal, generator, draft)
        else:  # a deterministic proposer (ngram): always tokens 3, 3, 5
            proposal = [3, 3, 5]
            out = rejection_sample(target, proposal, generator)
        assert 1 <= len(out) <= k + 1 and out[:len(out) - 1] == proposal[:len(out) - 1]
        accepted += len(out) - 1
        first[out[0]] += 1
        if len(out) >= 2:  # reached only when position 0 accepted its proposal; position 1 still ~ target[1]
            second[out[1]] += 1
    assert chi2(first, target[0]) < CHI2_CRITICAL_DF7
    assert chi2(second, target[1]) < CHI2_CRITICAL_DF7
    assert 0 < accepted < draws * k


def test_rejection_sampling_is_deterministic_under_a_seed():
    target = torch.softmax(torch.randn(4, 16), -1)
    runs = [[rejection_sample(target, [1, 2, 3], g) for _ in range(50)]
            for g in (torch.Generator().manual_seed(7), torch.Generator().manual_seed(7))]
    assert runs[0] == runs[1]


def test_sure_proposals_are_always_accepted_and_impossible_ones_never():
    target = torch.zeros(3, 5)
    target[0, 2] = target[1, 4] = 1.0
    target[2] = 0.2
    g = torch.Generator().manual_seed(0)
    assert rejection_sample(target, [2, 4], g)[:2] == [2, 4]
    out = rejection_sample(target, [1, 4], g)  # p(1) = 0 at position 0: rejected, residual is p itself
    assert out == [2]


# ---- scheduler: blocks for proposals, rolled back on rejection (no torch) ---------


def test_proposal_blocks_are_freed_on_rejection_and_never_hashed():
    bs = 4
    kv = KVCacheManager(32, bs)
    s = Scheduler(SchedulerConfig(max_num_batched_tokens=64), kv)
    r = Request("a", list(range(6)), SamplingParams(max_tokens=20))
    s.add_request(r)
    out = s.schedule()
    s.finish_step(out)
    r.append_token(100)                        # 7 tokens, 6 computed, blocks [0..3] [4..7]
    r.spec_token_ids = [101, 102, 103, 104, 105, 106, 107]
    out = s.schedule()
    (item,) = out.scheduled
    assert item.num_new_tokens == 8 and len(item.spec_token_ids) == 7 and not r.spec_token_ids and item.num_logits == 8
    assert item.input_token_ids() == [100, 101, 102, 103, 104, 105, 106, 107]
    assert len(kv.block_table("a")) == 4       # positions 6..13
    s.finish_step(out)
    assert r.num_computed_tokens == 7          # only the real token counts until verified
    r.append_token(55)                         # every proposal rejected: the target's own token
    s.accept_spec(r, 0)
    assert r.num_computed_tokens == 7 and len(kv.block_table("a")) == 2
    assert kv.pool.num_used_blocks == 2
    assert kv.pool.num_cached_blocks == 1      # block [4..7] holds rejected KV at 7: not hashed
    # next step: two proposals, the first accepted
    r.spec_token_ids = [56, 57]
    out = s.schedule()
    s.finish_step(out)
    r.append_token(56)
    r.append_token(60)
    s.accept_spec(r, 1)
    assert r.num_computed_tokens == 9 and r.num_tokens == 10
    cached = {kv.pool.blocks[b].token_ids for b in kv.block_table("a") if kv.pool.blocks[b].token_ids}
    assert cached == {(0, 1, 2, 3), (4, 5, 100, 55)}  # the accepted tokens, not the rejected 101
    s.finish(r, FinishReason.LENGTH)
    assert kv.pool.num_used_blocks == 0 and not kv.block_tables


# ---- the engine on the real model ---------------------------------------------

TEXT = ("The quick brown fox jumps over the lazy dog. Pack my box with five dozen liquor jugs. "
        "How vexingly quick daft zebras jump! Sphinx of black quartz, judge my vow.")


@pytest.fixture(scope="module")
def engine(smollm2_dir):
    return LLMEngine(EngineConfig(model=str(smollm2_dir), dtype="float32", overlap_steps=False,
                                  cache=CacheConfig(kv_cache_memory_bytes=128 << 20),
                                  speculative=SpeculativeConfig(method="ngram", num_speculative_tokens=4)))


@pytest.fixture(scope="module")
def prompts(engine):
    chat = engine.tokenizer.apply_chat_template
    return [chat([{"role": "user", "content": f"Repeat this paragraph verbatim: {TEXT}"}]),
            chat([{"role": "user", "content": "What is the capital of France?"}]),
            engine.tokenizer.encode("1, 2, 3, 4, 5, 6, 7, 8,")]


@pytest.fixture(scope="module")
def greedy32(engine, prompts):
    """Greedy tokens without speculation (32 each; shorter runs are prefixes of these)."""
    return ids(without_speculation(engine, prompts, SamplingParams(temperature=0, max_tokens=32, ignore_eos=True)))


def without_speculation(engine, prompts, params):
    proposer, engine.proposer = engine.proposer, None
    try:
        return engine.generate(prompts, params)
    finally:
        engine.proposer = proposer


def assert_idle(engine):
    assert not engine.has_unfinished()
    assert engine.kv.pool.num_used_blocks == 0 and not engine.kv.block_tables
    assert not engine._samples and not engine._groups


def ids(outputs):
    return [o.completions[0].token_ids for o in outputs]


@pytest.mark.parametrize("overlap", [False, True], ids=["sync", "overlap"])
def test_greedy_with_speculation_equals_greedy_without(engine, prompts, greedy32, overlap):
    """Steps reported as they run, and overlapped (step N+1 launched before step N is reported, as on CUDA)."""
    params = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True)
    want = greedy32
    drafted, accepted = engine.num_spec_draft_tokens, engine.num_spec_accepted_tokens
    engine.overlap = overlap
    try:
        got = ids(engine.generate(prompts, params))  # one batch: sequences with and without proposals
    finally:
        engine.overlap = False
    assert got == want
    assert engine.num_spec_accepted_tokens - accepted >= 16  # the repeated paragraph and the count are guessed
    assert engine.num_spec_draft_tokens - drafted > engine.num_spec_accepted_tokens - accepted  # and some missed
    assert_idle(engine)


def test_stop_rules_hold_inside_accepted_runs(engine, prompts, greedy32):
    params = SamplingParams(temperature=0, max_tokens=30, stop=["dog"])  # a stop string; EOS
    want = without_speculation(engine, prompts[:2], params)
    got = engine.generate(prompts[:2], params)
    for w, g in zip(want, got, strict=True):
        assert (g.completions[0].token_ids, g.completions[0].text, g.completions[0].finish_reason) == \
            (w.completions[0].token_ids, w.completions[0].text, w.completions[0].finish_reason)
    assert [g.completions[0].finish_reason for g in got] == ["stop_string", "stop"]
    got = engine.generate(prompts[:1], SamplingParams(temperature=0, max_tokens=13, ignore_eos=True))
    assert ids(got) == [greedy32[0][:13]]  # max_tokens reached inside an accepted run
    assert_idle(engine)


def test_seeded_sampling_is_deterministic(engine, prompts):
    params = SamplingParams(temperature=0.8, top_p=0.95, seed=11, max_tokens=16, ignore_eos=True)
    first = ids(engine.generate(prompts[:1], params))
    again = ids(engine.generate(prompts, params))[:1]  # in another batch
    assert first == again
    assert_idle(engine)


class WrongProposer:
    """Proposes tokens the model never outputs here: every proposal is rejected."""

    def propose(self, requests, max_tokens):
        return [[17] * k for k in max_tokens]

    def free(self, request_id):
        pass


def test_rejected_tokens_leave_no_blocks_and_no_prefix_cache_entries(engine, prompts, greedy32):
    params = SamplingParams(temperature=0, max_tokens=14, ignore_eos=True)
    want = [g[:14] for g in greedy32[:2]]
    engine.kv.pool.reset_prefix_cache()
    proposer, engine.proposer = engine.proposer, WrongProposer()
    try:
        got = {}
        for i, prompt in enumerate(prompts[:2]):
            engine.add_request(f"w{i}", prompt, params)
            got[f"w{i}"] = []
        while engine.has_unfinished():
            for delta in engine.step():
                got[delta.request_id] += delta.token_ids
            for request in engine.scheduler.running:  # rejected proposals' blocks are gone after each step
                if request.num_computed_tokens == request.num_tokens - 1:
                    assert len(engine.kv.block_table(request.request_id)) == engine.kv.blocks_needed(
                        request.num_tokens)
    finally:
        engine.proposer = proposer
    assert engine.num_spec_draft_tokens > 0
    assert_idle(engine)
    sequences = [p + w for p, w in zip(prompts[:2], want, strict=True)]
    bs = engine.kv.block_size
    full_blocks = {tuple(seq[i:i + bs]) for seq in sequences for i in range(0, len(seq) - bs + 1, bs)}
    cached = {b.token_ids for b in engine.kv.pool.blocks if b.token_ids is not None}
    assert cached and cached <= full_blocks  # only blocks of the real sequences, never one with token 17
    assert [got["w0"], got["w1"]] == want  # every proposal rejected, still exactly the greedy tokens


def test_decode_role_speculates_from_transferred_kv(engine, prompts, greedy32):
    """Prefill role hands its KV off; the decode role (same engine here) continues with speculation."""
    prompt = prompts[0]
    engine.add_request("p", prompt, SamplingParams(temperature=0, max_tokens=32, ignore_eos=True),
                       prefill_only=True)
    (delta,) = engine.step()
    src = delta.kv_block_ids
    table, num_local = engine.reserve_kv("d", prompt)  # full blocks found in the prefix cache
    engine.runner.kv_cache[table[num_local:]] = engine.runner.kv_cache[src[num_local:]]  # "the transfer"
    assert engine.release_kv("p")
    accepted = engine.num_spec_accepted_tokens
    engine.add_request("d", prompt, SamplingParams(temperature=0, max_tokens=32, ignore_eos=True),
                       first_token_id=delta.token_ids[0])
    tokens = list(delta.token_ids)
    while engine.has_unfinished():
        tokens += [t for d in engine.step() for t in d.token_ids]
    assert tokens == greedy32[0]
    assert engine.num_spec_accepted_tokens > accepted
    assert_idle(engine)


def test_abort_mid_speculation_frees_everything(engine, prompts):
    engine.add_request("x", prompts[0], SamplingParams(temperature=0, max_tokens=200, ignore_eos=True))
    for _ in range(4):
        engine.step()
    assert engine.abort_request("x")
    while engine.has_unfinished():
        engine.step()
    assert_idle(engine)


# ---- draft-model proposer -------------------------------------------------------


def draft_engine(target, draft, k=3):
    return LLMEngine(EngineConfig(model=str(target), dtype="float32", cache=CacheConfig(kv_cache_memory_bytes=64 << 20),
                                  speculative=SpeculativeConfig(method="draft", model=str(draft),
                                                                num_speculative_tokens=k)))


def test_draft_model_identical_to_target_is_always_accepted(tiny_qwen2_dir):
    """The target as its own draft: every proposal accepted, the draft's KV bookkeeping exact."""
    engine = draft_engine(tiny_qwen2_dir, tiny_qwen2_dir)
    prompts = [list(range(100, 140)), list(range(7, 12)), [5] * 20]
    params = SamplingParams(temperature=0, max_tokens=25, ignore_eos=True)
    got = ids(engine.generate(prompts, params))
    assert engine.num_spec_draft_tokens > 30 and engine.num_spec_accepted_tokens == engine.num_spec_draft_tokens
    assert got == ids(without_speculation(engine, prompts, params))
    pair = engine.generate(prompts[:1], SamplingParams(n=2, temperature=0, max_tokens=25, ignore_eos=True))[0]
    assert [c.token_ids for c in pair.completions] == [got[0], got[0]]  # samples sharing blocks (copy-on-write)
    assert_idle(engine)
    assert engine.proposer.kv.pool.num_used_blocks == 0 and not engine.proposer.shadows


def test_random_draft_model_keeps_greedy_output_exact(smollm2_dir, tiny_qwen2_dir, prompts):
    """SmolLM2 verified against a 2-layer random draft of the same vocabulary: mostly rejected, still exact."""
    engine = draft_engine(smollm2_dir, tiny_qwen2_dir, k=2)
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    got = ids(engine.generate(prompts[:2], params))
    assert engine.num_spec_draft_tokens > 0
    assert got == ids(without_speculation(engine, prompts[:2], params))
    assert_idle(engine)
    assert engine.proposer.kv.pool.num_used_blocks == 0
