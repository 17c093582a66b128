"""`pdserve generate --offline`: run a JSONL file through one in-process engine."""
from __future__ import annotations

import sys

from common.jsonl_requests import LineError, LineRequest, read_requests, result_line
from engine.config import EngineConfig
from engine.llm_engine import LLMEngine
from engine.outputs import CompletionCollector
from engine.sampling_params import InvalidParameter


def prompt_token_ids(engine: LLMEngine, request: LineRequest) -> list[int]:
    if request.token_ids is not None:
        return request.token_ids
    if request.messages is not None:
        return engine.tokenizer.apply_chat_template(request.messages)
    return engine.tokenizer.encode(request.prompt)


def run_offline(args, config: EngineConfig) -> int:
    requests, errors = read_requests(args.input)
    engine = LLMEngine(config)
    try:
        return _run(engine, args, requests, errors)
    finally:
        engine.shutdown()  # the tensor-parallel ranks, if any


def _run(engine: LLMEngine, args, requests: list[LineRequest], errors: list[LineError]) -> int:
    accepted: list[tuple[LineRequest, list[int]]] = []
    for request in requests:
        try:
            prompt = prompt_token_ids(engine, request)
            engine.add_request(request.request_id, prompt, request.params)
            accepted.append((request, prompt))
        except (InvalidParameter, ValueError) as exc:
            field = getattr(exc, "field", "input")
            errors.append(LineError(request.line_no, field, str(exc).split(": ", 1)[-1]))
    collector = CompletionCollector()
    while engine.has_unfinished():
        for delta in engine.step():
            collector.add(delta)
    with open(args.output, "w", encoding="utf-8") as out:
        for request, prompt in accepted:
            n = request.params.n
            for c in collector.completions(request.request_id):
                usage = {"prompt_tokens": len(prompt), "completion_tokens": len(c.token_ids),
                         "cached_tokens": collector.cached_tokens.get(request.request_id, 0)}
                logprobs = (c.logprobs or []) if request.params.logprobs is not None else None
                out.write(result_line(request.request_id, c.index if n > 1 else None, c.token_ids, c.text,
                                      c.finish_reason, usage, logprobs, c.prompt_logprobs) + "\n")
    for error in sorted(errors, key=lambda e: e.line_no):
        print(f"error: {error}", file=sys.stderr)
    return 1 if errors else 0
