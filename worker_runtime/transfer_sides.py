"""A worker's two kv_transfer sides: a sender (the blocks it leases to others) and a receiver (the blocks it pulls).

Both roles open both: a prefill worker leases prompts to decode workers and pulls cached prefixes from
peers; a decode worker pulls prompts from prefill workers and leases its cached context to prefill workers
(router/README.md, "Peer prefix pulls"). The runtime sees one object (`backend_name`, `backend_info`,
`close`), as it did when a role had one side.
"""
from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from kv_transfer import KVReceiver, KVSender, make_receiver, make_sender
from kv_transfer.layer_split import LayerSplitReceiver, LayerSplitSender


class TransferSides:
    def __init__(self, sender: KVSender, receiver: KVReceiver) -> None:
        self.sender = sender
        self.receiver = receiver

    @property
    def backend_name(self) -> str:
        return self.sender.backend_name

    def backend_info(self) -> dict[str, str]:
        return self.sender.backend_info()

    def close(self) -> None:
        self.receiver.close()
        self.sender.close()


def open_sides(kv_cache: Any, layout: Any, kv_config: Any, stages: Sequence[Any] = ()) -> TransferSides:
    """Both sides over one KV pool (the sender closed again if the receiver fails). `stages`: the engine's
    pipeline stages on other nodes (`ModelRunner.remote_stages`), each opening a sender of its own layers
    there; the worker's sender then stands for all of them (kv_transfer/layer_split.py)."""
    sender = make_sender(kv_cache, layout, kv_config)
    try:
        if stages:
            for stage in stages:
                stage.open_sender(kv_config, layout)
            sender = LayerSplitSender(sender, stages)
        return TransferSides(sender, LayerSplitReceiver(kv_cache, layout, kv_config, make_receiver))
    except BaseException:
        sender.close()
        raise
