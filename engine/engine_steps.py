"""One engine step: schedule, launch the model, collect and sample (mixed into LLMEngine, engine/llm_engine.py).

A launched step waits in `_launched` until collected: at once on CPU; with `overlap` (CUDA) the next call
collects it while the GPU is free to run the next; with pipeline stages (`microbatches` > 1) several steps of
different requests are in flight, one per stage, and the oldest is collected once the pipeline is full. A
request in a launched step is not scheduled again before that step is collected (its next token is unknown).
"""
from __future__ import annotations

import torch

from engine import prompt_logprobs
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
        out = self.scheduler.schedule(self._in_flight, max_requests)
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
        logits = self.runner.execute(out, self.kv, whole, defer=self.microbatches > 1)
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
            family = [self._samples[request.request_id]]
            family += [self._fork(request, i) for i in range(1, request.pending_forks + 1)]
            request.pending_forks = 0
            for sample in family:  # forks' matchers are fresh, like the parent's: its bitmask row fits them
                rows.append(SampleRow(row, sample.request.params, sample.generator, suppress, sample.context,
                                      None if job is None else masks.first_row(job)))
                owners.append(sample)
            row += 1
        ids = {item.request.request_id for item in out.scheduled} | {s.request.request_id for s in owners}
        self._in_flight |= ids
        self._launched.append((logits, rows, owners, spec_rows, spec_owners, masks, prompt_rows, ids))
        return True

    def _collect(self) -> list[SampleState]:
        """Sample the launched step (waiting for the model) and accept each token; the samples that took one."""
        if not self._launched:
            return []
        logits, rows, owners, spec_rows, spec_owners, masks, prompt_rows, ids = self._launched.popleft()
        self._in_flight -= ids
        logits = self.runner.collect(logits)
        for sample, first_row, num_rows, start, done in prompt_rows:
            prompt_logprobs.record(sample, logits[first_row:first_row + num_rows], start, done)
        bitmask = masks.wait() if masks is not None else None
        tokens = self.sampler.sample(logits, rows, bitmask)
        accepted = []
        for sample, token in zip(owners, tokens, strict=True):
            if not sample.request.is_finished:  # not aborted while the step ran
                self._accept(sample, token)
                accepted.append(sample)
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

