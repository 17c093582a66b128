"""The data paths as objects: how granted blocks get from a sender's pool into a receiver's.

Every sender and receiver speaks the same control protocol (:mod:`sender`, :mod:`peer_link`) and
holds a list of data paths, preferred first; the receiver's ``hello`` names the one a connection
uses (its wire name: ``"cuda_ipc"``, ``"nixl"`` or ``"tcp"``). A path is one object per side:

- :class:`SenderPath`: what it adds to the sender's KV handle (``peer_info``), to ``hello_ok`` and
  to each ``grant``, and how the sender serves a grant (TCP: streams the blocks; CUDA IPC, NIXL:
  the receiver reads the memory itself, so its ``done`` is answered with an ``ack``).
- :class:`ReceiverPath`: whether it can reach a given sender, what it adds to the ``hello`` and each
  ``read``, what it sets up once connected (kept per link in ``link.path_state``), how it pulls.

:func:`choose` is the negotiation: the receiver's first path the sender offers and that can reach it.
A path that fails against one sender instance (:class:`PathUnusable`) is skipped for that instance.
"""

from __future__ import annotations

import abc
import socket
from collections.abc import Iterable, Sequence
from typing import Any, Protocol

from .transfer import Transfer


class PathUnusable(Exception):
    """This path cannot reach this sender after all (the link falls back to the next path, for good)."""


class Link(Protocol):
    """What a receiver path sees of the link to one sender (:class:`~kv_transfer.peer_link.PeerLink`)."""

    host: str
    port: int
    sock: socket.socket | None
    """The control connection (None: not connected)."""
    hello: dict
    """The sender's ``hello_ok`` on this connection."""
    path_state: Any
    """What the path keeps for this sender (e.g. its mapped pool); None until it sets it."""


class DataPath:
    """What both sides of a data path have."""

    name: str = ""
    """The wire name (in ``peer_info["modes"]`` and the ``hello``)."""
    acks_done: bool = True
    """The receiver reads the memory itself, so the sender answers its ``done`` with an ``ack`` (did the
    lease hold for the whole read?). False for a path the sender streams."""

    def stats(self) -> dict[str, int]:
        """Counters merged into the side's ``stats()``."""
        return {}

    def close(self) -> None:
        """Release what the path holds (registrations, buffers). Idempotent."""


class SenderPath(DataPath, abc.ABC):
    """The sender's half of a data path."""

    def peer_info(self) -> dict[str, Any]:
        """Fields added to the sender's ``peer_info`` (the KV handle)."""
        return {}

    def hello_ok(self, hello: dict) -> tuple[dict, bytes]:
        """Fields and payload added to ``hello_ok`` for a receiver whose ``hello`` chose this path."""
        return {}, b""

    def grant_payload(self, t: Transfer, block_ids: list[int]) -> bytes:
        """Payload of the ``grant`` of ``block_ids``."""
        return b""

    @abc.abstractmethod
    def serve(self, sock: socket.socket, t: Transfer, block_ids: list[int], hello: dict, read: dict) -> None:
        """After the ``grant`` (``read``: the receiver's message, ``hello``: its handshake): move the blocks,
        or let the receiver read them (then set ``t.granted_nbytes``, confirmed by ``done``)."""


class ReceiverPath(DataPath, abc.ABC):
    """The receiver's half of a data path."""

    def can_reach(self, peer_info: dict[str, Any]) -> bool:
        """Whether this path can reach the sender of ``peer_info`` (which offers it)."""
        return True

    def hello(self) -> dict:
        """Fields added to the ``hello``."""
        return {}

    def connected(self, link: Link, hello: dict, payload: bytes) -> None:  # noqa: B027 - TCP needs nothing
        """The sender accepted the ``hello`` (``hello_ok`` and its payload): set up ``link.path_state``.
        Raises :class:`PathUnusable` when this path cannot work with the sender after all."""

    def read_fields(self, link: Link) -> dict:
        """Fields added to each ``read``."""
        return {}

    @abc.abstractmethod
    def pull(self, link: Link, t: Transfer, grant: dict, payload: bytes) -> int:
        """After the ``grant``: move ``t.remote_block_ids`` into ``t``'s local blocks; returns the bytes."""

    def forget(self, link: Link) -> None:
        """The link is closed for good, or leaves this path: release ``link.path_state``."""
        link.path_state = None

    def link_stats(self, states: Sequence[Any]) -> dict[str, int]:
        """Counters over the ``path_state`` of the links now on this path."""
        return {}


def choose(paths: Iterable[ReceiverPath], peer_info: dict[str, Any],
           refused: Iterable[str] = ()) -> ReceiverPath:
    """The first of ``paths`` (the receiver's, preferred first) the sender offers and that can reach it,
    skipping the names in ``refused`` (paths that failed with this sender instance). Raises ValueError
    when there is none."""
    paths = list(paths)
    offered = peer_info.get("modes") or [peer_info.get("backend")]
    refused = set(refused)
    for path in paths:
        if path.name in offered and path.name not in refused and path.can_reach(peer_info):
            return path
    raise ValueError(f"no common data path: peer serves {offered}, this receiver {[p.name for p in paths]}")
