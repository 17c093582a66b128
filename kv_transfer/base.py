"""The two abstract sides of a KV transfer, and what they share (:class:`KVSide`).

Sender (prefill engine): exposes its KV pool and, per request, the blocks it
holds for that request (``expect``). Its per-request :class:`Transfer` turns
DONE when the receiver confirms it has the blocks (the moment the prefill side
may free them) and FAILED at the deadline, on abort, or when the receiver
vanishes mid-read.

Receiver (decode engine): ``read`` pulls given remote block ids into given
local block ids; its :class:`Transfer` turns DONE once the bytes are in place
and the sender has confirmed it still held the blocks.
"""

from __future__ import annotations

import abc
from collections.abc import Sequence
from typing import Any, Self

from .layout import KVLayout
from .memory import KVRegion
from .transfer import Transfer


class KVSide(abc.ABC):
    """What a sender and a receiver both are: a KV pool, the data path chosen for it, counters."""

    backend_name: str = ""
    """Data path this side was built for: ``"nixl"``, ``"tcp"`` or ``"tcp-staged"`` (TCP
    through host staging buffers: a CUDA pool, or ``staging="always"``)."""
    selection: str = ""
    """How the factory chose it: ``"<backend>: <reason>"``."""
    selection_reason: str = ""
    """The reason alone (logged, and exported as ``pdserve:kv_transfer_backend_info``)."""
    layout: KVLayout
    region: KVRegion

    def backend_info(self) -> dict[str, str]:
        """``{"backend", "reason"}``: the data path and why it was chosen."""
        return {"backend": self.backend_name, "reason": self.selection_reason}

    @abc.abstractmethod
    def stats(self) -> dict[str, int]:
        """Counters for leak checks: ``in_flight``, ``registered_regions``, ``bytes_moved``, ..."""

    @abc.abstractmethod
    def close(self) -> None:
        """Abort everything, close sockets, deregister memory. Idempotent."""

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class KVSender(KVSide):
    """Prefill side: registers KV memory, serves reads of leased blocks."""

    @abc.abstractmethod
    def peer_info(self) -> dict[str, Any]:
        """JSON-able address info a receiver needs to read from this sender."""

    def agent_metadata(self) -> dict[str, Any]:
        """Alias of :meth:`peer_info` (what goes into the KV handle)."""
        return self.peer_info()

    @abc.abstractmethod
    def expect(self, transfer_id: str, block_ids: Sequence[int],
               timeout_s: float | None = None, capability: str | None = None) -> Transfer:
        """Expose ``block_ids`` for ``transfer_id`` until read, aborted or expired. The returned
        transfer's ``capability`` (128 random bits, hex; ``capability`` when given: the one a pipeline's first
        stage issued for every stage's sender) must reach the receiver (in the KV handle): a ``read`` or
        ``abort`` without it is refused like one of an unknown transfer."""


class KVReceiver(KVSide):
    """Decode side: reads remote blocks into local blocks."""

    @abc.abstractmethod
    def read(self, peer_info: dict[str, Any], transfer_id: str,
             remote_block_ids: Sequence[int], local_block_ids: Sequence[int],
             timeout_s: float | None = None, capability: str = "") -> Transfer:
        """Start pulling ``remote_block_ids`` into ``local_block_ids``; returns at once.
        ``capability``: what the sender's ``expect`` issued for ``transfer_id``.

        Pass only the blocks this engine lacks; an empty list still tells the
        sender it may free the request's blocks.
        """
