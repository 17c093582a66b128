"""Each family beyond Llama's through real processes: a prefill worker, a decode worker and a router
(`--skip-prefill-tokens 0`, so every prompt is prefilled remotely and its KV crosses to the decode worker),
on the tiny random checkpoints of the family tests (Qwen3: q/k norm and head_dim 16 where hidden / heads
is 12; Phi-3: fused qkv_proj and gate_up_proj; Qwen3-MoE and Mixtral: 8 experts top-2, Qwen3-MoE with a
dense layer between its sparse ones; Gemma 2/3 and gpt-oss: sliding windows of 24 tokens on alternating /
5-in-6 layers, soft-capping, attention sinks, gpt-oss's MoE; Mistral with every layer windowed). The
prompts (70 and 37 tokens) are longer than the windows. The greedy tokens equal transformers' own
generate (fp32) and the workers end with no KV block, request or lease held. One cluster per family, the
next one starting while a family's test runs.

MoE families also export per-expert token counts (worker_runtime/moe_metrics.py): the prefill worker's
equal transformers' routing of the prompt tokens, the decode worker's that of the tokens it fed back. Two
more MoE clusters run two ranks per worker: Qwen3-MoE tensor-parallel (each rank a slice of every expert)
and Mixtral expert-parallel (`--enable-expert-parallel`, each rank 4 whole experts; rank 0's counts still
cover all 8).
"""
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from loadtest.chaos.processes import stop_all
from tests.cluster.harness import assert_no_leaks, free_port, generate_routed, start_cluster
from tests.conftest import hf_greedy
from tests.engine.test_gemma import tiny_gemma
from tests.engine.test_gpt_oss import tiny_gpt_oss
from tests.engine.test_mistral import tiny_mistral
from tests.engine.test_moe_models import tiny_moe
from tests.engine.test_phi3 import tiny_phi3
from tests.engine.test_qwen3 import tiny_qwen3

BUILDERS = {"Qwen3ForCausalLM": tiny_qwen3, "Phi3ForCausalLM": tiny_phi3,
            "Qwen3MoeForCausalLM": lambda path, tok: tiny_moe("qwen3_moe", path, tok),
            "MixtralForCausalLM": lambda path, tok: tiny_moe("mixtral", path, tok),
            "Gemma2ForCausalLM": lambda path, tok: tiny_gemma("gemma2", path, tok),
            "Gemma3ForCausalLM": lambda path, tok: tiny_gemma("gemma3", path, tok),
            "GptOssForCausalLM": tiny_gpt_oss,
            "MistralForCausalLM(window)": lambda path, tok: tiny_mistral(path, tok, sliding_window=24)}
MOE = {"Qwen3MoeForCausalLM", "MixtralForCausalLM"}
"""Families whose expert counts are checked against transformers' routing here (gpt-oss exports them too)."""
PROMPTS = [[3 + (131 * i) % 49000 for i in range(70)], [11, 400, 9000, 77] * 9 + [5]]
MAX_TOKENS = 12


def start_family_cluster(path, prefill_flags: tuple[str, ...] = (), decode_flags: tuple[str, ...] = ()):
    """[prefill, decode, router] on `path`, started side by side, each worker with its own metrics port
    (`metrics_url`)."""
    ports = [free_port(), free_port()]
    started = start_cluster([["prefill", *prefill_flags, "--metrics-port", str(ports[0])],
                             ["decode", *decode_flags, "--metrics-port", str(ports[1])]],
                            "--model", str(path), "--dtype", "float32",
                            router_flags=("--model", str(path), "--skip-prefill-tokens", "0"))
    for proc, port in zip(started, ports, strict=False):
        proc.metrics_url = f"http://127.0.0.1:{port}/metrics"
    return started


FAMILIES = sorted(BUILDERS)
AHEAD = 2


@pytest.fixture(scope="module")
def family_launcher(tmp_path_factory, tokenizer_dir):
    """Starts families' clusters in the background: while one family's test runs, the next AHEAD families'
    clusters start (start-ups mostly wait: two cores do more than one start at a time). Clusters started
    but never used are stopped with the module."""
    def launch(arch):
        with seeded:  # one checkpoint at a time: each draws its weights from torch's global seeded generator
            path = BUILDERS[arch](tmp_path_factory.mktemp(arch), tokenizer_dir)
        return path, start_family_cluster(path)

    seeded = threading.Lock()

    pool, pending = ThreadPoolExecutor(AHEAD), {}

    def get(arch):
        future = pending.pop(arch, None) or pool.submit(launch, arch)
        for following in FAMILIES[FAMILIES.index(arch) + 1:][:AHEAD]:
            if following not in pending:
                pending[following] = pool.submit(launch, following)
        return future.result()

    try:
        yield get
    finally:
        for future in pending.values():
            if future.exception() is None:
                stop_all(future.result()[1])
        pool.shutdown()


@pytest.fixture(scope="module", params=FAMILIES)
def family_cluster(request, family_launcher):
    """(architecture, checkpoint, [prefill, decode], router) for one family."""
    path, started = family_launcher(request.param)
    try:
        yield request.param, path, started[:2], started[2]
    finally:
        stop_all(started)


def run_prompts(path, workers, router) -> list[list[int]]:
    """Every prompt through prefill -> KV transfer -> decode; the tokens equal transformers'."""
    expected = hf_greedy(path, PROMPTS, MAX_TOKENS)
    for i, (prompt, want) in enumerate(zip(PROMPTS, expected, strict=True)):
        got = generate_routed(router, prompt, max_tokens=MAX_TOKENS)
        assert got["prefill"] == workers[0].address and got["decode"] == workers[1].address  # KV crossed
        assert got["tokens"] == want, f"prompt {i} differs"
    return expected


def hf_routing(path, spans: list[tuple[list[int], int, int]]) -> list[int]:
    """[E] (token, expert) pairs transformers routes to each expert, summed over the sparse layers, counting
    only positions [start, end) of each (sequence, start, end)."""
    from transformers import AutoModelForCausalLM
    model = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32)
    num_experts, k = model.config.num_local_experts, model.config.num_experts_per_tok
    total = torch.zeros(num_experts, dtype=torch.long)
    with torch.inference_mode():
        for seq, start, end in spans:
            for logits in model(torch.tensor([seq]), output_router_logits=True).router_logits:
                assert logits.shape == (len(seq), num_experts)
                total += torch.bincount(logits[start:end].topk(k, dim=-1).indices.flatten(), minlength=num_experts)
    return total.tolist()


def expert_tokens(url: str) -> list[int] | None:
    """pdserve:moe_expert_tokens_total by expert from a worker's /metrics; None while it exports none."""
    import urllib.request
    text = urllib.request.urlopen(url, timeout=10).read().decode()
    found = {}
    for line in text.splitlines():
        if line.startswith("pdserve:moe_expert_tokens_total{"):
            expert = int(line.split('expert="', 1)[1].split('"', 1)[0])
            found[expert] = int(float(line.rsplit(" ", 1)[1]))
    return [found[e] for e in sorted(found)] or None


def wait_for_expert_tokens(url: str, want: list[int], timeout_s: float = 30.0) -> list[int] | None:
    """The worker's per-expert counts once they equal `want` (it re-reads them every few seconds), or the
    last ones seen at the deadline."""
    deadline = time.monotonic() + timeout_s
    while True:
        got = expert_tokens(url)
        if got == want or time.monotonic() > deadline:
            return got
        time.sleep(0.2)


def assert_expert_counts(path, workers, expected: list[list[int]]) -> None:
    """Prefill computed every prompt token, decode every token fed back after the first (from prefill)."""
    sequences = [p + out[:-1] for p, out in zip(PROMPTS, expected, strict=True)]
    prefill = hf_routing(path, [(s, 0, len(p)) for s, p in zip(sequences, PROMPTS, strict=True)])
    decode = hf_routing(path, [(s, len(p), len(s)) for s, p in zip(sequences, PROMPTS, strict=True)])
    assert sum(prefill) == sum(map(len, PROMPTS)) * 2 * 2  # top-2, two sparse layers
    assert sum(decode) == len(PROMPTS) * (MAX_TOKENS - 1) * 2 * 2
    assert wait_for_expert_tokens(workers[0].metrics_url, prefill) == prefill
    assert wait_for_expert_tokens(workers[1].metrics_url, decode) == decode


def test_family_through_prefill_and_decode_equals_transformers(family_cluster):
    arch, path, workers, router = family_cluster
    expected = run_prompts(path, workers, router)
    if arch in MOE:
        assert_expert_counts(path, workers, expected)
    elif arch != "GptOssForCausalLM":
        assert all(expert_tokens(w.metrics_url) is None for w in workers)  # dense: no MoE series
    assert_no_leaks(workers)


TWO_RANKS = {"tp2": ("qwen3_moe", ("--tensor-parallel-size", "2")),
             "ep2": ("mixtral", ("--tensor-parallel-size", "2", "--enable-expert-parallel"))}


@pytest.mark.parametrize("case", sorted(TWO_RANKS))
def test_moe_workers_with_two_ranks_equal_transformers(case, tmp_path, tokenizer_dir):
    family, flags = TWO_RANKS[case]
    path = tiny_moe(family, tmp_path, tokenizer_dir)
    started = start_family_cluster(path, flags, flags)
    try:
        workers, router = started[:2], started[2]
        expected = run_prompts(path, workers, router)
        assert_expert_counts(path, workers, expected)  # with EP too: all 8 experts, from rank 0
        assert_no_leaks(workers)
    finally:
        stop_all(started)
