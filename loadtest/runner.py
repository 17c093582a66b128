"""One load-test run: warm-up, then requests at their arrival times, then the summary."""
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
from loadtest.stats import RequestRecord, phase_summaries, summarize


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
            "num_warmups": config.num_warmups, "duration_limit_s": config.duration_s, "seed": config.seed}


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
    return RunResult(summary, records)


async def _measure(config: LoadTestConfig, stub, prompts: list[Prompt]) -> tuple[list[RequestRecord], float]:
    if config.rate_schedule:
        offsets = schedule_offsets(config.rate_schedule, config.burstiness, config.seed)[:len(prompts)]
    else:
        offsets = arrival_offsets(len(prompts), config.request_rate, config.burstiness, config.seed)
    slots = asyncio.Semaphore(config.max_concurrency) if config.max_concurrency else None
    bar = _progress_bar(len(prompts), config.progress)
    run_id = f"lt{time.time_ns():x}"
    start = time.perf_counter()

    async def one(i: int, prompt: Prompt, scheduled: float) -> RequestRecord:
        request = make_request(f"{run_id}-{i}", prompt)
        if slots is None:
            record = await send(stub, i, request, prompt.prompt_len, config.request_timeout_s)
        else:
            async with slots:
                record = await send(stub, i, request, prompt.prompt_len, config.request_timeout_s)
        record.scheduled_time = scheduled
        record.offset_s = scheduled - start
        bar.update(1)
        return record

    tasks = []
    for i, (prompt, offset) in enumerate(zip(prompts, offsets, strict=True)):
        if config.duration_s is not None and offset >= config.duration_s:
            break  # the time bound: no new request after it
        delay = start + offset - time.perf_counter()
        if delay > 0:
            await asyncio.sleep(delay)
        tasks.append(asyncio.create_task(one(i, prompt, start + offset)))
    records = list(await asyncio.gather(*tasks))
    duration = time.perf_counter() - start
    bar.close()
    return records, duration


def _progress_bar(total: int, enabled: bool):
    from tqdm import tqdm
    return tqdm(total=total, disable=not enabled, desc="requests", unit="req", leave=False)
