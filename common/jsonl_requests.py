"""Read the JSONL request format of `pdserve generate` and write its results.

One JSON object per line with exactly one of "prompt", "token_ids" or
"messages", an optional "id", and optional sampling fields. A bad line is
reported with its line number and field.
"""
from __future__ import annotations

import json
from dataclasses import dataclass

from engine.sampling_params import InvalidParameter, SamplingParams
from engine.structured_output.spec import StructuredOutput

INPUT_FIELDS = ("prompt", "token_ids", "messages")
SAMPLING_FIELDS = {
    "max_tokens": int, "min_tokens": int, "temperature": (int, float), "top_p": (int, float),
    "top_k": int, "seed": int, "stop": (str, list), "stop_token_ids": list, "ignore_eos": bool,
    "logprobs": int, "n": int, "repetition_penalty": (int, float), "presence_penalty": (int, float),
    "frequency_penalty": (int, float), "min_p": (int, float), "logit_bias": dict, "bad_words": list,
    "prompt_logprobs": int,
}
STRUCTURED_FIELDS = {"json_schema": (dict, bool, str), "json_object": bool, "regex": str, "grammar": str,
                     "choice": list}
"""At most one per line, as gRPC's structured_output oneof (json_schema as a JSON object or its text)."""


@dataclass
class LineRequest:
    line_no: int
    request_id: str
    prompt: str | None
    token_ids: list[int] | None
    messages: list[dict] | None
    params: SamplingParams


class LineError(ValueError):
    def __init__(self, line_no: int, field: str, message: str) -> None:
        super().__init__(f"line {line_no}: field {field!r}: {message}")
        self.line_no = line_no
        self.field = field


def parse_line(line_no: int, text: str) -> LineRequest:
    try:
        obj = json.loads(text)
    except json.JSONDecodeError as exc:
        raise LineError(line_no, "<json>", f"not valid JSON ({exc.msg})") from None
    if not isinstance(obj, dict):
        raise LineError(line_no, "<json>", "each line must be a JSON object")
    unknown = sorted(set(obj) - set(INPUT_FIELDS) - set(SAMPLING_FIELDS) - set(STRUCTURED_FIELDS) - {"id"})
    if unknown:
        raise LineError(line_no, unknown[0], "unknown field")
    given = [f for f in INPUT_FIELDS if f in obj]
    if len(given) != 1:
        raise LineError(line_no, "prompt", 'give exactly one of "prompt", "token_ids", "messages"')
    request_id = obj.get("id", str(line_no))
    if not isinstance(request_id, str) or not request_id:
        raise LineError(line_no, "id", "must be a non-empty string")
    prompt = obj.get("prompt")
    if prompt is not None and (not isinstance(prompt, str) or not prompt):
        raise LineError(line_no, "prompt", "must be a non-empty string")
    token_ids = obj.get("token_ids")
    if token_ids is not None and (not isinstance(token_ids, list) or not token_ids
                                  or not all(_is_int(t) for t in token_ids)):
        raise LineError(line_no, "token_ids", "must be a non-empty list of integers")
    messages = obj.get("messages")
    if messages is not None:
        _check_messages(line_no, messages)
    kwargs = {}
    for name, kind in (SAMPLING_FIELDS | STRUCTURED_FIELDS).items():
        if name not in obj:
            continue
        value = obj[name]
        ok = isinstance(value, kind) and not (kind is not bool and isinstance(value, bool))
        if not ok:
            raise LineError(line_no, name, f"has the wrong type ({type(value).__name__})")
        kwargs[name] = value
    try:
        kwargs["structured_output"] = _structured_output(kwargs)
        if "logit_bias" in kwargs:
            kwargs["logit_bias"] = _logit_bias(kwargs["logit_bias"])
        params = SamplingParams(**kwargs)
    except InvalidParameter as exc:
        raise LineError(line_no, exc.field, str(exc).split(": ", 1)[1]) from None
    return LineRequest(line_no, request_id, prompt, token_ids, messages, params)


def _structured_output(kwargs: dict) -> StructuredOutput | None:
    """Pop the structured-output fields of a line into one constraint (at most one may be given)."""
    given = [name for name in STRUCTURED_FIELDS if name in kwargs]
    if len(given) > 1:
        raise InvalidParameter(given[1], f"give at most one of {', '.join(STRUCTURED_FIELDS)}")
    if not given:
        return None
    name = given[0]
    value = kwargs.pop(name)
    if name == "json_object":
        return StructuredOutput.json_object() if value else None
    if name == "json_schema":
        return StructuredOutput.json_schema(value if isinstance(value, str) else json.dumps(value))
    return StructuredOutput.choice(value) if name == "choice" else StructuredOutput(name, value)


def _logit_bias(value: dict) -> dict[int, float]:
    """JSON object keys are strings: "123" -> token id 123."""
    try:
        return {int(k): v for k, v in value.items()}
    except ValueError:
        raise InvalidParameter("logit_bias", "keys must be token ids (integers)") from None


def read_requests(path: str) -> tuple[list[LineRequest], list[LineError]]:
    """Parse every non-blank line; return the good requests and the errors."""
    good, bad = [], []
    seen = set()
    with open(path, encoding="utf-8") as f:
        for line_no, text in enumerate(f, start=1):
            if not text.strip():
                continue
            try:
                request = parse_line(line_no, text)
                if request.request_id in seen:
                    raise LineError(line_no, "id", f"duplicate id {request.request_id!r}")
                seen.add(request.request_id)
                good.append(request)
            except LineError as exc:
                bad.append(exc)
    return good, bad


def result_line(request_id: str, index: int | None, token_ids: list[int], text: str,
                finish_reason: str, usage: dict, logprobs: list | None = None,
                prompt_logprobs: list | None = None) -> str:
    obj = {"id": request_id}
    if index is not None:
        obj["index"] = index
    obj.update(token_ids=token_ids, text=text, finish_reason=finish_reason, usage=usage)
    if logprobs is not None:
        obj["logprobs"] = logprobs
    if prompt_logprobs is not None:
        obj["prompt_logprobs"] = prompt_logprobs
    return json.dumps(obj, ensure_ascii=False)


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _check_messages(line_no: int, messages) -> None:
    if not isinstance(messages, list) or not messages:
        raise LineError(line_no, "messages", "must be a non-empty list")
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str) or not isinstance(m.get("content"), str):
            raise LineError(line_no, f"messages[{i}]", 'must be {"role": str, "content": str}')
