"""Host time of one engine decode step, the model stubbed out: what the GPU waits on when the host is slower.

A tiny random Llama checkpoint is built (any size works: the model never runs); the runner's `execute` is
replaced by the varlen input build (as on CUDA) plus small fake logits, so the time per `engine.step()` is the
engine's own Python: scheduling, input building, sampling bookkeeping, stop checks, detokenization, reports.
--batch requests decode at --context tokens of context. Side by side in one run: this checkout with async
scheduling on and off, and with --baseline-rev REV the same measurement on that git revision (a worktree).

  python3 bench/host_step_overhead.py --baseline-rev 36da7f4
"""
from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
VOCAB_USED = 1000


def build_model(path: Path, tokenizer_dir: Path) -> None:
    from transformers import LlamaConfig, LlamaForCausalLM
    if (path / "config.json").exists():
        return
    config = LlamaConfig(vocab_size=49152, hidden_size=64, intermediate_size=128, num_hidden_layers=1,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=4096)
    LlamaForCausalLM(config).save_pretrained(path)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(tokenizer_dir / name, path / name)


def measure(model: str, batch: int, context: int, steps: int, overlap: bool) -> dict:
    """ms per decode step (best of 3 rounds of `steps`), run in this process's checkout (sys.path[0])."""
    import torch

    from engine.config import CacheConfig, EngineConfig, SchedulerConfig
    from engine.llm_engine import LLMEngine
    from engine.sampling_params import SamplingParams
    from engine.varlen_inputs import VarlenInputBuilder
    max_tokens = 3 * steps + 20
    engine = LLMEngine(EngineConfig(model=model, dtype="float32", device="cpu", overlap_steps=overlap,
                                    scheduler=SchedulerConfig(max_num_batched_tokens=8192, max_num_seqs=256),
                                    cache=CacheConfig(num_blocks=batch * ((context + max_tokens) // 16 + 2) + 8)))
    builder = VarlenInputBuilder(16, torch.device("cpu"))

    def execute(out, kv, *args, **kwargs):
        builder.build(out, kv)
        logits = torch.zeros(sum(item.num_logits for item in out.scheduled), VOCAB_USED)
        logits[:, 7 + engine.num_steps % (VOCAB_USED - 8)] = 1.0
        return logits

    engine.runner.execute = execute
    rng = random.Random(0)
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    for i in range(batch):
        engine.add_request(str(i), [rng.randrange(3, 40000) for _ in range(context)], params)
    while engine.scheduler.waiting or any(r.num_computed_tokens < r.num_prompt_tokens
                                          for r in engine.scheduler.running):
        engine.step()
    rounds = []
    for _ in range(3):
        start = time.perf_counter()
        for _ in range(steps):
            engine.step()
        rounds.append((time.perf_counter() - start) / steps * 1e3)
    return {"ms_per_step": min(rounds), "rounds_ms": rounds,
            "async": bool(getattr(engine, "async_scheduling", False)), "overlap": engine.overlap}


def run_in(checkout: Path, model: Path, args, overlap: bool) -> dict:
    """`measure` in a fresh interpreter importing `checkout`'s engine."""
    code = (f"import json, sys; sys.path.insert(0, {str(checkout)!r}); sys.path.insert(0, {str(ROOT / 'bench')!r}); "
            f"from host_step_overhead import measure; print(json.dumps(measure({str(model)!r}, {args.batch}, "
            f"{args.context}, {args.steps}, {overlap})))")
    env = {**os.environ, "PYTHONPATH": str(checkout)}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, cwd=checkout,
                         timeout=1800)
    if out.returncode:
        raise RuntimeError(f"{checkout}: {out.stderr[-2000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batch", type=int, default=128)
    ap.add_argument("--context", type=int, default=512)
    ap.add_argument("--steps", type=int, default=100)
    ap.add_argument("--baseline-rev", default=None, help="a git revision to measure beside this checkout")
    ap.add_argument("--tokenizer-dir", default=None)
    ap.add_argument("--output", default=str(ROOT / "bench" / "results" / "host_step_overhead.json"))
    args = ap.parse_args()
    sys.path.insert(0, str(ROOT))
    from engine.model_files import ensure_default_model
    workdir = Path(tempfile.mkdtemp(prefix="pdserve-host-step-"))
    model = workdir / "tiny-llama"
    build_model(model, Path(args.tokenizer_dir) if args.tokenizer_dir else ensure_default_model())
    rows = {}
    try:
        if args.baseline_rev:
            base = workdir / "baseline"
            subprocess.run(["git", "-C", str(ROOT), "worktree", "add", "--detach", str(base), args.baseline_rev],
                           check=True, capture_output=True)
            rows[f"{args.baseline_rev} (overlap)"] = run_in(base, model, args, True)
        rows["this checkout, sync"] = run_in(ROOT, model, args, False)
        rows["this checkout, async"] = run_in(ROOT, model, args, True)
    finally:
        if args.baseline_rev:
            subprocess.run(["git", "-C", str(ROOT), "worktree", "remove", "--force", str(workdir / "baseline")],
                           capture_output=True)
        shutil.rmtree(workdir, ignore_errors=True)
    print(f"host time per decode step, batch {args.batch} x context {args.context}, model stubbed "
          f"(best of 3 x {args.steps} steps):")
    print(f"{'engine':<28} {'ms/step':>8}")
    for name, r in rows.items():
        print(f"{name:<28} {r['ms_per_step']:>8.3f}")
    Path(args.output).parent.mkdir(parents=True, exist_ok=True)
    Path(args.output).write_text(json.dumps({"config": vars(args), "results": rows}, indent=2))
    print(f"wrote {args.output}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
