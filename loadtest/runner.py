"""One load-test run: warm-up, then requests at their arrival times, then the summary.

A trace replay's later turn of a session is sent only once the previous turn has ended.
"""
from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass

from common.client_channel import api_key, client_channel
from common.protocol import generate_pb2_grpc
from loadtest.arrivals import arrival_offsets, schedule_offsets
from loadtest.client import make_request, send
from loadtest.config import LoadTestConfig
from loadtest.datasets import Prompt, load_prompts
from loadtest.prefix import ideal_prefix_hit_ratio
from loadtest.stats import RequestRecord, per_turn, phase_summaries, summarize
from loadtest.trace import trace_offsets


@dataclass
class RunResult:
    summary: dict
    records: list[RequestRecord]


def settings(config: LoadTestConfig) -> dict:
    """The run's settings, as they go into the JSON (vLLM names where they exist)."""
    d = config.dataset
    return {"url": config.url, "dataset_name": d.name, "dataset_path": d.path, "num_prompts": config.num_prompts,
            "request_rate": config.request_rate, "rate_schedule": [list(p) for p in config.rate_schedule],
            "burstiness": config.burstiness, "max_concurrency": config.max_concurrency,
            "num_warmups": config.num_warmups, "duration_limit_s": config.duration_s, "seed": config.seed,
            **(_trace_settings(config) if d.is_trace else {})}


def _trace_settings(config: LoadTestConfig) -> dict:
    d = config.dataset
    chosen = ({"sessions": d.trace_sessions, "min_turns": d.trace_min_turns} if d.trace_sessions
              else {"first_requests": config.num_prompts})
    return {"trace_slice": chosen, "trace_schedule": config.trace_schedule, "trace_time_scale": config.trace_time_scale,
            "trace_block_tokens": d.trace_block_tokens, "trace_source_block_tokens": d.trace_source_block_tokens,
            "trace_output_scale": d.trace_output_scale, "trace_max_output_len": d.trace_max_output_len}


def trace_summary(prompts: list[Prompt], records: list[RequestRecord]) -> dict:
    """What a trace replay adds: the slice's size, the ideal prefix hit ratio of the prompts sent, per-turn figures."""
    sent = [prompts[r.index] for r in sorted(records, key=lambda r: r.index)]
    return {"num_prompts": len(prompts), "num_sessions": len({p.session_id for p in prompts}),
            "ideal_prefix_hit_ratio": ideal_prefix_hit_ratio(p.token_ids or [] for p in sent),
            "per_turn": per_turn(records)}


def run(config: LoadTestConfig, prompts: list[Prompt] | None = None) -> RunResult:
    prompts = prompts or load_prompts(config.dataset, config.num_prompts + config.num_warmups, config.seed)
    return asyncio.run(run_async(config, prompts))


async def run_async(config: LoadTestConfig, prompts: list[Prompt]) -> RunResult:
    warmups, measured = prompts[:config.num_warmups], prompts[config.num_warmups:]
    async with client_channel(config.url, config.tls_ca_file, api_key(config.api_key_file)) as channel:
        stub = generate_pb2_grpc.GenerationStub(channel)
        if warmups:
            await asyncio.gather(*(send(stub, -1 - i, make_request(f"warmup-{i}", p), p.prompt_len,
                                        config.request_timeout_s) for i, p in enumerate(warmups)))
        records, duration = await _measure(config, stub, measured)
    summary = settings(config)
    summary.update(summarize(records, duration, config.slos))
    if config.rate_schedule:
        summary["phases"] = phase_summaries(records, config.rate_schedule, config.slos)
    if config.dataset.is_trace:
        summary.update(trace_summary(measured, records))
    return RunResult(summary, records)


def send_offsets(config: LoadTestConfig, prompts: list[Prompt]) -> list[float]:
    """When each prompt is due, in seconds after the start (a trace in order mode: all at once, slots decide)."""
    if config.dataset.is_trace:
        if config.trace_schedule == "fixed":
            return trace_offsets(prompts, config.trace_time_scale)
        return [0.0] * len(prompts)
    if config.rate_schedule:
        return schedule_offsets(config.rate_schedule, config.burstiness, config.seed)[:len(prompts)]
    return arrival_offsets(len(prompts), config.request_rate, config.burstiness, config.seed)


async def _measure(config: LoadTestConfig, stub, prompts: list[Prompt]) -> tuple[list[RequestRecord], float]:
    offsets = send_offsets(config, prompts)
    ordered = config.trace_schedule == "order"
    slots = asyncio.Semaphore(config.max_concurrency) if config.max_concurrency else None
    bar = _progress_bar(len(prompts), config.progress)
    run_id = f"lt{time.time_ns():x}"
    start = time.perf_counter()
    last_turn: dict[str, asyncio.Event] = {}  # session -> set when its latest turn so far has ended

    def past_time_bound() -> bool:
        return config.duration_s is not None and time.perf_counter() - start >= config.duration_s

    async def one(i: int, prompt: Prompt, scheduled: float, after: asyncio.Event | None,
                  done: asyncio.Event | None) -> RequestRecord | None:
        try:
            if after is not None:
                await after.wait()  # a chat's next turn waits for the answer to the previous one
            request = make_request(f"{run_id}-{i}", prompt)
            if slots is None:
                record = await send(stub, i, request, prompt.prompt_len, config.request_timeout_s)
            else:
                async with slots:
                    if ordered and past_time_bound():
                        return None  # order mode's time bound: no new request after it
                    record = await send(stub, i, request, prompt.prompt_len, config.request_timeout_s)
        finally:
            if done is not None:
                done.set()
        record.scheduled_time = scheduled
        record.offset_s = scheduled - start
        record.session_id, record.turn = prompt.session_id, prompt.turn
        bar.update(1)
        return record

    tasks = []
    for i, (prompt, offset) in enumerate(zip(prompts, offsets, strict=True)):
        if config.duration_s is not None and offset >= config.duration_s:
            break  # the time bound: no new request after it
        delay = start + offset - time.perf_counter()
        if delay > 0:
            await asyncio.sleep(delay)
        after = done = None
        if prompt.session_id is not None:
            after = last_turn.get(prompt.session_id)
            done = last_turn[prompt.session_id] = asyncio.Event()
        tasks.append(asyncio.create_task(one(i, prompt, start + offset, after, done)))
    records = [r for r in await asyncio.gather(*tasks) if r is not None]
    duration = time.perf_counter() - start
    bar.close()
    return records, duration


def _progress_bar(total: int, enabled: bool):
    from tqdm import tqdm
    return tqdm(total=total, disable=not enabled, desc="requests", unit="req", leave=False)
