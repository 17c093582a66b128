"""TCP backend: a sender/receiver that speaks only the TCP data path.

The data path itself lives in :mod:`tcp_path` (every side speaks it, so a NIXL
side can still exchange blocks with a TCP-only peer). Any pool: host memory
goes to the socket directly, CUDA memory through pinned host staging buffers
(:mod:`staging`); such a side reports ``backend_name == "tcp-staged"``.
"""

from __future__ import annotations

from typing import Any

from .config import KVTransferConfig
from .layout import KVLayout
from .receiver import ControlReceiver
from .sender import ControlSender


class TcpSender(ControlSender):
    """Serves granted blocks over the receiver's TCP connection."""

    backend_name = "tcp"
    modes = ("tcp",)

    def __init__(self, kv_cache: Any, layout: KVLayout, config: KVTransferConfig) -> None:
        super().__init__(kv_cache, layout, config)
        if self.staging is not None:
            self.backend_name = "tcp-staged"


class TcpReceiver(ControlReceiver):
    """Receives granted blocks into the local KV pool (directly, or via staging buffers)."""

    backend_name = "tcp"
    modes = ("tcp",)

    def __init__(self, kv_cache: Any, layout: KVLayout, config: KVTransferConfig) -> None:
        super().__init__(kv_cache, layout, config)
        if self.staging is not None:
            self.backend_name = "tcp-staged"
