"""A pool split by layer over senders on several nodes (kv_transfer/layer_split.py): each stage's sender serves
its own layer range, the receiver pulls every range from its stage in parallel into the layers it covers of its
own blocks (a whole pool, a tensor-parallel one, or a pipeline-parallel one split elsewhere).

Here the stages' senders are real TCP senders in this process (each its own port, as on its own node); the
stage wrapper does what the engine's link to a remote stage does (engine/parallel/remote_stages.py).
"""
import dataclasses

import pytest
import torch

from kv_transfer import KVLayout, KVTransferConfig, TransferState, make_receiver, make_sender
from kv_transfer.layer_split import LayerSplitReceiver, LayerSplitSender, StagedTransfer, check_stages
from kv_transfer.sharded import ShardedKV

HEADS, BLOCKS, LAYERS = 4, 10, 5
CONFIG = KVTransferConfig(backend="tcp", host="127.0.0.1", default_timeout_s=30)


class InProcessStage:
    """Another stage's sender as the first stage sees it."""

    def __init__(self, sender, first_layer: int) -> None:
        self.sender, self.first_layer, self.num_layers = sender, first_layer, sender.layout.num_layers

    def peer_info(self):
        return self.sender.peer_info()

    def expect(self, transfer_id, block_ids, timeout_s, capability):
        return self.sender.expect(transfer_id, block_ids, timeout_s, capability)


def stage_senders(split, seed=3):
    """One sender per stage over its layers of a random whole pool; returns (whole pool, LayerSplitSender)."""
    whole = torch.randn((BLOCKS, LAYERS, 2, 4, HEADS, 8), generator=torch.Generator().manual_seed(seed))
    base = KVLayout.of_kv_cache(whole, "m")
    senders, start = [], 0
    for n in split:
        part = whole[:, start:start + n].contiguous()
        senders.append(make_sender(part, dataclasses.replace(base, num_layers=n, first_layer=start), CONFIG))
        start += n
    return whole, LayerSplitSender(senders[0], [InProcessStage(s, s.layout.first_layer) for s in senders[1:]]), \
        senders


def receiver_pool(kind):
    zeros = lambda n, h: torch.zeros((BLOCKS, n, 2, 4, h, 8))  # noqa: E731
    if kind == "whole":
        return zeros(LAYERS, HEADS)
    if kind == "tp2":
        return ShardedKV([zeros(LAYERS, HEADS // 2) for _ in range(2)])
    return ShardedKV([zeros(1, HEADS), zeros(4, HEADS)], stages=2)  # "pp2": split elsewhere than the sender


def whole_of(pool):
    if not isinstance(pool, ShardedKV):
        return pool
    if pool.stages > 1:
        return torch.cat(pool.shards, dim=1)
    return torch.cat(pool.shards, dim=4)


@pytest.mark.parametrize("split,kind", [((2, 3), "whole"), ((3, 1, 1), "tp2"), ((2, 3), "pp2")])
def test_each_stage_serves_its_layers_and_the_receiver_pulls_them_all(split, kind):
    whole, sender, senders = stage_senders(split)
    pool = receiver_pool(kind)
    receiver = LayerSplitReceiver(pool, KVLayout.of_kv_cache(pool, "m"), CONFIG, make_receiver)
    remote, local = [7, 2, 3], [0, 5, 9]
    try:
        info = sender.peer_info()
        assert [(s["first_layer"], s["num_layers"]) for s in info["stages"]] == list(
            zip([sum(split[:i]) for i in range(len(split))], split, strict=True))
        assert len({s["peer"]["port"] for s in info["stages"]}) == len(split)  # a sender (link) per stage
        lease = sender.expect("r", remote, timeout_s=30)
        assert isinstance(lease, StagedTransfer) and len({p.capability for p in lease.pieces}) == 1
        pull = receiver.read(info, "r", remote, local, timeout_s=30, capability=lease.capability)
        assert pull.wait(30) == TransferState.DONE, pull.error
        assert lease.wait(10) == TransferState.DONE
        layer_bytes = KVLayout.of_kv_cache(whole, "m").block_nbytes // LAYERS
        for s, n in zip(senders, split, strict=True):  # each range crossed its own stage's link, once
            assert s.stats()["bytes_moved"] == len(remote) * n * layer_bytes
        got = whole_of(pool)
        assert torch.equal(got[local], whole[remote])
        assert not got[[b for b in range(BLOCKS) if b not in local]].any()
        assert receiver.stats()["in_flight"] == 0 and all(s.stats()["in_flight"] == 0 for s in senders)
    finally:
        receiver.close()
        for s in senders:
            s.close()


def test_a_stage_that_fails_fails_the_whole_transfer_and_frees_every_piece():
    whole, sender, senders = stage_senders((2, 3))
    receiver = LayerSplitReceiver(torch.zeros_like(whole), KVLayout.of_kv_cache(whole, "m"), CONFIG, make_receiver)
    try:
        lease = sender.expect("r", [1, 2], timeout_s=30)
        senders[1].close()  # the second stage's node is gone
        pull = receiver.read(sender.peer_info(), "r", [1, 2], [3, 4], timeout_s=30, capability=lease.capability)
        assert pull.wait(30) == TransferState.FAILED
        assert pull.error and all(p.state.is_terminal for p in pull.pieces)
        assert lease.poll() == TransferState.FAILED or lease.wait(10) == TransferState.FAILED
        assert receiver.stats()["in_flight"] == 0 and senders[0].stats()["in_flight"] == 0
    finally:
        receiver.close()
        senders[0].close()


def test_a_wrong_capability_is_refused_by_every_stage():
    whole, sender, senders = stage_senders((2, 3))
    receiver = LayerSplitReceiver(torch.zeros_like(whole), KVLayout.of_kv_cache(whole, "m"), CONFIG, make_receiver)
    try:
        lease = sender.expect("r", [1], timeout_s=30)
        pull = receiver.read(sender.peer_info(), "r", [1], [2], timeout_s=30, capability="0" * 32)
        assert pull.wait(30) == TransferState.FAILED
        assert not receiver.pool[2].any()
        lease.abort("test over")
        assert lease.state == TransferState.FAILED
    finally:
        receiver.close()
        for s in senders:
            s.close()


def test_stage_ranges_must_tile_the_model():
    assert check_stages([{"first_layer": 0, "num_layers": 2}, {"first_layer": 2, "num_layers": 3}], 5) == [
        (0, 2), (2, 5)]
    with pytest.raises(ValueError, match="do not continue"):
        check_stages([{"first_layer": 0, "num_layers": 2}, {"first_layer": 3, "num_layers": 2}], 5)
    with pytest.raises(ValueError, match="hold 4 layers"):
        check_stages([{"first_layer": 0, "num_layers": 4}], 5)
    with pytest.raises(ValueError, match="1 to"):
        check_stages([], 5)
