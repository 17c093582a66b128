"""The MoE layer (engine/model/moe.py) equals transformers' own MoE blocks, and the Triton kernel equals it.

Each family's block comes from a one-layer transformers model built from its config class with random
weights; the model is saved with `save_pretrained`, so the weights reach `read_moe_weights` under the
names real checkpoints use. fp32 outputs must match the block's on random hidden states; the expert
counts must match the routing. The Triton fused-MoE (engine/model/moe_triton.py) runs under
TRITON_INTERPRET=1 on CPU (set before triton is imported) and compiled on a GPU host.
"""
import os

import pytest
import torch
import transformers

from engine.model.loader import read_tensors
from engine.model.moe import MoeSpec, MoeWeights, experts_forward, moe_forward, read_moe_weights, route

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"
triton = pytest.importorskip("triton", reason="the triton wheel is part of the test install")

from engine.model.moe_triton import align_block_size, fused_moe  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
HIDDEN, INTER, EXPERTS, TOP_K = 40, 24, 8, 3
COMMON = dict(vocab_size=64, hidden_size=HIDDEN, num_hidden_layers=1, num_attention_heads=2,
              num_key_value_heads=1, head_dim=16)
FAMILIES = {
    "mixtral": (transformers.MixtralConfig, transformers.MixtralForCausalLM,
                dict(intermediate_size=INTER, num_local_experts=EXPERTS, num_experts_per_tok=TOP_K)),
    "qwen3_moe": (transformers.Qwen3MoeConfig, transformers.Qwen3MoeForCausalLM,
                  dict(moe_intermediate_size=INTER, num_experts=EXPERTS, num_experts_per_tok=TOP_K,
                       norm_topk_prob=True)),
    "qwen3_moe_unnormalized": (transformers.Qwen3MoeConfig, transformers.Qwen3MoeForCausalLM,
                               dict(moe_intermediate_size=INTER, num_experts=EXPERTS, num_experts_per_tok=TOP_K,
                                    norm_topk_prob=False)),
    "gpt_oss": (transformers.GptOssConfig, transformers.GptOssForCausalLM,
                dict(intermediate_size=INTER, num_local_experts=EXPERTS, num_experts_per_tok=TOP_K,
                     swiglu_limit=1.5)),  # a low limit, so the clamps bite at this init
}


def spec_for(config) -> MoeSpec:
    """What the integration step reads from each family's config."""
    if config.model_type == "gpt_oss":
        alpha = getattr(config, "swiglu_alpha", 1.702)  # older transformers (5.17) have the slope fixed
        return MoeSpec(config.num_local_experts, config.num_experts_per_tok, "topk_softmax",
                       swiglu_limit=config.swiglu_limit, swiglu_alpha=alpha)
    if config.model_type == "qwen3_moe":
        return MoeSpec(config.num_experts, config.num_experts_per_tok, renormalize=config.norm_topk_prob)
    return MoeSpec(config.num_local_experts, config.num_experts_per_tok)


@pytest.fixture(scope="module", params=list(FAMILIES))
def family(request, tmp_path_factory):
    """(the family, its transformers MoE block, MoeSpec, MoeWeights read from the saved checkpoint)."""
    config_cls, model_cls, moe_args = FAMILIES[request.param]
    torch.manual_seed(0)
    model = model_cls(config_cls(**COMMON, **moe_args)).eval()
    block = model.model.layers[0].mlp
    with torch.no_grad():
        for p in block.parameters():  # spread routing weights (top-k gaps far above fp32 noise); biases non-zero
            p.normal_(0.0, 0.4)
    path = tmp_path_factory.mktemp(request.param)
    model.save_pretrained(path)
    tensors = read_tensors(path)
    family_name = request.param.removesuffix("_unnormalized")
    weights = read_moe_weights(tensors.pop, "model.layers.0.", family_name, EXPERTS)
    assert not [n for n in tensors if ".mlp." in n or "block_sparse_moe" in n], "every MoE tensor is read"
    return request.param, block, spec_for(model.config), weights


def reference(block, hidden: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        out = block(hidden.unsqueeze(0))
    return (out[0] if isinstance(out, tuple) else out).squeeze(0)  # GptOssMLP also returns router scores


@pytest.mark.parametrize("num_tokens", [1, 7, 50])
def test_moe_forward_matches_transformers_block(family, num_tokens):
    name, block, spec, weights = family
    hidden = torch.randn(num_tokens, HIDDEN, generator=torch.Generator().manual_seed(num_tokens))
    out = moe_forward(hidden, weights, spec)
    torch.testing.assert_close(out.hidden, reference(block, hidden), rtol=1e-5, atol=1e-5)
    _, ids = route(hidden, weights, spec)
    assert out.expert_counts.tolist() == torch.bincount(ids.flatten(), minlength=EXPERTS).tolist()
    assert out.expert_counts.sum().item() == num_tokens * TOP_K


def test_routing_conventions_differ_where_they_should(family):
    """Renormalised weights sum to 1; Qwen3-MoE without norm_topk_prob keeps the softmax mass of its k."""
    name, _, spec, weights = family
    topk_weights, ids = route(torch.randn(20, HIDDEN), weights, spec)
    sums = topk_weights.sum(-1)
    if name == "qwen3_moe_unnormalized":
        assert (sums < 1 - 1e-3).all()
    else:
        torch.testing.assert_close(sums, torch.ones_like(sums))
    assert (ids.sort(-1).values.diff(dim=-1) > 0).all(), "a token's k experts are distinct"


def test_unchosen_experts_are_never_computed(family):
    """NaN weights in experts no token picks leave the output finite: a dense all-experts loop would not."""
    _, _, spec, weights = family
    hidden = torch.randn(2, HIDDEN, generator=torch.Generator().manual_seed(3))
    before = moe_forward(hidden, weights, spec)
    idle = (before.expert_counts == 0).nonzero().flatten()
    assert idle.numel() > 0, "2 tokens x 3 of 8 experts leaves some idle"
    poisoned = MoeWeights(weights.router, weights.w13.clone(), weights.w2.clone(), weights.router_bias,
                          weights.b13, weights.b2)
    poisoned.w13[idle] = float("nan")
    poisoned.w2[idle] = float("nan")
    torch.testing.assert_close(moe_forward(hidden, poisoned, spec).hidden, before.hidden, rtol=0, atol=0)


def test_align_block_size_pads_each_expert_run():
    ids = torch.tensor([[2, 0], [2, 5], [0, 2], [5, 1]])
    sorted_ids, block_expert, counts = align_block_size(ids, 6, block_m=4)
    n = ids.numel()
    assert counts.tolist() == [2, 1, 3, 0, 0, 2]
    used = block_expert[block_expert >= 0].tolist()
    assert used == [0, 1, 2, 5]  # one block per non-empty expert, in order; the rest marked unused
    rows = sorted_ids[:4 * len(used)].view(-1, 4)
    for expert, row in zip(used, rows.tolist(), strict=True):
        pairs = [p for p in row if p < n]
        assert pairs == sorted(pairs) and all(ids.flatten()[p] == expert for p in pairs)
        assert len(pairs) == counts[expert] and row[len(pairs):] == [n] * (4 - len(pairs))


def triton_case(family, num_tokens: int, dtype: torch.dtype):
    _, _, spec, w = family
    weights = MoeWeights(*(t.to(DEVICE, dtype) if t is not None else None
                           for t in (w.router, w.w13, w.w2, w.router_bias, w.b13, w.b2)))
    hidden = torch.randn(num_tokens, HIDDEN, generator=torch.Generator().manual_seed(num_tokens)).to(DEVICE, dtype)
    topk_weights, ids = route(hidden, weights, spec)
    return fused_moe(hidden, weights, spec, topk_weights, ids), experts_forward(hidden, weights, spec,
                                                                                topk_weights, ids)


@pytest.mark.parametrize("num_tokens", [1, 5, 40])  # 40 x 3 pairs: the 64-row blocks, several per expert
def test_triton_fused_moe_matches_torch_path(family, num_tokens):
    got, want = triton_case(family, num_tokens, torch.float32)
    torch.testing.assert_close(got.hidden, want.hidden, rtol=1e-5, atol=1e-5)
    assert got.expert_counts.tolist() == want.expert_counts.tolist()


def test_empty_step(family):
    _, _, spec, w = family
    # On the Triton test device: compiled Triton (a GPU host) refuses CPU tensors, the interpreter takes them.
    weights = MoeWeights(*(t.to(DEVICE) if t is not None else None
                           for t in (w.router, w.w13, w.w2, w.router_bias, w.b13, w.b2)))
    hidden = torch.zeros(0, HIDDEN, device=DEVICE)
    topk_weights, ids = route(hidden, weights, spec)
    for out in (moe_forward(hidden, weights, spec), fused_moe(hidden, weights, spec, topk_weights, ids)):
        assert out.hidden.shape == (0, HIDDEN) and out.expert_counts.tolist() == [0] * EXPERTS


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the compiled kernel in bf16 needs a CUDA GPU")
@pytest.mark.parametrize("num_tokens", [1, 33, 300])
def test_triton_fused_moe_bf16_on_cuda(family, num_tokens):
    got, want = triton_case(family, num_tokens, torch.bfloat16)
    got, want = got.hidden.float(), want.hidden.float()
    # bf16 sums in another order: a few ulps apart per element (0.047 seen at |x| ~ 4 on an H100), the whole close
    assert float((got - want).norm() / want.norm()) < 1e-2
    torch.testing.assert_close(got, want, rtol=2e-2, atol=0.02 * float(want.abs().max()))
