"""One engine step: schedule, launch the model, collect and sample (mixed into LLMEngine, engine/llm_engine.py).

A launched step waits in `_launched` until collected: at once on CPU; with `overlap` (CUDA) the next call
collects it; with pipeline stages (`microbatches` > 1) several steps of different requests are in flight, one
per stage, and the oldest is collected once the pipeline is full. A request in a launched step is not scheduled
again before that step is collected (its next token is unknown), except under async scheduling.

Async scheduling (`overlap` on one device, vLLM's async scheduler): step N's tokens are drawn on the device as
soon as it is launched, copied to pinned memory behind an event. The next call schedules step N+1 and launches
it before reading them: a request of step N that may go on (`_may_continue`: no grammar, penalties, forks or
proposals, not at its last token) decodes its pending token, its input id copied on the device from step N's
draw. Only then does the host wait, for step N's event alone, and accept, stop-check and detokenize step N
while the device computes step N+1. A request that stopped at step N had one more token computed in step N+1;
it is dropped when collected (its blocks were freed: later steps reuse them only after it, on the same stream).
"""
from __future__ import annotations

import torch

from engine import prompt_logprobs
from engine.model_runner import PendingInputs
from engine.outputs import SampleDelta
from engine.sample_state import SampleState, whole_logit_rows
from engine.sampler import SampledToken, SampleRow, SpecRow
from engine.spec_decode.scheduling import propose


class EngineSteps:
    """Mixed into LLMEngine (which provides the scheduler, runner, sampler, samples and stop rules)."""

    def step(self) -> list[SampleDelta]:
        """Run one engine step; return what each touched sample gained.

        With `overlap` (CUDA), the model's work is asynchronous: a call first
        collects the step the previous call launched (its sampled tokens), then
        launches the next step, and detokenizes and reports the collected tokens
        while the GPU computes. Without it (CPU) a call launches, collects and
        reports one step. A pipeline (`microbatches` > 1) launches a step on requests not in
        flight, and collects the oldest once `microbatches` are in flight: each stage works on
        another step.
        """
        grammar = any(s.grammar is not None for s in self._samples.values())
        if self.microbatches > 1 and self.proposer is None and not grammar:
            requests = len(self.scheduler.running) + len(self.scheduler.waiting)
            launched = self._launch(max(1, -(-requests // self.microbatches)))  # 1/M of them each
            owners = self._collect() if len(self._launched) >= self.microbatches or not launched else []
        elif self.async_scheduling and not grammar:
            launched = self._launch()  # step N+1, before step N's tokens are read
            owners = self._collect() if len(self._launched) > 1 or not launched else []
        elif self.overlap and not grammar:
            owners = self._collect()
            self._launch()
        else:  # a grammar's mask needs the previous step's token: no overlap while a sample has one
            owners = self._collect()  # a step launched in overlap mode before such a sample came
            self._launch()
            seen = {id(s) for s in owners}
            owners += [s for s in self._collect() if id(s) not in seen]
        owners, self._collected_early = self._collected_early + owners, []
        return [self._delta(s.make_text()) for s in owners] + self._drain_ended()

    def finish_launched_step(self) -> list[SampleDelta]:
        """Collect and report the launched steps (overlap mode, a pipeline) without launching another."""
        while self._launched:
            self._collected_early += self._collect()
        owners, self._collected_early = self._collected_early, []
        return [self._delta(s.make_text()) for s in owners] + self._drain_ended()

    def _launch(self, max_requests: int | None = None) -> bool:
        """Schedule a step (at most `max_requests` requests, none in flight) and start the model on it (on CUDA
        or with pipeline stages this returns before the logits are there). False: nothing to run."""
        if self.proposer is not None:
            propose(self.proposer, self.scheduler.running, self.config.speculative.num_speculative_tokens,
                    self.max_model_len)
        continuing = self._continuing()
        out = self.scheduler.schedule(self._in_flight, max_requests, continuing)
        if not out.scheduled:
            return False
        # before finish_step advances them: (item, samples, rows of logits, first position)
        plan = [(item, item.samples, item.num_logits, item.request.num_computed_tokens) for item in out.scheduled]
        sampling = [item for item, samples, _, _ in plan if samples]
        jobs, job_of = [], {}
        for item in sampling:
            grammar = self._samples[item.request.request_id].grammar
            if grammar is not None:
                job_of[item.request.request_id] = len(jobs)
                jobs.append((grammar, item.spec_token_ids))
        masks = self.step_masks.start(jobs)  # filled while the model runs
        whole = whole_logit_rows(plan, self._samples, self._suppressed) if self.runner.stage is not None else None
        pending = self._pending_inputs(out, continuing) if continuing else None
        self.num_continued_tokens += len(pending.positions) if pending is not None else 0
        logits = self.runner.execute(out, self.kv, whole, defer=self.microbatches > 1, pending=pending)
        self.scheduler.finish_step(out)
        self.num_steps += 1
        rows, owners, spec_rows, spec_owners, prompt_rows = [], [], [], [], []
        row = 0
        for item, samples, num_logits, start in plan:
            request = item.request
            num_prompt_rows = num_logits - (1 + len(item.spec_token_ids) if samples else 0)
            if num_prompt_rows:  # prompt logprobs: these rows come first, the sampling row last
                prompt_rows.append((self._samples[request.request_id], row, num_prompt_rows, start, samples))
                row += num_prompt_rows
            if not samples:
                continue
            job = job_of.get(request.request_id)
            if item.spec_token_ids:
                sample = self._samples[request.request_id]
                spec_rows.append(SpecRow(row, request.params, sample.generator, item.spec_token_ids))
                spec_owners.append(sample)
                if job is not None:
                    masks.attach(job, spec_rows[-1])
                row += 1 + len(item.spec_token_ids)
                continue
            suppress = self._suppressed(request)
            if job is None and not request.pending_forks:  # the common case: one sample, unconstrained
                sample = self._samples[request.request_id]
                rows.append(SampleRow(row, request.params, sample.generator, suppress, sample.context))
                owners.append(sample)
                row += 1
                continue
            family = [self._samples[request.request_id]]
            family += [self._fork(request, i) for i in range(1, request.pending_forks + 1)]
            request.pending_forks = 0
            for sample in family:  # forks' matchers are fresh, like the parent's: its bitmask row fits them
                rows.append(SampleRow(row, sample.request.params, sample.generator, suppress, sample.context,
                                      None if job is None else masks.first_row(job)))
                owners.append(sample)
            row += 1
        for sample in owners:
            sample.request.num_pending_tokens += 1
        draw = None
        if self.async_scheduling and masks is None:
            draw = self.sampler.draw(logits, rows)  # queued now: step N+1 reads these tokens on the device
            if prompt_rows:  # a graph's logits buffer is overwritten by the next replay
                logits = logits.clone()
        self._last_draw = (draw, {s.request.request_id: i for i, s in enumerate(owners)}) if draw else None
        ids = {item.request.request_id for item in out.scheduled} | {s.request.request_id for s in owners}
        self._in_flight.update(ids)
        self._launched.append((logits, rows, owners, spec_rows, spec_owners, masks, prompt_rows, ids, draw))
        return True

    def _continuing(self) -> set[str]:
        """Async scheduling: the requests of the newest launched step (still in flight) that may decode their
        pending token in the next step."""
        if self._last_draw is None:
            return set()
        return {rid for rid in self._last_draw[1] if rid in self._in_flight and self._may_continue(rid)}

    def _may_continue(self, request_id: str) -> bool:
        """Whether a request's next step may be computed before its pending token is known: nothing about that
        step depends on the token (no grammar, penalties, bias, forks, min_tokens still suppressing stop ids)
        and the token cannot be its last by length."""
        sample = self._samples.get(request_id)
        if sample is None or sample.grammar is not None or sample.context is not None:
            return False
        request, params = sample.request, sample.request.params
        return (not request.is_finished and not request.prefill_only and not request.pending_forks
                and request.num_pending_tokens == 1 and request.num_output_tokens >= params.min_tokens
                and request.num_output_tokens + 1 < params.max_tokens and request.num_tokens + 1 < self.max_model_len)

    def _pending_inputs(self, out, continuing: set[str]) -> PendingInputs | None:
        """Where in the step's packed input ids the continuing requests' pending tokens go, and from which row
        of the step before's draw (a continuing request is scheduled for its pending token alone)."""
        draw, row_of = self._last_draw
        positions, rows, t = [], [], 0
        for item in out.scheduled:
            rid = item.request.request_id
            if rid in continuing:
                positions.append(t)
                rows.append(row_of[rid])
            t += item.num_new_tokens
        return PendingInputs(positions, draw.token_ids, rows) if positions else None

    def _collect(self) -> list[SampleState]:
        """Sample the launched step (waiting for the model) and accept each token; the samples that took one."""
        if not self._launched:
            return []
        logits, rows, owners, spec_rows, spec_owners, masks, prompt_rows, ids, draw = self._launched.popleft()
        self._in_flight.subtract(ids)
        for rid in ids:
            if not self._in_flight[rid]:
                del self._in_flight[rid]
        logits = self.runner.collect(logits)
        for sample, first_row, num_rows, start, done in prompt_rows:
            prompt_logprobs.record(sample, logits[first_row:first_row + num_rows], start, done)
        bitmask = masks.wait() if masks is not None else None
        # a draw made at launch waits for this step's sampling alone (async scheduling)
        tokens = draw.results() if draw is not None else self.sampler.sample(logits, rows, bitmask)
        accepted = []
        for sample, token in zip(owners, tokens, strict=True):
            sample.request.num_pending_tokens -= 1
            if not sample.request.is_finished:  # not aborted (nor stopped, under async scheduling) meanwhile
                self._accept(sample, token)
                accepted.append(sample)
                request = sample.request
                if self.async_scheduling and not request.is_finished and request.num_tokens % self.kv.block_size == 0:
                    self.scheduler.cache_known_blocks(request)  # the token completed a block already computed
        if spec_rows:
            verified = self.sampler.verify(logits, spec_rows, bitmask)
            for sample, spec_row, emitted in zip(spec_owners, spec_rows, verified, strict=True):
                if sample.request.is_finished:
                    continue
                self.num_spec_draft_tokens += len(spec_row.draft_token_ids)
                self.num_spec_accepted_tokens += len(emitted) - 1
                num_taken = 0
                for token_id in emitted:  # one by one through the stop rules
                    self._accept(sample, SampledToken(token_id))
                    num_taken += 1
                    if sample.request.is_finished:
                        break
                self.scheduler.accept_spec(sample.request, num_taken - 1)
                accepted.append(sample)
        return accepted

    def _wait_for_launched_step(self) -> None:
        """Block until the launched step's GPU work is done (before blocks it may still write are reused)."""
        while self.microbatches > 1 and self._launched:  # the stages still write these steps' KV
            self._collected_early += self._collect()
        if self._launched and self.runner.device.type == "cuda":
            torch.cuda.synchronize(self.runner.device)

