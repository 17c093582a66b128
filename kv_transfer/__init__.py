"""kv_transfer: move a prompt's KV blocks from a prefill engine to a decode engine.

See README.md in this folder. Entry points: :func:`make_sender`,
:func:`make_receiver`, :class:`KVLayout`, :class:`KVTransferConfig`.
"""

from .base import KVReceiver, KVSender
from .config import KVTransferConfig
from .errors import BackendUnavailableError, IncompatiblePeerError, KVTransferError, TransferRefusedError
from .factory import make_receiver, make_sender
from .layout import PROTOCOL_VERSION, KVLayout
from .state import TransferState
from .tls import KVTLSFiles
from .transfer import Transfer

__all__ = [
    "BackendUnavailableError", "IncompatiblePeerError", "KVLayout", "KVReceiver", "KVSender", "KVTLSFiles",
    "KVTransferConfig", "KVTransferError", "PROTOCOL_VERSION", "Transfer", "TransferRefusedError",
    "TransferState", "make_receiver", "make_sender",
]
