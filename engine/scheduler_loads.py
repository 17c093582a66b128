"""The scheduler's KV tier loads (engine/kv_offload/): prefix blocks a lower tier (host memory, disk) holds,
copied back into device blocks before the request (or a decode reservation, or a peer's lease) goes on.
Mixed into `Scheduler` (engine/scheduler.py), which provides `kv`, `offload`, `loading`, `waiting`, `running`
and the load bookkeeping; see its module docstring, "KV tiers". No torch."""
from __future__ import annotations

from dataclasses import dataclass

from engine.kv_cache_manager import PrefixHit
from engine.request import Request, RequestStatus


@dataclass
class PendingLoad:
    """Prefix blocks a lower KV tier is copying back for one request."""
    request_id: str
    start: int
    """Blocks of the prompt already on the device before the loaded ones."""
    num_found: int
    request: Request | None = None
    """None: a decode reservation whose request has not been added yet."""
    num_loaded: int | None = None
    """Set when the load ended before its request was added."""



class SchedulerLoads:
    def _start_load(self, request: Request, prefix: PrefixHit) -> bool | None:
        """Load the blocks after `prefix` that a lower tier holds: True (the request now waits in `loading`),
        False (none there), None (blocks or the load budget are short: try again later)."""
        found = self._lower_hit(request.request_id, request.all_token_ids, request.cache_salt, len(prefix.block_ids))
        if not found:
            return False
        if not self.offload.can_load(len(found)) or self.kv.allocate_slots(
                request.request_id, 0, len(found) * self.kv.block_size, prefix,
                self._first_query(request, prefix.num_tokens)) is None:
            return None
        self._load(PendingLoad(request.request_id, len(prefix.block_ids), len(found), request), found,
                   request.all_token_ids)
        request.status = RequestStatus.LOADING
        return True

    def load_reserved(self, request_id: str, token_ids: list[int], salt: str, start: int) -> int:
        """Decode reservation (blocks allocated, the first `start` cached on the device): load the blocks a
        lower tier holds after them; returns how many (the caller pulls only the rest)."""
        found = self._lower_hit(request_id, token_ids, salt, start) if self.offload is not None else []
        if not found or not self.offload.can_load(len(found)):
            return 0
        self._load(PendingLoad(request_id, start, len(found)), found, token_ids)
        return len(found)

    def load_lease(self, lease_id: str, token_ids: list[int], salt: str, hit: PrefixHit) -> int:
        """A peer's lease on the full blocks of `token_ids` (`hit`: those cached on the device): blocks for the
        ones a lower tier holds after them, loaded there; returns how many (0: none held there, or no room:
        only the device blocks are held). `take_lease_load` tells when the load ended."""
        found = []
        if self.offload is not None:
            hashes = self.kv.block_hashes(lease_id, token_ids, salt)
            found = self.offload.lookup(hashes, token_ids, len(hit.block_ids), len(token_ids) // self.kv.block_size)
        if found and self.offload.can_load(len(found)) and self.kv.allocate_slots(
                lease_id, 0, len(found) * self.kv.block_size, hit) is not None:
            self._load(PendingLoad(lease_id, len(hit.block_ids), len(found)), found, token_ids)
            return len(found)
        self.kv.allocate_slots(lease_id, 0, 0, hit)
        return 0

    def take_lease_load(self, lease_id: str) -> int | None:
        """The load `load_lease` started: None while it runs; once it ended, forgotten here, and the leading
        blocks of the lease that now hold their KV (those after a block that failed its check do not)."""
        key = self._load_keys.get(lease_id)
        pending = self.loading[key]
        if pending.num_loaded is None:
            return None
        del self.loading[key], self._load_keys[lease_id]
        return pending.start + pending.num_loaded

    def hold_for_load(self, request: Request) -> None:
        """A decode request whose reservation is loading waits in `loading` until the load ends."""
        key = self._load_keys.get(request.request_id)
        if key is None:
            return
        pending = self.loading[key]
        self.waiting.remove(request)
        pending.request = request
        if pending.num_loaded is None:
            request.status = RequestStatus.LOADING
        else:
            self._loaded(key, pending.num_loaded)

    def drop_load(self, request_id: str) -> bool:
        """Forget the load of an ended request or reservation; True when it is still running (its blocks are
        then freed when it ends), False when there is none (the caller frees the blocks)."""
        key = self._load_keys.pop(request_id, None)
        if key is None:
            return False
        if self.loading.pop(key).num_loaded is not None:
            return False
        self.kv.rename(request_id, key)
        self._orphan_loads.add(key)
        return True

    def _lower_hit(self, request_id: str, token_ids: list[int], salt: str, start: int) -> list:
        """Blocks after `start` a lower tier holds; when none, that miss is counted now."""
        hashes = self.kv.block_hashes(request_id, token_ids, salt)
        found = self.offload.lookup(hashes, token_ids, start, self._max_prefix_blocks(token_ids))
        if not found and start < self._max_prefix_blocks(token_ids):
            self.offload.count_lookup([], missed=True)
        return found

    def _max_prefix_blocks(self, token_ids: list[int]) -> int:
        return (len(token_ids) - 1) // self.kv.block_size

    def _load(self, pending: PendingLoad, found: list, token_ids: list[int]) -> None:
        self._num_loads += 1
        key = f"{pending.request_id}\x00load{self._num_loads}"
        table = self.kv.block_table(pending.request_id)
        missed = pending.start + len(found) < self._max_prefix_blocks(token_ids)
        self.offload.start_load(key, found, table[pending.start:pending.start + len(found)], missed)
        self.loading[key] = pending
        self._load_keys[pending.request_id] = key

    def _finish_loads(self) -> None:
        for key, num_loaded in self.offload.poll():
            if key in self._orphan_loads:
                self._orphan_loads.discard(key)
                self.kv.free(key)
            elif self.loading[key].request is None:
                self.loading[key].num_loaded = num_loaded  # its request comes later
            else:
                self._loaded(key, num_loaded)

    def _loaded(self, key: str, num_loaded: int) -> None:
        """The load ended: its request rejoins the front of the queue with what arrived computed (blocks after
        one that failed its check are recomputed, pulled ones included)."""
        pending = self.loading.pop(key)
        request = pending.request
        del self._load_keys[request.request_id]
        computed = (pending.start + num_loaded) * self.kv.block_size
        if not request.num_computed_tokens:  # admitted from the queue: the loaded blocks are all it has
            self.kv.truncate(request.request_id, computed)
            request.num_computed_tokens = computed
            if request.num_preemptions == 0:
                request.num_cached_tokens = min(computed, request.num_prompt_tokens)
        elif num_loaded < pending.num_found and not self.kv.window_intact(request.request_id, computed):
            # a windowed decode reservation has no blocks behind its prompt's last window, and the keys there
            # are what a recompute from `computed` would read: recompute the whole prompt instead
            self.kv.free(request.request_id)
            request.num_computed_tokens = request.num_cached_tokens = 0
        elif num_loaded < pending.num_found:  # a decode request: what it pulled after a refused block is redone
            self.kv.truncate(request.request_id, computed)
            request.num_computed_tokens = computed
            request.num_cached_tokens = min(request.num_cached_tokens, computed)
        self.kv.cache_computed_blocks(request.request_id, request.all_token_ids, request.num_computed_tokens,
                                      request.cache_salt)
        request.status = RequestStatus.WAITING
        self.waiting.appendleft(request)

