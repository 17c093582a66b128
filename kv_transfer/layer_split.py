"""KV pools split by layer across nodes: a pipeline-parallel worker whose stages run on other hosts.

Each stage of such a worker holds the KV of its layer range and serves it from a sender of its own, on its own
node, so each range crosses its own link (the stages never funnel their KV through the first stage).

- Sender: :class:`LayerSplitSender` stands for the worker. It wraps the first stage's sender (whose pool holds
  layers ``[0, n0)``) and the other stages' (reached through the engine: ``StageSender``s); its ``peer_info``
  lists every stage's sender with its layer range (``"stages"``), and ``expect`` leases the blocks on every
  stage under one capability, as one :class:`StagedTransfer` that ends once every stage's lease has ended.
- Receiver: :class:`LayerSplitReceiver` (every worker's receiver). A handle without stages is an ordinary read;
  one with stages is read range by range, in parallel, each range into the layers it covers of this pool's
  blocks (a :class:`~kv_transfer.sharded.ShardedKV` window over the pool, one receiver per range).

The wire keeps "every head, in order, per layer": a stage's block is the layers ``[first_layer, first_layer +
num_layers)`` of a whole block, and a stage's layout (``KVLayout.first_layer``) equals the window's, so its
compatibility hash pairs exactly the receiver of that range.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Sequence
from typing import Any, Protocol

from . import auth
from .base import KVReceiver, KVSender
from .layout import KVLayout
from .sharded import ShardedKV
from .state import TransferState

MAX_STAGES = 64


class StageSender(Protocol):
    """Another stage's sender, as the first stage reaches it (engine/parallel/remote_stages.py)."""

    first_layer: int
    num_layers: int
    bytes_moved: int
    """Bytes its leases served, as the stage reported them."""

    def peer_info(self) -> dict[str, Any]: ...

    def expect(self, transfer_id: str, block_ids: Sequence[int], timeout_s: float, capability: str) -> Any:
        """A lease on the stage's layers of `block_ids` (a Transfer-like piece: poll, request_stop, abort)."""


class StagedTransfer:
    """One transfer made of one piece per stage (Transfer-like: ``poll``, ``abort``, ``wait``, ``state``). It
    is terminal once every piece is: DONE when all are, else FAILED (a failed piece stops the others first).
    So, as for any transfer, terminal means no stage touches the blocks any more."""

    def __init__(self, transfer_id: str, pieces: list[Any], capability: str = "") -> None:
        self.transfer_id = transfer_id
        self.pieces = pieces
        self.capability = capability
        self.block_ids = pieces[0].block_ids
        self.deadline = min(p.deadline for p in pieces)

    @property
    def state(self) -> TransferState:
        return self._combine([p.state for p in self.pieces])

    def poll(self) -> TransferState:
        states = [p.poll() for p in self.pieces]
        if TransferState.FAILED in states and not all(s.is_terminal for s in states):
            failed = next(p for p, s in zip(self.pieces, states, strict=True) if s == TransferState.FAILED)
            for piece, state in zip(self.pieces, states, strict=True):
                if not state.is_terminal:
                    piece.request_stop(f"another stage's piece failed: {failed.error}", interrupt=True)
            states = [p.poll() for p in self.pieces]
        return self._combine(states)

    @staticmethod
    def _combine(states: list[TransferState]) -> TransferState:
        pending = [s for s in states if not s.is_terminal]
        if pending:
            return min(pending)
        return min(states)

    def abort(self, reason: str = "aborted by caller") -> TransferState:
        for piece in self.pieces:
            piece.request_stop(reason, interrupt=True)
        for piece in self.pieces:
            piece.abort(reason)
        return self.state

    def request_stop(self, reason: str, interrupt: bool = False) -> None:
        for piece in self.pieces:
            piece.request_stop(reason, interrupt=interrupt)

    def wait(self, timeout: float | None = None) -> TransferState:
        deadline = None if timeout is None else time.monotonic() + timeout
        while not (state := self.poll()).is_terminal:
            if deadline is not None and time.monotonic() >= deadline:
                break
            time.sleep(0.002)
        return state

    @property
    def error(self) -> str | None:
        return next((p.error for p in self.pieces if p.error), None)

    @property
    def bytes_moved(self) -> int:
        return sum(p.bytes_moved for p in self.pieces)

    @property
    def elapsed_s(self) -> float | None:
        times = [p.elapsed_s for p in self.pieces]
        return None if any(t is None for t in times) else max(times)


class LayerSplitSender:
    """The sender of a worker whose pipeline stages run on other nodes (see the module docstring). Everything
    but ``peer_info``, ``expect`` and ``stats`` is the first stage's sender's."""

    def __init__(self, local: KVSender, stages: Sequence[StageSender]) -> None:
        self.local = local
        self.stages = list(stages)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.local, name)

    def peer_info(self) -> dict[str, Any]:
        own = self.local.peer_info()
        first = {"peer": own, "first_layer": self.local.layout.first_layer, "num_layers": self.local.layout.num_layers}
        rest = [{"peer": s.peer_info(), "first_layer": s.first_layer, "num_layers": s.num_layers} for s in self.stages]
        return {**own, "stages": [first, *rest]}

    def agent_metadata(self) -> dict[str, Any]:
        return self.peer_info()

    def expect(self, transfer_id: str, block_ids: Sequence[int], timeout_s: float | None = None,
               capability: str | None = None) -> StagedTransfer:
        capability = capability or auth.new_capability()
        pieces = [self.local.expect(transfer_id, block_ids, timeout_s, capability)]
        try:
            for stage in self.stages:
                pieces.append(stage.expect(transfer_id, block_ids, pieces[0].deadline - time.monotonic(),
                                           capability))
        except BaseException:
            for piece in pieces:
                piece.abort("a stage could not lease the blocks")
            raise
        return StagedTransfer(str(transfer_id), pieces, capability)

    def stats(self) -> dict[str, Any]:
        """The first stage's sender's counters, `bytes_moved` counting every stage's, and `stage_bytes_moved`:
        (stage, its sender's host, bytes its leases served), each range's link on its own."""
        stats = dict(self.local.stats())
        per_stage = [(0, self.local.peer_info()["host"], stats.get("bytes_moved", 0))]
        per_stage += [(i, s.peer_info()["host"], s.bytes_moved) for i, s in enumerate(self.stages, 1)]
        stats["bytes_moved"] = sum(n for _, _, n in per_stage)
        stats["stage_bytes_moved"] = per_stage
        return stats

    def close(self) -> None:
        self.local.close()


class LayerSplitReceiver:
    """A worker's receiver: ordinary reads on its whole pool, and reads of a layer-split sender's handle range by
    range into windows of the pool (one receiver per range, made on first use). Anything else is the whole
    pool's receiver's."""

    def __init__(self, pool: Any, layout: KVLayout, config: Any, make_receiver) -> None:
        self.pool = pool
        self.config = config
        self._make = make_receiver
        self.whole: KVReceiver = make_receiver(pool, layout, config)
        self._ranges: dict[tuple[int, int], KVReceiver] = {}

    def __getattr__(self, name: str) -> Any:
        return getattr(self.whole, name)

    def read(self, peer_info: dict[str, Any], transfer_id: str, remote_block_ids: Sequence[int],
             local_block_ids: Sequence[int], timeout_s: float | None = None, capability: str = "") -> Any:
        stages = peer_info.get("stages")
        if not stages:
            return self.whole.read(peer_info, transfer_id, remote_block_ids, local_block_ids, timeout_s, capability)
        ranges = check_stages(stages, self.whole.layout.num_layers)
        pieces = []
        try:
            for stage, (lo, hi) in zip(stages, ranges, strict=True):
                pieces.append(self._receiver(lo, hi).read(stage["peer"], transfer_id, remote_block_ids,
                                                          local_block_ids, timeout_s, capability))
        except BaseException:
            for piece in pieces:
                piece.abort("another stage's read could not start")
            raise
        return StagedTransfer(str(transfer_id), pieces, capability)

    def _receiver(self, lo: int, hi: int) -> KVReceiver:
        if (lo, hi) not in self._ranges:
            pool = self.pool
            shards, stages = (pool.shards, pool.stages) if isinstance(pool, ShardedKV) else ([pool], 1)
            layout = dataclasses.replace(self.whole.layout, num_layers=hi - lo, first_layer=lo)
            self._ranges[(lo, hi)] = self._make(ShardedKV(shards, stages, layers=(lo, hi)), layout, self.config)
        return self._ranges[(lo, hi)]

    def stats(self) -> dict[str, int]:
        total = dict(self.whole.stats())
        for receiver in self._ranges.values():
            for key, value in receiver.stats().items():
                if isinstance(value, int | float):
                    total[key] = total.get(key, 0) + value
        return total

    def close(self) -> None:
        for receiver in self._ranges.values():
            receiver.close()
        self.whole.close()


def check_stages(stages: Sequence[dict], num_layers: int) -> list[tuple[int, int]]:
    """The layer ranges of a handle's stages, checked to tile ``[0, num_layers)`` in order; ValueError if not."""
    if not 0 < len(stages) <= MAX_STAGES:
        raise ValueError(f"a KV handle names 1 to {MAX_STAGES} stages, got {len(stages)}")
    ranges, start = [], 0
    for stage in stages:
        lo, n = int(stage["first_layer"]), int(stage["num_layers"])
        if lo != start or n < 1:
            raise ValueError(f"stage layers [{lo}, {lo + n}) do not continue from layer {start}")
        ranges.append((lo, lo + n))
        start = lo + n
    if start != num_layers:
        raise ValueError(f"the stages hold {start} layers, this pool {num_layers}")
    return ranges
