"""What the engine tells the world about its KV: prefix-cache events, cached hashes per medium, block counts,
and the KV tiers below its pool (built here: engine/kv_offload/); and the blocks the disaggregated roles
hold for a transfer (`reserve_kv`, `release_kv`), and a cached prefix moved between prefill workers
(`lease_cached_prefix` on the holder, `reserve_prefix` / `finish_prefix` on the puller)."""
from __future__ import annotations

from engine.sampling_params import InvalidParameter


class KVViews:
    """Mixed into LLMEngine (which provides `kv`, `scheduler`, `runner`, `config` and `model_path`)."""

    def reserve_kv(self, request_id: str, prompt_token_ids: list[int], cache_salt: str = "") -> tuple[list[int], int]:
        """Decode role: blocks for a prompt whose KV is computed elsewhere.

        Locally cached prefix blocks are reused, those in a lower KV tier loaded
        back meanwhile. Returns the block table and how many of its leading blocks
        hold (or are loading) the right KV, or need none; only the rest need to be pulled.
        With a sliding window the entries behind the prompt's last window are the null
        block, counted among those leading blocks: only the last window's blocks are pulled.
        Raises MemoryError when blocks are short (nothing held).
        """
        self.validate_prompt(prompt_token_ids)
        if request_id in self._groups or request_id in self._reserved:
            raise InvalidParameter("request_id", f"{request_id!r} is already running")
        self._wait_for_launched_step()  # blocks freed meanwhile may be handed out and written by a pull
        hit = self.kv.find_prefix(request_id, prompt_token_ids, cache_salt)
        if self.kv.allocate_slots(request_id, 0, len(prompt_token_ids) - hit.num_tokens, hit,
                                  first_query=len(prompt_token_ids)) is None:
            raise MemoryError("not enough free KV blocks for this prompt")
        start = max(len(hit.block_ids), self.kv.num_released(request_id))
        num_loaded = self.scheduler.load_reserved(request_id, prompt_token_ids, cache_salt, start)
        self._reserved[request_id] = (len(hit.block_ids) + num_loaded) * self.kv.block_size
        return list(self.kv.block_table(request_id)), start + num_loaded

    def release_kv(self, request_id: str) -> bool:
        """Free blocks kept for a transfer: reserved by `reserve_kv` (decode role,
        the KV never arrived) or kept after a `prefill_only` request's first token."""
        if self._reserved.pop(request_id, None) is None and request_id not in self._handed_off:
            return False
        self._handed_off.discard(request_id)
        if not self.scheduler.drop_load(request_id):  # else freed when the lower tier's load ends
            self.kv.free(request_id)
        return True

    def lease_cached_prefix(self, lease_id: str, token_ids: list[int], cache_salt: str = "") -> tuple[list[int], bool]:
        """Holder of a peer pull: hold the blocks of the leading full blocks of `token_ids` cached here under
        `cache_salt` until `release_kv(lease_id)`: those on the device, then those a lower tier (host memory,
        disk) holds after them, loaded back into the device blocks returned. Returns (their ids, loading):
        while `loading`, `leased_prefix_loaded` says when they hold the KV. None cached: ([], False), nothing held."""
        self.validate_prompt(token_ids)
        self._check_new_id(lease_id, "lease_id")
        hit = self.kv.find_prefix(lease_id, token_ids, cache_salt, whole=True)
        loading = self.scheduler.load_lease(lease_id, token_ids, cache_salt, hit)  # a reference on each block:
        if not hit.block_ids and not loading:                                     # no eviction meanwhile
            self.kv.free(lease_id)  # forget the hashes it computed
            return [], False
        self._handed_off.add(lease_id)
        return list(self.kv.block_table(lease_id)), bool(loading)

    def leased_prefix_loaded(self, lease_id: str, token_ids: list[int], cache_salt: str = "") -> list[int] | None:
        """A lease `lease_cached_prefix` is loading: None while the load runs; then the leading blocks that
        hold the prefix's KV (the rest are dropped), entered into the device's prefix cache."""
        num_valid = self.scheduler.take_lease_load(lease_id)
        if num_valid is None:
            return None
        valid_tokens = num_valid * self.kv.block_size
        self.kv.truncate(lease_id, valid_tokens)
        self.kv.cache_computed_blocks(lease_id, token_ids, valid_tokens, cache_salt)
        return list(self.kv.block_table(lease_id))

    def reserve_prefix(self, request_id: str, token_ids: list[int], cache_salt: str = "") -> tuple[list[int], int]:
        """Puller of a peer pull: blocks for the full blocks of `token_ids`, a prefix another worker holds.

        This pool's own cached blocks of it are reused; returns the block table and how many of its leading
        blocks are such (only the rest are pulled). Raises MemoryError when blocks are short (nothing held).
        `finish_prefix` ends the reservation."""
        self._check_new_id(request_id, "request_id")
        self._wait_for_launched_step()  # blocks freed meanwhile may be handed out and written by the pull
        token_ids = token_ids[:len(token_ids) // self.kv.block_size * self.kv.block_size]
        hit = self.kv.find_prefix(request_id, token_ids, cache_salt, whole=True)
        if self.kv.allocate_slots(request_id, 0, len(token_ids) - hit.num_tokens, hit) is None:
            self.kv.free(request_id)
            raise MemoryError("not enough free KV blocks for the prefix")
        self._prefix_pulls[request_id] = (token_ids, cache_salt)
        return list(self.kv.block_table(request_id)), len(hit.block_ids)

    def finish_prefix(self, request_id: str, pulled: bool) -> None:
        """The pull into `reserve_prefix`'s blocks ended. `pulled`: they hold the prefix's KV now and enter
        the prefix cache as if computed here (the request added next finds them); else they are dropped."""
        token_ids, cache_salt = self._prefix_pulls.pop(request_id)
        if pulled:
            self.kv.cache_computed_blocks(request_id, token_ids, len(token_ids), cache_salt)
        self.kv.free(request_id)

    def _check_new_id(self, request_id: str, field_name: str) -> None:
        if (request_id in self._groups or request_id in self._reserved or request_id in self._handed_off
                or request_id in self._prefix_pulls):
            raise InvalidParameter(field_name, f"{request_id!r} is already in use")

    def _start_kv_tiers(self) -> None:
        """Put the configured host/disk tiers behind the pool (a disk tier found again announces its blocks)."""
        offload = self.config.cache.offload
        if not offload.enabled:
            return
        from engine.kv_offload.layout_key import layout_key
        from engine.kv_offload.offloader import KVOffloader
        shards = self.runner.kv_shards()
        if len(shards) > 1 and self.runner.device.type == "cuda":
            # The I/O thread's copies wait for rank 0's stream only; the other GPUs' steps are not fenced.
            raise ValueError("KV offload tiers with tensor parallelism on CUDA are not supported yet")
        self.scheduler.offload = KVOffloader(offload, self.kv, shards,
                                             layout_key(self.model_path, shards, self.runner.kv_scales))

    def _stop_kv_tiers(self) -> None:
        if self.scheduler.offload is not None:
            self.scheduler.offload.close()
            self.scheduler.offload = None

    def enable_kv_events(self) -> None:
        """Start recording prefix-cache events (taken with `take_kv_events`)."""
        self.kv.pool.enable_events()

    def take_kv_events(self) -> list:
        """Prefix-cache events since the last call, oldest first (engine/kv_events.py)."""
        return self.kv.pool.take_events()

    def cached_block_hashes(self) -> list[int]:
        """Hashes of the blocks in the device pool's prefix cache."""
        return self.kv.pool.cached_hashes()

    def offloaded_block_hashes(self) -> dict[str, list[int]]:
        """Hashes of the blocks in each lower tier, by medium ("cpu", "disk"); empty without tiers."""
        offload = self.scheduler.offload
        return offload.hashes_by_medium() if offload is not None else {}

    def kv_tier_stats(self) -> dict[str, dict]:
        """Per lower tier (by medium): capacity, use, hits, misses, bytes stored and loaded, load latencies."""
        offload = self.scheduler.offload
        return offload.snapshot_stats() if offload is not None else {}

    @property
    def num_kv_blocks_used(self) -> int:
        """Blocks held by requests or kept for transfers (free prefix-cache blocks excluded)."""
        return self.kv.pool.num_used_blocks

    @property
    def num_kv_blocks_total(self) -> int:
        return self.kv.pool.num_blocks
