"""Mooncake (FAST'25) trace replay: read a `mooncake_trace` JSONL file, find its sessions, build prompts.

Format: one JSON object per line with `timestamp` (ms since the trace's start, non-decreasing),
`input_length`, `output_length` (tokens) and `hash_ids` (one id per block of the trace's block size,
512 tokens in Mooncake's traces; equal ids at equal positions are a shared prefix), and optionally
`session_id` (AIPerf), the conversation the request belongs to.

Token ids: each hash id stands for `trace_block_tokens` (N) ids drawn from [100, vocab_size) by a
generator seeded with (seed, hash id), so an id gives the same tokens in every request and run. A
prompt is its hash ids' tokens, cut or padded (with tokens unique to the request, seeded with
(seed, line)) to max(1, round(input_length * N / trace_source_block_tokens)): the trace scaled by
N/512, its prefix sharing kept. Output length: max(1, round(output_length * scale)), scale
`trace_output_scale` (default N/512), capped at `trace_max_output_len`.

Sessions without `session_id`: a request whose hash ids start with the complete-block ids of an
earlier request (its first input_length // 512 ids; the last, partial block's id changes as a
conversation grows) continues that request's session, the longest such earlier request winning.
At least 2 ids must match: nearly every request of Mooncake's conversation trace starts with id 0,
a shared system prompt, which is no conversation.
"""
from __future__ import annotations

import json
import random
from collections import Counter
from dataclasses import dataclass, replace

from loadtest.config import DatasetConfig
from loadtest.datasets import MIN_TOKEN_ID, Prompt

FIELDS = ("timestamp", "input_length", "output_length", "hash_ids")
MIN_SHARED_IDS = 2
"""Leading hash ids a continuation must share with the earlier turn (one shared id is a system prompt)."""


@dataclass(frozen=True)
class TraceRequest:
    line: int
    """1-based line number in the file."""
    timestamp_ms: float
    input_length: int
    output_length: int
    hash_ids: tuple[int, ...]
    session_id: str | None = None
    turn: int = 0
    """How many requests of the same session came before this one."""


def _is_int(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def parse_line(text: str, line: int, path: str = "trace") -> TraceRequest:
    """One JSONL line; ValueError naming `path:line` and what is wrong."""
    where = f"{path}:{line}"
    try:
        obj = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ValueError(f"{where}: not valid JSON ({exc.msg})") from None
    if not isinstance(obj, dict):
        raise ValueError(f"{where}: expected a JSON object, got {type(obj).__name__}")
    missing = [f for f in FIELDS if f not in obj]
    if missing:
        raise ValueError(f"{where}: missing field(s) {', '.join(missing)} (a mooncake trace line has "
                         f"{', '.join(FIELDS)})")
    ts = obj["timestamp"]
    if not isinstance(ts, int | float) or isinstance(ts, bool) or ts < 0:
        raise ValueError(f"{where}: timestamp must be a number of ms >= 0, got {ts!r}")
    for name in ("input_length", "output_length"):
        if not _is_int(obj[name]) or obj[name] < 0:
            raise ValueError(f"{where}: {name} must be an integer >= 0, got {obj[name]!r}")
    ids = obj["hash_ids"]
    if not isinstance(ids, list) or not all(_is_int(h) for h in ids):
        raise ValueError(f"{where}: hash_ids must be a list of integers")
    session = obj.get("session_id")
    if session is not None and not isinstance(session, str | int):
        raise ValueError(f"{where}: session_id must be a string, got {session!r}")
    return TraceRequest(line, float(ts), obj["input_length"], obj["output_length"], tuple(ids),
                        None if session is None else str(session))


def read_trace(path: str) -> list[TraceRequest]:
    """Every request of the file in order (blank lines skipped); ValueError on a bad or empty file."""
    requests: list[TraceRequest] = []
    with open(path, encoding="utf-8") as f:
        for n, text in enumerate(f, start=1):
            if not text.strip():
                continue
            req = parse_line(text, n, path)
            if requests and req.timestamp_ms < requests[-1].timestamp_ms:
                raise ValueError(f"{path}:{n}: timestamps must not decrease ({req.timestamp_ms:g} ms after "
                                 f"{requests[-1].timestamp_ms:g} ms on line {requests[-1].line})")
            requests.append(req)
    if not requests:
        raise ValueError(f"{path}: empty trace (no request lines)")
    explicit = [r.session_id is not None for r in requests]
    if any(explicit) and not all(explicit):
        bad = requests[explicit.index(False)]
        raise ValueError(f"{path}:{bad.line}: no session_id, while other lines have one (give it on every line "
                         "or on none)")
    return requests


def infer_sessions(requests: list[TraceRequest], source_block_tokens: int = 512) -> list[str]:
    """A session id per request (see the module docstring): "line-N", N the line of its first turn."""
    root: dict = {}
    end = "end"  # trie key marking where an earlier request's complete blocks end (ids are ints)
    sessions: list[str] = []
    for i, req in enumerate(requests):
        node, parent = root, None
        for depth, h in enumerate(req.hash_ids, start=1):
            node = node.get(h)
            if node is None:
                break
            if depth >= MIN_SHARED_IDS and end in node:
                parent = node[end]
        sessions.append(sessions[parent] if parent is not None else f"line-{req.line}")
        complete = req.hash_ids[:req.input_length // source_block_tokens]
        if len(complete) >= MIN_SHARED_IDS:
            node = root
            for h in complete:
                node = node.setdefault(h, {})
            node[end] = i  # the latest request with these blocks
    return sessions


def with_sessions(requests: list[TraceRequest], source_block_tokens: int = 512) -> list[TraceRequest]:
    """The requests with session ids (given ones kept, else inferred) and turn indices."""
    if requests and requests[0].session_id is not None:
        ids = [r.session_id for r in requests]
    else:
        ids = infer_sessions(requests, source_block_tokens)
    turns: Counter[str] = Counter()
    out = []
    for req, sid in zip(requests, ids, strict=True):
        out.append(replace(req, session_id=sid, turn=turns[sid]))
        turns[sid] += 1
    return out


def select(requests: list[TraceRequest], num_prompts: int, num_sessions: int | None = None,
           min_turns: int = 1) -> list[TraceRequest]:
    """The first `num_prompts` requests, or with `num_sessions` every turn of the first that many sessions of
    at least `min_turns` requests."""
    if num_sessions is None:
        return requests[:num_prompts]
    turns = Counter(r.session_id for r in requests)
    chosen: set[str | None] = set()
    for req in requests:
        if len(chosen) == num_sessions:
            break
        if turns[req.session_id] >= min_turns:
            chosen.add(req.session_id)
    return [r for r in requests if r.session_id in chosen]


def hash_block_tokens(hash_id: int, num_tokens: int, vocab_size: int, seed: int = 0) -> list[int]:
    """The token ids one hash id stands for: the same for the same (seed, hash id), in every process."""
    rng = random.Random(f"{seed}:{hash_id}")
    return [rng.randrange(MIN_TOKEN_ID, vocab_size) for _ in range(num_tokens)]


class TokenMapper:
    """Hash ids and trace lengths -> token ids and lengths (module docstring), block tokens cached."""

    def __init__(self, config: DatasetConfig, seed: int) -> None:
        self.config, self.seed = config, seed
        self.ratio = config.trace_block_tokens / config.trace_source_block_tokens
        self._blocks: dict[int, list[int]] = {}

    def prompt_len(self, input_length: int) -> int:
        return max(1, round(input_length * self.ratio))

    def output_len(self, output_length: int) -> int:
        scale = self.config.trace_output_scale if self.config.trace_output_scale is not None else self.ratio
        n = max(1, round(output_length * scale))
        cap = self.config.trace_max_output_len
        return n if cap is None else min(n, cap)

    def block(self, hash_id: int) -> list[int]:
        if hash_id not in self._blocks:
            self._blocks[hash_id] = hash_block_tokens(hash_id, self.config.trace_block_tokens,
                                                      self.config.vocab_size, self.seed)
        return self._blocks[hash_id]

    def token_ids(self, req: TraceRequest) -> list[int]:
        target = self.prompt_len(req.input_length)
        ids: list[int] = []
        for h in req.hash_ids:
            if len(ids) >= target:
                break
            ids += self.block(h)
        del ids[target:]
        if len(ids) < target:
            rng = random.Random(f"{self.seed}:pad:{req.line}")
            ids += [rng.randrange(MIN_TOKEN_ID, self.config.vocab_size) for _ in range(target - len(ids))]
        return ids

    def prompt(self, req: TraceRequest) -> Prompt:
        ids = self.token_ids(req)
        return Prompt(len(ids), self.output_len(req.output_length), token_ids=ids, session_id=req.session_id,
                      turn=req.turn, arrival_ms=req.timestamp_ms)


def trace_prompts(config: DatasetConfig, num_prompts: int, seed: int) -> list[Prompt]:
    """The selected slice of the trace as prompts, in trace order."""
    requests = with_sessions(read_trace(config.path), config.trace_source_block_tokens)
    mapper = TokenMapper(config, seed)
    return [mapper.prompt(r) for r in select(requests, num_prompts, config.trace_sessions, config.trace_min_turns)]


def trace_offsets(prompts: list[Prompt], time_scale: float = 1.0) -> list[float]:
    """Send times in seconds after the first prompt's timestamp, times `time_scale`."""
    if not prompts:
        return []
    t0 = prompts[0].arrival_ms or 0.0
    return [((p.arrival_ms or 0.0) - t0) / 1000.0 * time_scale for p in prompts]
