"""The engine loop: schedule -> run the model -> sample -> detokenize -> stop checks.

A request enters `waiting`, is admitted into `running` (reusing prefix-cached
blocks), computes its prompt in one or more chunks, then one token per step
until a stop condition; its blocks are freed when it finishes or is aborted.
With n > 1 the prompt is computed once; at the first token the request splits
into n samples sharing its blocks (copy-on-write on the shared partial block).

Disaggregated roles use the same engine. Prefill: `add_request(prefill_only=True)`
stops a request after its first token and keeps its blocks (the delta carries
their ids) until `release_kv`. Decode: `reserve_kv` allocates blocks for KV
computed elsewhere, then `add_request(first_token_id=...)` continues from there.

Speculative decoding (engine/spec_decode/): a step also computes each decoding request's
proposed tokens; accepted ones pass the same stop rules one by one, rejected KV is dropped.
"""
from __future__ import annotations

import logging
from collections import Counter, deque

import torch

from engine.config import EngineConfig
from engine.detokenizer import IncrementalDetokenizer
from engine.engine_steps import EngineSteps
from engine.input_checks import check_params, check_prompt, check_resume
from engine.kv_cache_manager import KVCacheManager
from engine.kv_views import KVViews
from engine.model.model_config import ModelConfig
from engine.model_files import resolve_model_path
from engine.outputs import RequestOutput, SampleDelta, generate_all
from engine.parallel.executor import build_runner
from engine.request import FinishReason, Request
from engine.sample_state import SampleState, grammar_verdict, sample_context, stop_reason
from engine.sampler import Sampler
from engine.sampling_params import InvalidParameter, SamplingParams
from engine.scheduler import Scheduler
from engine.spec_decode import Proposer
from engine.spec_decode.scheduling import make_proposer
from engine.structured_output.backend import GrammarBackend
from engine.structured_output.step_masks import StepMasks
from engine.tokenizer import Tokenizer

logger = logging.getLogger(__name__)
GRAMMAR_TIMEOUT_S = 30.0  # longest add_request waits for a compile (a worker compiles first, within its limit)


class LLMEngine(EngineSteps, KVViews):
    def __init__(self, config: EngineConfig) -> None:
        config = config.resolved()
        self.config = config
        self.model_path = resolve_model_path(config.model)
        self.model_config = ModelConfig.from_dir(self.model_path)
        self.tokenizer = Tokenizer(self.model_path)
        wanted_len = config.max_model_len or self.model_config.max_position_embeddings
        self.runner, self.executor = build_runner(config, self.model_path, self.model_config, wanted_len)
        """executor: with tensor parallelism, the other ranks' processes (this process is rank 0); else None."""
        # blocks behind the window are released only when every layer slides; a hybrid model keeps them all
        window = self.model_config.sliding_window if self.model_config.all_sliding else None
        self.kv = KVCacheManager(self.runner.num_blocks, config.cache.block_size,
                                 config.cache.enable_prefix_caching, sliding_window=window)
        capacity = self.kv.pool.num_usable_blocks * config.cache.block_size
        if wanted_len > capacity:
            logger.warning("max_model_len %d exceeds the KV cache (%d tokens); capping", wanted_len, capacity)
        self.max_model_len = min(wanted_len, capacity)
        self.scheduler = Scheduler(config.scheduler, self.kv)
        self.sampler = Sampler(config.seed, self.runner.device)
        self.grammars = GrammarBackend(self.tokenizer.hf_tokenizer, self.model_config.vocab_size)  # off the step
        self.step_masks = StepMasks(self.grammars)
        self.eos_token_ids = set(self.model_config.eos_token_ids)
        if self.tokenizer.eos_token_id is not None:
            self.eos_token_ids.add(self.tokenizer.eos_token_id)
        self._samples: dict[str, SampleState] = {}
        self._groups: dict[str, list[str]] = {}
        self._group_params: dict[str, SamplingParams] = {}
        self._reserved: dict[str, int] = {}
        """Decode role: request id -> locally cached prompt tokens, between reserve_kv and add_request."""
        self._prefix_pulls: dict[str, tuple[list[int], str]] = {}  # prefill: a peer pull's (tokens, salt)
        self._handed_off: set[str] = set()
        """Prefill role: requests stopped after their first token whose blocks are kept for a transfer."""
        self._ended_between_steps: list[SampleState] = []
        """Samples aborted (or finished on arrival) since the last step; reported by the next step."""
        self.num_steps = 0
        self.overlap = config.overlap_steps if config.overlap_steps is not None else self.runner.device.type == "cuda"
        self._launched: deque[tuple] = deque()
        """Launched steps not yet collected, oldest first: (logits, sample rows, owners, spec rows, spec owners,
        masks, prompt rows, request ids, the Draw made at launch or None)."""
        self._in_flight: Counter[str] = Counter()
        """Requests in launched steps (how many): not scheduled again before collected, unless continuing."""
        pp = config.pipeline_parallel_size
        self.microbatches = (config.pipeline_microbatches or pp) if pp > 1 else 1
        """Steps a pipeline keeps in flight (each stage works on another); 1: one at a time."""
        self._collected_early: list[SampleState] = []
        self.proposer: Proposer | None = make_proposer(self.config, self.model_config, self.max_model_len,
                                                         self.runner.num_blocks)
        self.async_scheduling = (config.async_scheduling and self.overlap and self.microbatches == 1
                                 and self.proposer is None and self.runner.peers is None and self.runner.stage is None)
        """Step N+1 launched before step N's tokens are read (engine/engine_steps.py); with proposals or other
        ranks, `overlap` collects step N first (the proposer needs its tokens; other ranks get inputs on the host)."""
        self._last_draw = None
        """Async scheduling: (the newest launched step's Draw, request id -> its row there), or None."""
        self.num_continued_tokens = 0
        """Async scheduling: tokens computed in a step launched before they were known (read on the device)."""
        self.num_spec_draft_tokens = 0
        """Speculative decoding: tokens proposed and verified so far."""
        self.num_spec_accepted_tokens = 0
        """Speculative decoding: proposed tokens the target accepted."""
        self._start_kv_tiers()

    def shutdown(self) -> None:
        """Stop the tensor-parallel ranks and the KV tiers' I/O. The engine cannot step afterwards."""
        self._stop_kv_tiers()
        self.step_masks.shutdown()
        self.grammars.shutdown()
        if self.executor is not None:
            self.executor.shutdown()
            self.executor = self.runner.peers = None

    # ---- requests ------------------------------------------------------
    def add_request(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                    first_token_id: int | None = None, prefill_only: bool = False,
                    recompute_prompt: bool = False, cache_salt: str = "",
                    resume_token_ids: list[int] | None = None) -> None:
        """Queue a prompt. Raises InvalidParameter naming the bad field.

        With `first_token_id` (decode role) the prompt's KV must already sit in
        the blocks `reserve_kv` returned: the request starts where that KV ends,
        with the first token (sampled by the prefill engine) already generated.
        With `recompute_prompt` as well, that KV is not here (the pull failed or
        memory stayed short): the prompt and first token are computed locally,
        as after a preemption, and generation goes on from the second token.
        With `prefill_only` (prefill role) the request stops after its first
        token; unless that token ended it, its blocks are kept (the delta's
        `kv_block_ids`) until `release_kv`.
        `cache_salt` (also given to `reserve_kv`) keeps its prefix-cache blocks apart from other salts'.
        With `resume_token_ids` (a migrated request) those tokens were already generated elsewhere:
        prompt + them are computed here, and generation goes on after them as if this engine had
        drawn them (stop rules count them; a seeded generator skips one draw per token).
        """
        self.validate_prompt(prompt_token_ids)
        self.validate_params(params, first_token_id)
        resumed = list(resume_token_ids or [])
        if resumed:
            self.validate_resume(prompt_token_ids, resumed)
            if first_token_id is not None:
                raise InvalidParameter("resume_token_ids", "cannot be given with first_token_id")
            if params.n > 1:
                raise InvalidParameter("n", "a resumed request continues one sample")
        if request_id in self._groups or request_id in self._handed_off:
            raise InvalidParameter("request_id", f"{request_id!r} is already running")
        if (first_token_id is not None or prefill_only) and params.n > 1:
            raise InvalidParameter("n", "parallel samples need the whole request on one engine")
        if first_token_id is not None and not recompute_prompt and request_id not in self._reserved:
            raise ValueError(f"{request_id}: call reserve_kv before adding a request with its KV")
        request = Request(request_id, list(prompt_token_ids), params.for_sample(0) if params.n > 1 else params,
                          group_id=request_id, pending_forks=params.n - 1, prefill_only=prefill_only,
                          cache_salt=cache_salt, prompt_logprobs_pending=params.prompt_logprobs is not None
                          and first_token_id is None and not resumed)  # else computed where the prompt was
        sample = self._track(request, params.for_sample(0).seed if params.n > 1 else params.seed)
        self._groups[request_id] = [request_id]
        self._group_params[request_id] = params
        self.scheduler.add_request(request)
        if first_token_id is not None and not recompute_prompt:
            request.num_computed_tokens = request.num_prompt_tokens
            request.num_cached_tokens = self._reserved.pop(request_id)
        drawn = [first_token_id] if first_token_id is not None else resumed
        for token_id in drawn:  # generated elsewhere (prefill engine, or the worker a migration left)
            request.append_token(token_id)
            if sample.generator is not None and not params.greedy:
                self.sampler.skip_draw(sample.generator, self.model_config.vocab_size)  # drawn there
            stop_string = sample.detokenizer.add_token(token_id)
            reason = grammar_verdict(sample, token_id) or stop_reason(request, token_id, stop_string,
                                                                       self.eos_token_ids, self.max_model_len)
            if reason is not None:  # it already ended the request: report at the next step
                self.scheduler.finish(request, reason)
                self._ended_between_steps.append(sample)
                break
        if drawn:
            sample.detokenizer.take_delta(False)  # the caller already streamed that text
        if first_token_id is not None and not recompute_prompt and not request.is_finished:
            self.scheduler.hold_for_load(request)  # part of its KV may still be coming from a lower tier

    def validate_prompt(self, prompt_token_ids: list[int]) -> None:
        check_prompt(prompt_token_ids, self.model_config.vocab_size, self.max_model_len)

    def validate_params(self, params: SamplingParams, first_token_id: int | None = None) -> None:
        check_params(params, first_token_id, self.model_config.vocab_size)

    def validate_resume(self, prompt_token_ids: list[int], resume_token_ids: list[int]) -> None:
        check_resume(prompt_token_ids, resume_token_ids, self.model_config.vocab_size, self.max_model_len)

    def abort_request(self, request_id: str) -> bool:
        """End every sample of a request now, freeing its blocks (also blocks `reserve_kv` holds for it)."""
        ids = self._groups.get(request_id)
        if ids is None:
            return self.release_kv(request_id) if request_id in self._reserved else False
        for sample_id in ids:
            sample = self._samples.get(sample_id)
            if sample and not sample.request.is_finished:
                self.scheduler.finish(sample.request, FinishReason.ABORT)
                self._ended_between_steps.append(sample)
        return True

    def broken(self) -> str | None:
        """Why this engine can never step again (a tensor-parallel rank or pipeline stage is gone), else None.
        Looks at the other ranks now (an idle engine learns of a lost one without a step)."""
        return self.executor.broken() if self.executor is not None else None

    def has_unfinished(self) -> bool:
        """True while a request runs or waits, or an ended one is still to be reported."""
        return self.scheduler.has_unfinished() or bool(self._ended_between_steps) or bool(self._launched)

    # ---- helpers -------------------------------------------------------
    def _track(self, request: Request, seed: int | None) -> SampleState:
        spec = request.params.structured_output
        grammar = self.grammars.matcher(spec, GRAMMAR_TIMEOUT_S) if spec is not None else None
        generator = None
        if seed is not None:
            generator = torch.Generator(device=self.runner.device).manual_seed(seed)
        sample = SampleState(request, IncrementalDetokenizer(self.tokenizer, request.prompt_token_ids,
                                                         request.params.stop), generator,
                             grammar=grammar, context=sample_context(request, self.tokenizer))
        self._samples[request.request_id] = sample
        return sample

    def _fork(self, parent: Request, index: int) -> SampleState:
        """Split off parallel sample `index` sharing the parent's computed blocks."""
        params = self._group_params[parent.group_id].for_sample(index)
        child = Request(f"{parent.group_id}#{index}", list(parent.prompt_token_ids), params,
                        group_id=parent.group_id, sample_index=index, cache_salt=parent.cache_salt)
        child.all_token_ids = list(parent.all_token_ids)
        self.scheduler.fork(parent, child)
        self._groups[parent.group_id].append(child.request_id)
        return self._track(child, params.seed)

    def _suppressed(self, request: Request) -> list[int]:
        if request.num_output_tokens >= request.params.min_tokens:
            return []
        return sorted(self.eos_token_ids | set(request.params.stop_token_ids))

    def _accept(self, sample: SampleState, token) -> None:
        """Take a sampled token and apply every stop rule. Text is made later (`SampleState.make_text`),
        except for samples with stop strings, whose stop rule needs it now."""
        request = sample.request
        request.append_token(token.token_id)
        sample.new_token_ids.append(token.token_id)
        if token.logprob is not None:
            entry = {"token_id": token.token_id, "logprob": token.logprob,
                     "top_logprobs": [{"token_id": t, "logprob": lp} for t, lp in token.top_logprobs]}
            sample.new_logprobs.append(entry)
        stop_string = None
        if request.params.stop:
            stop_string = sample.detokenizer.add_token(token.token_id)
        else:
            sample.undetokenized.append(token.token_id)
        reason = grammar_verdict(sample, token.token_id) or stop_reason(request, token.token_id, stop_string,
                                                                         self.eos_token_ids, self.max_model_len)
        if reason is not None:
            sample.flush_text = reason != FinishReason.STOP_STRING
            self.scheduler.finish(request, reason)
        elif request.prefill_only:
            self.scheduler.finish(request, None, keep_blocks=True)
            self._handed_off.add(request.request_id)

    def _delta(self, sample: SampleState) -> SampleDelta:
        request = sample.request
        ended = request.finish_reason is not None
        handed_off = request.request_id in self._handed_off
        delta = SampleDelta(request.group_id, request.sample_index, sample.new_token_ids,
                            sample.detokenizer.take_delta(ended), sample.new_logprobs,
                            ended, request.finish_reason.value if ended else None, request.num_cached_tokens,
                            list(self.kv.block_table(request.request_id)) if handed_off else None)
        if sample.prompt_logprobs is not None and not request.prompt_logprobs_pending:
            delta.prompt_logprobs, sample.prompt_logprobs = sample.prompt_logprobs, None
        sample.new_token_ids, sample.new_logprobs = [], []
        if request.is_finished:
            self._forget(request)
        return delta

    def _drain_ended(self) -> list[SampleDelta]:
        """Deltas for samples that ended between steps (aborts, finished on arrival)."""
        ended, self._ended_between_steps = self._ended_between_steps, []
        return [self._delta(s) for s in ended]

    def _forget(self, request: Request) -> None:
        self._samples.pop(request.request_id, None)
        if self.proposer is not None:
            self.proposer.free(request.request_id)
        group = self._groups.get(request.group_id, [])
        if all(sid not in self._samples for sid in group):
            self._groups.pop(request.group_id, None)
            self._group_params.pop(request.group_id, None)

    # ---- whole batches -------------------------------------------------
    def generate(self, prompts: list[list[int]], params: list[SamplingParams] | SamplingParams,
                 request_ids: list[str] | None = None) -> list[RequestOutput]:
        """Submit all prompts together and run until the engine is idle; return their outputs."""
        return generate_all(self, prompts, params, request_ids)
