"""Backend selection: ``make_sender`` / ``make_receiver``.

``backend="auto"`` builds the NIXL side when nixl imports and a loopback
self-test transfer on that very agent succeeds; otherwise it falls back to TCP.
The choice and its reason are logged at INFO (and kept in ``.selection``).
"""

from __future__ import annotations

import logging
from typing import Any, Optional

from .base import KVReceiver, KVSender
from .config import KVTransferConfig
from .layout import KVLayout

logger = logging.getLogger("pdserve.kv_transfer")


def make_sender(kv_cache: Any, layout: KVLayout,
                config: Optional[KVTransferConfig] = None) -> KVSender:
    """Sender (prefill side) over ``kv_cache`` with the configured backend."""
    return _make("sender", kv_cache, layout, config or KVTransferConfig())


def make_receiver(kv_cache: Any, layout: KVLayout,
                  config: Optional[KVTransferConfig] = None) -> KVReceiver:
    """Receiver (decode side) over ``kv_cache`` with the configured backend."""
    return _make("receiver", kv_cache, layout, config or KVTransferConfig())


def _make(role: str, kv_cache: Any, layout: KVLayout, config: KVTransferConfig):
    from .tcp_backend import TcpReceiver, TcpSender
    if config.backend == "tcp":
        return _chosen(TcpSender if role == "sender" else TcpReceiver,
                       kv_cache, layout, config, "requested by config")
    from .errors import BackendUnavailableError
    try:
        from .nixl_backend import NixlReceiver, NixlSender
        side = (NixlSender if role == "sender" else NixlReceiver)(kv_cache, layout, config)
    except BackendUnavailableError as e:
        if config.backend == "nixl":
            raise
        return _chosen(TcpSender if role == "sender" else TcpReceiver,
                       kv_cache, layout, config, f"nixl unavailable: {e}")
    except ValueError:
        raise  # a bad kv_cache/layout is the caller's error on any backend
    except Exception as e:
        if config.backend == "nixl":
            raise BackendUnavailableError(f"nixl {role} could not start: {e!r}") from e
        return _chosen(TcpSender if role == "sender" else TcpReceiver,
                       kv_cache, layout, config, f"nixl {role} could not start: {e!r}")
    if config.backend == "nixl":
        side.selection = "nixl: requested by config"
        logger.info("kv_transfer %s: backend nixl (requested by config)", role)
        return side
    if config.nixl_self_test:
        try:
            side.self_test()
        except Exception as e:
            side.close()
            return _chosen(TcpSender if role == "sender" else TcpReceiver,
                           kv_cache, layout, config, f"nixl self-test failed: {e!r}")
        reason = "nixl imports and its loopback self-test transfer succeeded"
    else:
        reason = "nixl imports (self-test disabled)"
    side.selection = f"nixl: {reason}"
    logger.info("kv_transfer %s: backend nixl (%s)", role, reason)
    return side


def _chosen(cls, kv_cache: Any, layout: KVLayout, config: KVTransferConfig, reason: str):
    side = cls(kv_cache, layout, config)
    side.selection = f"{side.backend_name}: {reason}"
    logger.info("kv_transfer %s: backend %s (%s)", type(side).__name__, side.backend_name, reason)
    return side
