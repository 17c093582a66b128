"""What the two halves of the control protocol share: the pool, the config, TLS and the data paths.

A side holds its data paths preferred first (:mod:`data_path`): CUDA IPC when this pool can use it,
the native path it was built for (NIXL) if any, and TCP, which every side speaks, last. Its
``modes`` are their wire names; its ``backend_name`` is the native path's, else TCP's (``"tcp"`` or
``"tcp-staged"``). :class:`~kv_transfer.sender.ControlSender` and
:class:`~kv_transfer.receiver.ControlReceiver` add the protocol itself.
"""

from __future__ import annotations

import abc
import ssl
from typing import Any

from .base import KVSide
from .config import KVTransferConfig
from .data_path import DataPath
from .layout import KVLayout
from .sharded import region_of
from .transfer import TransferTable


class ControlSide(KVSide):
    """The pool, config, TLS context and data paths of a sender or receiver."""

    #: ``"sender"`` (the TLS server) or ``"receiver"``.
    role: str = ""
    paths: list[DataPath]
    """Data paths, preferred first; TCP, which every side speaks, last."""
    _table: TransferTable

    def __init__(self, kv_cache: Any, layout: KVLayout, config: KVTransferConfig,
                 native: DataPath | None = None) -> None:
        """``native``: the path this side was built for besides TCP (a NIXL side's); the side owns it,
        and closes it also when this constructor fails."""
        self.config = config
        self.layout = layout
        try:
            self.region = region_of(kv_cache, layout)
            #: This side of the links' TLS (None: plaintext).
            self.tls: ssl.SSLContext | None = (config.tls.context(server_side=self.role == "sender")
                                               if config.tls is not None else None)
            self.paths = self._make_paths(native)
        except BaseException:
            if native is not None:
                native.close()
            raise
        self.backend_name = native.name if native is not None else self.paths[-1].label
        self._closed = False

    @abc.abstractmethod
    def _make_paths(self, native: DataPath | None) -> list[DataPath]:
        """This side's data paths, preferred first, ``native`` among them, TCP last."""

    @property
    def modes(self) -> tuple[str, ...]:
        """The wire names of the data paths, preferred first."""
        return tuple(p.name for p in self.paths)

    def path_named(self, name: object) -> DataPath | None:
        """The data path called ``name`` on the wire, or None."""
        return next((p for p in self.paths if p.name == name), None)

    def _path_stats(self) -> dict[str, int]:
        stats: dict[str, int] = {}
        for path in self.paths:
            stats.update(path.stats())
        return stats

    def _stats(self, **own: int) -> dict[str, int]:
        """The counters every side has, ``own`` and the data paths'."""
        return {
            "in_flight": len(self._table),
            **own,
            "bytes_moved": self._table.bytes_moved,
            "transfers_done": self._table.num_done,
            "transfers_failed": self._table.num_failed,
            "registered_regions": 0,
            **self._path_stats(),
        }

    def _close_paths(self) -> None:
        for path in self.paths:
            path.close()
