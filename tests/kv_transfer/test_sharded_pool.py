"""A tensor-parallel worker's KV pool (kv_transfer/sharded.py) between peers of any TP size, and a
pipeline-parallel one (shards by layer range) between peers of any PP size and split.

The sender's pool is p shards of 6/p KV heads, the receiver's d shards of 6/d; the pull goes over the real
TCP sides (staged: the sender gathers each block's heads from its shards, the receiver scatters them into
its own), through the socket or through shared staging buffers, and the receiver's blocks must equal the
sender's head for head while the blocks it did not pull stay untouched. The same for layer shards, sender
and receiver split differently (and one of them not at all), and between layer-split, head-split and
(stage x rank)-split pools: on the wire a block is the whole block either way.
"""
import pytest
import torch

from kv_transfer import BackendUnavailableError, KVLayout, KVTransferConfig, TransferState, make_receiver, make_sender
from kv_transfer.sharded import ShardedKV, region_of

HEADS, BLOCKS = 6, 12


def pool(num_shards: int, seed: int | None) -> ShardedKV:
    """A pool of HEADS KV heads split over `num_shards` tensors (random, or zeros with seed None)."""
    shape = (BLOCKS, 3, 2, 4, HEADS // num_shards, 8)
    gen = torch.Generator().manual_seed(seed or 0)
    make = (lambda: torch.randn(shape, generator=gen).to(torch.bfloat16)) if seed is not None else \
        (lambda: torch.zeros(shape, dtype=torch.bfloat16))
    return ShardedKV([make() for _ in range(num_shards)])


def whole(p: ShardedKV) -> torch.Tensor:
    return torch.cat(p.shards, dim=4)


def test_sharded_pool_reads_as_whole_blocks():
    p = pool(3, seed=1)
    layout = KVLayout.of_kv_cache(p, "m")
    assert layout.num_kv_heads == HEADS and layout.dtype == "bfloat16" and layout.device == "cpu"
    assert layout == KVLayout.of_kv_cache(whole(p), "m")  # same wire layout (and hash) as one unsharded pool
    region = region_of(p, layout)
    assert region.sharded and not region.is_host and region.num_blocks == BLOCKS
    assert [p.head_range(r) for r in range(3)] == [(0, 2), (2, 4), (4, 6)]
    with pytest.raises(ValueError, match="differs from shard 0"):
        ShardedKV([torch.zeros(2, 1, 2, 4, 2, 8), torch.zeros(2, 1, 2, 4, 3, 8)])
    with pytest.raises(ValueError, match="does not match layout"):
        region_of(p, KVLayout("m", "bfloat16", 4, 3, HEADS + 1, 8))


@pytest.mark.parametrize("p,d", [(2, 1), (1, 2), (2, 3), (3, 2), (2, 2)])
@pytest.mark.parametrize("shared_staging", [True, False], ids=["shm", "socket"])
def test_pull_between_tensor_parallel_sizes(p, d, shared_staging):
    src, dst = pool(p, seed=p * 10 + d), pool(d, seed=None)
    src_whole = whole(src)
    src_pool = src if p > 1 else src.shards[0]
    dst_pool = dst if d > 1 else dst.shards[0]
    layout = KVLayout.of_kv_cache(src, "m")
    config = KVTransferConfig(backend="auto", host="127.0.0.1", staging_shm=shared_staging,
                              staging_chunk_bytes=3 * layout.block_nbytes)  # several batches per pull
    remote, local = [7, 2, 3, 4, 11], [0, 5, 6, 9, 1]
    with make_sender(src_pool, layout, config) as sender, make_receiver(dst_pool, layout, config) as receiver:
        for side, shards in ((sender, p), (receiver, d)):
            if shards > 1:
                assert side.backend_name == "tcp-staged" and "tensor-parallel" in side.selection_reason
        lease = sender.expect("r", remote, timeout_s=30)
        pull = receiver.read(sender.peer_info(), "r", remote, local, timeout_s=30, capability=lease.capability)
        assert pull.wait(30) == TransferState.DONE, pull.error
        assert lease.wait(10) == TransferState.DONE
        assert pull.bytes_moved == len(remote) * layout.block_nbytes
    got = whole(dst)
    assert torch.equal(got[local], src_whole[remote])
    untouched = [b for b in range(BLOCKS) if b not in local]
    assert not got[untouched].any()


LAYERS = 5


def layer_pool(split: tuple[int, ...], seed: int | None) -> ShardedKV | torch.Tensor:
    """A pool of LAYERS layers split into stages of `split` layers (one stage: a plain tensor)."""
    gen = torch.Generator().manual_seed(seed or 0)
    shards = [torch.randn((BLOCKS, n, 2, 4, HEADS, 8), generator=gen).to(torch.bfloat16) if seed is not None
              else torch.zeros((BLOCKS, n, 2, 4, HEADS, 8), dtype=torch.bfloat16) for n in split]
    return ShardedKV(shards, stages=len(split)) if len(split) > 1 else shards[0]


def whole_of(p) -> torch.Tensor:
    if not isinstance(p, ShardedKV):
        return p
    n = p.ranks_per_stage
    return torch.cat([torch.cat(p.shards[s * n:(s + 1) * n], dim=4) for s in range(p.stages)], dim=1)


def grid_pool(split: tuple[int, ...], ranks: int) -> ShardedKV:
    """Zeros: stages of `split` layers, each of `ranks` tensor-parallel ranks (HEADS / ranks heads each)."""
    return ShardedKV([torch.zeros((BLOCKS, n, 2, 4, HEADS // ranks, 8), dtype=torch.bfloat16)
                      for n in split for _ in range(ranks)], stages=len(split))


@pytest.mark.parametrize("src_split,dst", [((2, 3), (5,)), ((5,), (1, 4)), ((2, 3), (3, 1, 1)), ((1, 4), "tp2"),
                                           ((2, 3), "pp2xtp3")])
def test_pull_between_pipeline_splits(src_split, dst):
    src = layer_pool(src_split, seed=3)
    dst_pool = {"tp2": lambda: grid_pool((LAYERS,), 2), "pp2xtp3": lambda: grid_pool((4, 1), 3)}.get(
        dst, lambda: layer_pool(dst, seed=None))()
    layout = KVLayout.of_kv_cache(src, "m")
    assert layout == KVLayout.of_kv_cache(whole_of(src), "m") == KVLayout.of_kv_cache(dst_pool, "m")
    config = KVTransferConfig(backend="auto", host="127.0.0.1", staging_chunk_bytes=2 * layout.block_nbytes)
    remote, local = [7, 2, 3, 11], [0, 5, 6, 1]
    with make_sender(src, layout, config) as sender, make_receiver(dst_pool, layout, config) as receiver:
        lease = sender.expect("r", remote, timeout_s=30)
        pull = receiver.read(sender.peer_info(), "r", remote, local, timeout_s=30, capability=lease.capability)
        assert pull.wait(30) == TransferState.DONE, pull.error
    got = whole_of(dst_pool)
    assert torch.equal(got[local], whole_of(src)[remote])
    assert not got[[b for b in range(BLOCKS) if b not in local]].any()
    with pytest.raises(ValueError, match="differs from shard 0"):  # stages differ only in their layer count
        ShardedKV([torch.zeros(2, 1, 2, 4, 2, 8), torch.zeros(2, 2, 2, 4, 3, 8)], stages=2)
    with pytest.raises(ValueError, match="differs from shard 0"):  # the ranks of one stage hold the same layers
        ShardedKV([torch.zeros(2, 1, 2, 4, 2, 8), torch.zeros(2, 2, 2, 4, 2, 8)])
    grid = grid_pool((2, 3), 3)
    assert grid.shape == (BLOCKS, 5, 2, 4, HEADS, 8) and grid.kind == "tensor-parallel and pipeline-parallel"
    assert (grid.layer_range(4), grid.head_range(4)) == ((2, 5), (2, 4))  # stage 1, rank 1


def test_sharded_pool_refuses_nixl_by_name():
    p = pool(2, seed=3)
    with pytest.raises(BackendUnavailableError, match="tensor-parallel"):
        make_sender(p, KVLayout.of_kv_cache(p, "m"), KVTransferConfig(backend="nixl", host="127.0.0.1"))
