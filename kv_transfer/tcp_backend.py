"""TCP backend: a sender/receiver that speaks only the TCP data path.

The data path itself lives in :mod:`tcp_path` (every side speaks it, so a NIXL
side can still exchange blocks with a TCP-only peer). CPU memory only: a CUDA
pool needs the NIXL backend.
"""

from __future__ import annotations

from typing import Any

from .config import KVTransferConfig
from .layout import KVLayout
from .memory import KVRegion
from .receiver import ControlReceiver
from .sender import ControlSender


def _require_cpu(kv_cache: Any, layout: KVLayout) -> None:
    if KVRegion.from_buffer(kv_cache, layout).is_cuda:
        raise ValueError("the tcp backend moves CPU memory only; use backend='nixl' for CUDA KV")


class TcpSender(ControlSender):
    """Serves granted blocks over the receiver's TCP connection."""

    backend_name = "tcp"
    modes = ("tcp",)

    def __init__(self, kv_cache: Any, layout: KVLayout, config: KVTransferConfig) -> None:
        _require_cpu(kv_cache, layout)
        super().__init__(kv_cache, layout, config)


class TcpReceiver(ControlReceiver):
    """Receives granted blocks straight into the local KV pool."""

    backend_name = "tcp"
    modes = ("tcp",)

    def __init__(self, kv_cache: Any, layout: KVLayout, config: KVTransferConfig) -> None:
        _require_cpu(kv_cache, layout)
        super().__init__(kv_cache, layout, config)
