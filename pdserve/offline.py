"""`pdserve generate --offline`: run a JSONL file through one in-process engine."""
from __future__ import annotations

import sys

from engine.config import CacheConfig, EngineConfig, SchedulerConfig
from engine.llm_engine import LLMEngine
from engine.sampling_params import InvalidParameter
from pdserve.jsonl_requests import LineError, LineRequest, read_requests, result_line


def prompt_token_ids(engine: LLMEngine, request: LineRequest) -> list[int]:
    if request.token_ids is not None:
        return request.token_ids
    if request.messages is not None:
        return engine.tokenizer.apply_chat_template(request.messages)
    return engine.tokenizer.encode(request.prompt)


def run_offline(args) -> int:
    requests, errors = read_requests(args.input)
    config = EngineConfig(
        model=args.model, dtype=args.dtype, device=args.device, max_model_len=args.max_model_len,
        scheduler=SchedulerConfig(max_num_batched_tokens=args.max_num_batched_tokens,
                                  max_num_seqs=args.max_num_seqs),
        cache=CacheConfig(block_size=args.block_size,
                          kv_cache_memory_bytes=int(args.kv_cache_memory_gib * 2**30),
                          enable_prefix_caching=not args.no_prefix_caching))
    engine = LLMEngine(config)
    accepted: list[LineRequest] = []
    for request in requests:
        try:
            engine.add_request(request.request_id, prompt_token_ids(engine, request), request.params)
            accepted.append(request)
        except (InvalidParameter, ValueError) as exc:
            field = getattr(exc, "field", "input")
            errors.append(LineError(request.line_no, field, str(exc).split(": ", 1)[-1]))
    finished = {}
    texts: dict[tuple[str, int], list] = {}
    while engine.has_unfinished():
        for d in engine.step():
            entry = texts.setdefault((d.request_id, d.index), [[], "", [], None, 0])
            entry[0].extend(d.token_ids)
            entry[1] += d.text
            entry[2].extend(d.logprobs)
            if d.finished:
                entry[3], entry[4] = d.finish_reason, d.num_cached_tokens
                finished[(d.request_id, d.index)] = True
    with open(args.output, "w", encoding="utf-8") as out:
        for request in accepted:
            n = request.params.n
            prompt_len = len(prompt_token_ids(engine, request))
            for index in range(n):
                token_ids, text, logprobs, reason, cached = texts[(request.request_id, index)]
                usage = {"prompt_tokens": prompt_len, "completion_tokens": len(token_ids), "cached_tokens": cached}
                out.write(result_line(request.request_id, index if n > 1 else None, token_ids, text, reason,
                                      usage, logprobs if request.params.logprobs is not None else None) + "\n")
    for error in sorted(errors, key=lambda e: e.line_no):
        print(f"error: {error}", file=sys.stderr)
    return 1 if errors else 0
