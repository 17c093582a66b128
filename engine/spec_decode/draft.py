"""Draft-model proposer: a smaller checkpoint of the same tokenizer, run by the same engine code.

The draft has its own ModelRunner (weights and paged KV tensor) and its own KVCacheManager (no prefix
caching). For each decoding request it keeps a shadow Request whose KV in the draft cache covers some
prefix of the request's tokens. A proposal round first catches the draft up (one chunk: the whole
prompt the first time, afterwards the tokens the target accepted since), sampling the first proposal
from the chunk's last logits, then runs K - 1 single-token steps for all requests together. Proposals
are greedy (argmax), so the draft distribution is a point mass and verification stays exact.
After the target verifies, the shadow keeps the KV of the longest prefix it shares with the request's
tokens (accepted proposals keep theirs); the rest is overwritten in the next round.
"""
from __future__ import annotations

from dataclasses import replace

from engine.config import EngineConfig, SpeculativeConfig
from engine.kv_cache_manager import KVCacheManager
from engine.model.model_config import ModelConfig
from engine.model_files import resolve_model_path
from engine.model_runner import ModelRunner
from engine.request import Request
from engine.scheduler import ScheduledRequest, SchedulerOutput


class DraftProposer:
    def __init__(self, config: EngineConfig, target: ModelConfig, max_model_len: int,
                 num_blocks: int | None = None) -> None:
        path = resolve_model_path(config.speculative.model)
        self.model_config = ModelConfig.from_dir(path)
        if self.model_config.vocab_size != target.vocab_size:
            raise ValueError(f"the draft model's vocabulary ({self.model_config.vocab_size}) differs from the "
                             f"target's ({target.vocab_size}); it needs the same tokenizer")
        cache = replace(config.cache, enable_prefix_caching=False,
                        num_blocks=num_blocks or config.cache.num_blocks)
        draft_config = replace(config, model=str(path), cuda_graphs=False, cache=cache,
                               speculative=SpeculativeConfig(), tensor_parallel_size=1)  # on rank 0 alone
        self.runner = ModelRunner(draft_config, path, self.model_config, max_model_len)
        self.kv = KVCacheManager(self.runner.num_blocks, cache.block_size, enable_prefix_caching=False)
        self.shadows: dict[str, Request] = {}
        self._synced: dict[str, int] = {}
        """Request id -> how many of its tokens the shadow had at the last round (known to match)."""

    def propose(self, requests: list[Request], max_tokens: list[int]) -> list[list[int]]:
        proposals: list[list[int]] = [[] for _ in requests]
        active: list[tuple[int, Request]] = []
        items = []
        for i, request in enumerate(requests):
            shadow = self._sync(request)
            num_new = shadow.num_tokens - shadow.num_computed_tokens
            if self.kv.allocate_slots(shadow.request_id, shadow.num_computed_tokens,
                                      num_new + max_tokens[i] - 1) is None:
                self.free(request.request_id)  # the draft cache is full: no proposals for this one
                continue
            active.append((i, shadow))
            items.append(ScheduledRequest(shadow, num_new))
        for round_index in range(max(max_tokens, default=0)):
            if not items:
                break
            logits = self.runner.execute(SchedulerOutput(scheduled=items), self.kv)
            token_ids = logits.argmax(dim=-1).tolist()
            next_items, next_active = [], []
            for (i, shadow), item, token_id in zip(active, items, token_ids, strict=True):
                shadow.num_computed_tokens += item.num_new_tokens
                shadow.append_token(token_id)
                proposals[i].append(token_id)
                if round_index + 1 < max_tokens[i]:
                    next_items.append(ScheduledRequest(shadow, 1))
                    next_active.append((i, shadow))
            items, active = next_items, next_active
        return proposals

    def _sync(self, request: Request) -> Request:
        """The request's shadow, its tokens set to the request's and its computed KV cut to the shared prefix."""
        shadow = self.shadows.get(request.request_id)
        if shadow is None:
            shadow = Request(request.request_id, list(request.prompt_token_ids), request.params)
            self.shadows[request.request_id] = shadow
        tokens = request.all_token_ids
        limit = min(shadow.num_computed_tokens, len(tokens))
        same = min(self._synced.get(request.request_id, 0), limit)  # tokens never change, only grow
        while same < limit and shadow.all_token_ids[same] == tokens[same]:
            same += 1
        shadow.all_token_ids = list(tokens)
        self._synced[request.request_id] = len(tokens)
        shadow.num_computed_tokens = min(same, len(tokens) - 1)
        self.kv.truncate(shadow.request_id, len(tokens))
        return shadow

    def free(self, request_id: str) -> None:
        self.shadows.pop(request_id, None)
        self._synced.pop(request_id, None)
        self.kv.free(request_id)
