"""Backend selection: ``make_sender`` / ``make_receiver``.

A side is a :class:`~kv_transfer.sender.ControlSender` or :class:`~kv_transfer.receiver.ControlReceiver`
whose native data path is NIXL's (:mod:`nixl_path`) or none (TCP only; see :mod:`control_side`).
``backend="auto"`` builds the NIXL side when nixl imports and a loopback
self-test transfer on that very agent succeeds; otherwise it falls back to TCP,
which moves any pool (CUDA KV through pinned host staging buffers), so ``auto``
never refuses a pool. The decision itself is :func:`select_backend` (pure); the
choice and its reason are logged at INFO and kept in ``.selection`` /
``.selection_reason`` (``backend_info()``).
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Any

from .base import KVReceiver, KVSender
from .config import KVTransferConfig
from .control_side import ControlSide
from .errors import BackendUnavailableError
from .layout import KVLayout
from .memory import KVRegion
from .nixl_path import NixlPullPath, NixlSendPath
from .receiver import ControlReceiver
from .sender import ControlSender
from .sharded import region_of

logger = logging.getLogger("pdserve.kv_transfer")


@dataclasses.dataclass(frozen=True)
class Selection:
    """Outcome of :func:`select_backend`."""

    backend: str
    """``"nixl"`` or ``"tcp"``."""
    staged: bool
    """TCP through host staging buffers (device memory, or ``staging="always"``)."""
    reason: str
    """Why, for logs and the ``kv_transfer_backend_info`` metric."""

    @property
    def label(self) -> str:
        """``"nixl"``, ``"tcp"`` or ``"tcp-staged"`` (the side's ``backend_name``)."""
        return "tcp-staged" if self.backend == "tcp" and self.staged else self.backend


def select_backend(requested: str, device: str, nixl_problem: str | None,
                   nixl_reason: str = "nixl imports and its loopback self-test transfer succeeded",
                   staging: str = "auto", sharded: bool = False) -> Selection:
    """The data path of a side whose pool lives on ``device`` (``"cpu"``/``"cuda"``).

    ``nixl_problem`` is None when a NIXL side was built (and passed its self-test,
    if asked), else why not; it is ignored when ``requested == "tcp"``. ``sharded``: a
    tensor-parallel or pipeline-parallel worker's pool (:mod:`~kv_transfer.sharded`), which only TCP moves. Raises
    :class:`BackendUnavailableError` only when NIXL was requested and cannot run.
    """
    staged = staging == "always" or device != "cpu" or sharded
    how = ""
    if sharded:
        how = ("; each block's KV is gathered from (scattered to) the tensor-parallel ranks or pipeline stages in "
               "staging buffers")
    elif device != "cpu":
        how = f"; {device.upper()} KV moves through pinned host staging buffers"
    elif staged:
        how = "; host KV staged through host buffers (staging='always')"
    if requested == "tcp":
        return Selection("tcp", staged, "requested by config" + how)
    if nixl_problem is None:
        return Selection("nixl", False, "requested by config" if requested == "nixl" else nixl_reason)
    if requested == "nixl":
        raise BackendUnavailableError(nixl_problem)
    return Selection("tcp", staged, nixl_problem + how)


def make_sender(kv_cache: Any, layout: KVLayout,
                config: KVTransferConfig | None = None) -> KVSender:
    """Sender (prefill side) over ``kv_cache`` with the configured backend."""
    return _make("sender", kv_cache, layout, config or KVTransferConfig())


def make_receiver(kv_cache: Any, layout: KVLayout,
                  config: KVTransferConfig | None = None) -> KVReceiver:
    """Receiver (decode side) over ``kv_cache`` with the configured backend."""
    return _make("receiver", kv_cache, layout, config or KVTransferConfig())


#: ``(side, its NIXL path)`` per role.
_CLASSES = {"sender": (ControlSender, NixlSendPath), "receiver": (ControlReceiver, NixlPullPath)}


def _make(role: str, kv_cache: Any, layout: KVLayout, config: KVTransferConfig) -> KVSender | KVReceiver:
    region = region_of(kv_cache, layout)  # a bad pool is the caller's error
    device = region.device
    side, problem, reason = None, None, ""
    if region.sharded:
        problem = (f"nixl not used: a {kv_cache.kind} pool ({kv_cache.num_shards} ranks' KV) is no single memory "
                   "region to register")
    elif config.backend != "tcp":
        side, problem, reason = _try_nixl(role, kv_cache, layout, region, config)
    selection = select_backend(config.backend, device, problem, reason, config.staging, region.sharded)
    if selection.backend == "tcp":
        side = _CLASSES[role][0](kv_cache, layout, config)
    side.selection_reason = selection.reason
    side.selection = f"{side.backend_name}: {selection.reason}"
    logger.info("kv_transfer %s: backend %s (%s)", role, side.backend_name, selection.reason)
    return side


def _try_nixl(role: str, kv_cache: Any, layout: KVLayout, region: KVRegion,
              config: KVTransferConfig) -> tuple[ControlSide | None, str | None, str]:
    """Build (and with ``auto``, self-test) the NIXL side: ``(side, problem, reason)``.
    With ``backend="nixl"`` a NIXL side that cannot start raises instead."""
    requested = config.backend == "nixl"
    side_class, path_class = _CLASSES[role]
    try:
        path = path_class(region, config)  # the costly agent, before the side's port
        side = side_class(kv_cache, layout, config, native=path)
    except BackendUnavailableError as e:
        if requested:
            raise
        return None, f"nixl unavailable: {e}", ""
    except ValueError:
        raise  # a bad kv_cache/layout is the caller's error on any backend
    except Exception as e:
        if requested:
            raise BackendUnavailableError(f"nixl {role} could not start: {e!r}") from e
        return None, f"nixl {role} could not start: {e!r}", ""
    if requested or not config.nixl_self_test:
        return side, None, "nixl imports (self-test disabled)"
    try:
        path.self_test()
    except Exception as e:
        side.close()
        return None, f"nixl self-test failed: {e!r}", ""
    return side, None, "nixl imports and its loopback self-test transfer succeeded"
