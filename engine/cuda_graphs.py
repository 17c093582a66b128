"""CUDA graphs for decode batches (vLLM's approach).

A decode step's shapes depend only on its batch size, so the whole forward
(embedding, every layer's matmuls and Triton kernels, the LM head) is captured
once per padded batch size into graphs sharing one memory pool. A step copies
its inputs into the static buffers, pads the rest of the batch (KV slot -1:
nothing written; context length 1), replays, and reads the first B rows of the
captured logits before the next replay reuses the pool. Prefill and mixed
steps run eagerly.
"""
from __future__ import annotations

import bisect
import logging
import time

import torch

from engine.attention import AttentionMetadata
from engine.varlen_inputs import VarlenStep

logger = logging.getLogger(__name__)


def capture_sizes(max_batch: int) -> list[int]:
    sizes = [b for b in (1, 2, 4, 8) if b <= max_batch]
    sizes += list(range(16, max_batch + 1, 16))
    if sizes[-1] != max_batch:
        sizes.append(max_batch)
    return sizes


class DecodeGraphs:
    def __init__(self, model, kv_cache: torch.Tensor, max_batch: int, max_blocks_per_seq: int) -> None:
        device = kv_cache.device
        self.model = model
        self.kv_cache = kv_cache
        self.sizes = capture_sizes(max_batch)
        self.input_ids = torch.zeros(max_batch, dtype=torch.int32, device=device)
        self.positions = torch.zeros(max_batch, dtype=torch.int32, device=device)
        self.slot_mapping = torch.full((max_batch,), -1, dtype=torch.int32, device=device)
        self.seq_lens = torch.ones(max_batch, dtype=torch.int32, device=device)
        self.block_tables = torch.zeros(max_batch, max_blocks_per_seq, dtype=torch.int32, device=device)
        self.cu_q = torch.arange(max_batch + 1, dtype=torch.int32, device=device)
        self.rows = torch.arange(max_batch, dtype=torch.int32, device=device)
        self.graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self._capture()

    def _forward(self, batch: int) -> torch.Tensor:
        meta = AttentionMetadata(slot_mapping=self.slot_mapping[:batch], cu_q=self.cu_q[:batch + 1],
                                 seq_lens=self.seq_lens[:batch], block_tables=self.block_tables[:batch],
                                 max_query_len=1)
        return self.model.forward(self.input_ids[:batch], self.positions[:batch], self.kv_cache, meta,
                                  self.rows[:batch])

    @torch.inference_mode()
    def _capture(self) -> None:
        start = time.perf_counter()
        pool = torch.cuda.graph_pool_handle()
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for batch in reversed(self.sizes):
                self._forward(batch)  # compiles kernels and warms the allocator outside the graph
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=pool, stream=stream):
                    logits = self._forward(batch)
                self.graphs[batch] = (graph, logits)
        torch.cuda.current_stream().wait_stream(stream)
        torch.cuda.synchronize()
        logger.info("captured %d decode graphs (batch 1..%d) in %.1f s", len(self.sizes), self.sizes[-1],
                    time.perf_counter() - start)

    def can_run(self, step: VarlenStep) -> bool:
        return 0 < step.num_decode_only <= self.sizes[-1] and \
            step.meta.block_tables.shape[1] <= self.block_tables.shape[1]

    def run(self, step: VarlenStep) -> torch.Tensor:
        n = step.num_decode_only
        batch = self.sizes[bisect.bisect_left(self.sizes, n)]
        meta = step.meta
        self.input_ids[:n].copy_(step.input_ids)
        self.positions[:n].copy_(step.positions)
        self.slot_mapping[:n].copy_(meta.slot_mapping)
        self.seq_lens[:n].copy_(meta.seq_lens)
        self.block_tables[:n, :meta.block_tables.shape[1]].copy_(meta.block_tables)
        if batch > n:
            self.slot_mapping[n:batch].fill_(-1)
            self.seq_lens[n:batch].fill_(1)
        graph, logits = self.graphs[batch]
        graph.replay()
        return logits[:n]
