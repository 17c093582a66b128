"""Owns the model weights and the KV tensor; turns a scheduled step into logits."""
from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from engine.attention import AttentionMetadata, PrefillSpan
from engine.attention.fp8_kv import FP8_DTYPE
from engine.config import DEFAULT_CPU_KV_CACHE_BYTES, EngineConfig
from engine.host_lists import on_device
from engine.kv_cache_manager import KVCacheManager
from engine.model.kv_scales import load_kv_scales
from engine.model.loader import load_model, resolve_dtype
from engine.model.model_config import ModelConfig
from engine.paged_inputs import PagedInputBuilder
from engine.parallel import shared_kv
from engine.parallel.pipeline import PendingLogits, PipelineStage
from engine.parallel.tp_group import TPGroup
from engine.scheduler import SchedulerOutput
from engine.varlen_inputs import VarlenInputBuilder

logger = logging.getLogger(__name__)


@dataclass
class PendingInputs:
    """Async scheduling: step inputs that are tokens the step before sampled, known only on the device yet."""

    positions: list[int]
    """Where in the step's packed input ids each one goes."""
    token_ids: torch.Tensor
    """The step before's sampled tokens (`Draw.token_ids`), on the device."""
    rows: list[int]
    """Which of them each position takes."""

    def write(self, input_ids: torch.Tensor) -> None:
        """Queue the copies on the device (after the step before's sampling, before this step's forward)."""
        index = on_device([self.rows, self.positions], input_ids.device)
        input_ids[index[1]] = self.token_ids[index[0]].to(input_ids.dtype)


def kv_block_bytes(model: ModelConfig, block_size: int, dtype: torch.dtype, num_layers: int | None = None) -> int:
    """Bytes of one block: K and V of every layer (or of `num_layers`: a pipeline stage's) for block_size tokens."""
    itemsize = torch.empty((), dtype=dtype).element_size()
    layers = model.num_layers if num_layers is None else num_layers
    return layers * 2 * block_size * model.num_kv_heads * model.head_dim * itemsize


class ModelRunner:
    def __init__(self, config: EngineConfig, model_path, model_config: ModelConfig, max_model_len: int,
                 tp: TPGroup | None = None, stage: PipelineStage | None = None) -> None:
        """With `tp` (tensor parallelism), this rank's shard of the weights and of the KV heads; with `stage`
        (pipeline parallelism), that stage's layers and the KV of those layers. Every rank or stage builds
        its runner at the same time (they agree on the number of KV blocks)."""
        self.config = config
        self.device = torch.device(config.device)
        self.dtype = resolve_dtype(config.dtype, model_config)
        self.block_size = config.cache.block_size
        self.model = load_model(model_path, model_config, self.dtype, self.device,
                                config.attention_backend, max_model_len, config.quantization, tp, stage)
        self.tp = tp
        self.stage = stage
        self.peers = None
        """Rank 0 of a tensor-parallel engine: the executor that runs each forward on the other ranks too."""
        model_config = self.model.config  # this rank's heads
        self.varlen = VarlenInputBuilder(self.block_size, self.device) if self.model.attention.varlen else None
        self.paged = None if self.varlen is not None else PagedInputBuilder(self.block_size, self.device)
        self.kv_dtype = self._kv_dtype(model_path, model_config)
        num_layers = len(self.model.layers)  # a pipeline stage's KV holds its own layers only
        block_bytes = kv_block_bytes(model_config, self.block_size, self.kv_dtype, num_layers)
        self.num_blocks = config.cache.num_blocks or max(1, self._kv_cache_bytes(model_config) // block_bytes)
        groups = [g for g in (tp, stage.group if stage is not None else None) if g is not None]
        for group in groups:  # every rank of its stage, then every stage: the smallest of all
            self.num_blocks = group.min(self.num_blocks)
        kv_shape = (self.num_blocks, num_layers, 2, self.block_size, model_config.num_kv_heads, model_config.head_dim)
        self.kv_export = None
        """Ranks (and stages) 1.. of a parallel engine: the handle rank 0 maps this rank's KV cache with."""
        if any(g.rank > 0 for g in groups):
            self.kv_cache, self._kv_memory = shared_kv.allocate(kv_shape, self.kv_dtype, self.device)
            self.kv_export = shared_kv.export(self.kv_cache, self._kv_memory)
        else:
            self.kv_cache = torch.zeros(kv_shape, dtype=self.kv_dtype, device=self.device)
        logger.info("KV cache: %d blocks x %d tokens (%.1f MiB, %d bytes per block, %s, %s)", self.num_blocks,
                    self.block_size, self.num_blocks * block_bytes / 2**20, block_bytes, self.kv_dtype, self.device)
        self.graphs = None
        self.num_graph_steps = 0
        """Steps replayed from a captured decode graph (the rest ran eagerly)."""
        if self.device.type == "cuda" and config.cuda_graphs and self.varlen is not None and not groups:
            from engine.cuda_graphs import DecodeGraphs
            self.graphs = DecodeGraphs(self.model, self.kv_cache, config.scheduler.max_num_seqs,
                                       -(-max_model_len // self.block_size))

    def _kv_dtype(self, model_path, model_config: ModelConfig) -> torch.dtype:
        """The KV cache's element type; for fp8, also hands the model its per-layer scales."""
        if not self.config.cache.fp8_kv:
            return self.dtype
        if not self.model.attention.supports_fp8_kv:
            raise ValueError(f"kv_cache_dtype={self.config.cache.kv_cache_dtype!r}: the "
                             f"{type(self.model.attention).__name__} attention backend cannot read an fp8 KV cache "
                             f"on {self.device.type}")
        self.model.kv_scales = load_kv_scales(model_path, model_config.num_layers)
        return FP8_DTYPE

    @property
    def kv_scales(self) -> list[tuple[float, float]] | None:
        """(k_scale, v_scale) per layer of an fp8 cache; None when K/V are kept in the model's dtype."""
        return self.model.kv_scales if self.kv_dtype == FP8_DTYPE else None

    def _kv_cache_bytes(self, model_config: ModelConfig) -> int:
        """The configured budget; on CUDA without one, what gpu_memory_utilization leaves
        after the weights and the activation peak of the largest step (profiled), as vLLM sizes it."""
        if self.config.cache.kv_cache_memory_bytes is not None:
            return self.config.cache.kv_cache_memory_bytes
        if self.device.type != "cuda":
            return DEFAULT_CPU_KV_CACHE_BYTES
        torch.cuda.synchronize(self.device)
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(self.device)
        before = torch.cuda.memory_allocated(self.device)
        self._profile_run(model_config)
        peak = torch.cuda.max_memory_allocated(self.device) - before
        torch.cuda.empty_cache()
        free, total = torch.cuda.mem_get_info(self.device)
        budget = int(total * self.config.cache.gpu_memory_utilization) - (total - free) - peak
        logger.info("GPU memory: %.1f GiB total, %.1f GiB in use (weights and others), activation peak %.2f GiB; "
                    "KV cache gets %.1f GiB", total / 2**30, (total - free) / 2**30, peak / 2**30, budget / 2**30)
        if budget <= 0:
            raise MemoryError(f"no GPU memory left for the KV cache at gpu_memory_utilization="
                              f"{self.config.cache.gpu_memory_utilization}")
        return budget

    def _profile_run(self, model_config: ModelConfig) -> None:
        """One forward of a full token budget (one sequence), sampling max_num_seqs rows of logits."""
        sched = self.config.scheduler
        tokens = min(sched.max_num_batched_tokens, self.model.rotary.cos.shape[0])
        self.forward_prompt(torch.zeros(tokens, dtype=torch.long, device=self.device),
                            torch.arange(tokens - min(tokens, sched.max_num_seqs), tokens, device=self.device))
        torch.cuda.synchronize(self.device)

    @torch.inference_mode()
    def forward_prompt(self, token_ids: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
        """Logits of `rows` of one prompt, prefilled whole into a scratch cache of its own (the engine's
        KV is untouched): memory profiling, and scoring a text position by position."""
        if self.peers is not None:
            self.peers.send(("prompt", token_ids, rows))
        model_config = self.model.config
        tokens = token_ids.shape[0]
        blocks = -(-tokens // self.block_size)
        cache = torch.zeros((blocks, len(self.model.layers), 2, self.block_size, model_config.num_kv_heads,
                             model_config.head_dim), dtype=self.kv_dtype, device=self.device)
        dev = self.device
        positions = torch.arange(tokens, device=dev)
        meta = AttentionMetadata(slot_blocks=positions // self.block_size, slot_offsets=positions % self.block_size,
                                 slot_mapping=positions.to(torch.int32),
                                 cu_q=torch.tensor([0, tokens], dtype=torch.int32, device=dev),
                                 seq_lens=torch.tensor([tokens], dtype=torch.int32, device=dev),
                                 block_tables=torch.arange(blocks, dtype=torch.int32, device=dev)[None],
                                 max_query_len=tokens,
                                 prefills=[PrefillSpan(0, tokens, 0, torch.arange(blocks, device=dev))])
        return self._forward(token_ids.to(dev), positions, cache, meta, rows.to(dev))

    @torch.inference_mode()
    def execute(self, out: SchedulerOutput, kv: KVCacheManager, whole_rows: torch.Tensor | None = None,
                defer: bool = False, pending: PendingInputs | None = None) -> torch.Tensor | PendingLogits:
        """Run one step; return logits in scheduled order: one row per sampling request, 1 + K rows for a
        request verifying K proposed tokens. `whole_rows` (pipeline parallelism): per row, whether the sampler
        reads more than its argmax; the other rows come back as -inf but 0 at the argmax (only it crosses).
        `defer` (pipeline parallelism): return once this stage's part is sent on, the logits to come
        (`collect`, in launch order), so the next step can start here while the other stages work.
        `pending` (async scheduling): input tokens sampled by the step before, still on the device."""
        self._copy_blocks(out.block_copies)
        if self.varlen is not None:
            step = self.varlen.build(out, kv)
            if pending is not None:
                pending.write(step.input_ids)
            if self.graphs is not None and self.graphs.can_run(step):
                self.num_graph_steps += 1
                return self.graphs.run(step)
        else:
            step = self.paged.build(out, kv)
            if pending is not None:
                pending.write(step.input_ids)
        inputs = step.input_ids, step.positions, step.meta, step.logits_indices
        input_ids, positions, meta, logits_indices = inputs
        if self.peers is not None:
            self.peers.send(("step", out.block_copies, *inputs, whole_rows))
            with self.peers.watch():
                return self._forward(input_ids, positions, self.kv_cache, meta, logits_indices, whole_rows, defer)
        return self.model.forward(input_ids, positions, self.kv_cache, meta, logits_indices)

    def collect(self, logits: torch.Tensor | PendingLogits) -> torch.Tensor:
        """A step's logits: as `execute` returned them, or the last stage's, received now."""
        if not isinstance(logits, PendingLogits):
            return logits
        with self.peers.watch():
            return self.stage.recv_logits(logits.shape, logits.whole_rows, self.model.dtype, self.device)

    @torch.inference_mode()
    def run_step(self, block_copies, input_ids, positions, meta, logits_indices, whole_rows=None) -> torch.Tensor:
        """Another rank's (or pipeline stage's) share of rank 0's step: the same block copies and inputs."""
        self._copy_blocks(block_copies)
        return self._forward(input_ids, positions, self.kv_cache, meta, logits_indices, whole_rows)

    def _forward(self, input_ids, positions, kv_cache, meta, logits_indices, whole_rows=None,
                 defer: bool = False) -> torch.Tensor | PendingLogits:
        """The model's forward; on a pipeline stage its part of it: the hidden states from the stage before
        (none on the first), its layers, then on to the next stage, the last one's logits back to the first
        (which returns them; the other stages return what they sent). Of the logits only the argmax crosses for
        the rows `whole_rows` leaves out (None: every row whole)."""
        stage = self.stage
        if stage is None:
            return self.model.forward(input_ids, positions, kv_cache, meta, logits_indices)
        config, dtype = self.model.config, self.model.dtype
        hidden = None
        if not stage.is_first:  # the residual stream of every token of the step
            hidden = stage.recv(stage.rank - 1, (positions.shape[0], config.hidden_size), dtype, self.device)
        out = self.model.forward(input_ids, positions, kv_cache, meta, logits_indices, hidden)
        if not stage.is_last:
            stage.send(out, stage.rank + 1)
        elif not stage.is_first:
            stage.send_logits(out, whole_rows)
        if stage.is_first and not stage.is_last:  # the logits of the sampled rows
            shape = (logits_indices.shape[0], config.vocab_size)
            if defer:
                return PendingLogits(shape, whole_rows)
            return stage.recv_logits(shape, whole_rows, dtype, self.device)
        return out

    def kv_shards(self) -> list[torch.Tensor]:
        """Every rank's (or pipeline stage's) KV cache, rank order (rank 0's is this runner's): what the
        worker's KV transfer moves, kv_transfer.ShardedKV when there is more than one. One rank: [kv_cache]."""
        return [self.kv_cache] + (self.peers.kv_shards if self.peers is not None else [])

    @property
    def kv_stages(self) -> int:
        """Pipeline stages `kv_shards` spans (each a layer range; within a stage, its tensor-parallel ranks'
        head ranges, in rank order): those on this node."""
        return self.stage.size - len(self.remote_stages()) if self.stage is not None else 1

    def remote_stages(self) -> list:
        """The pipeline stages on other nodes (engine/parallel/remote_stages.py `RemoteStage`s), which serve
        the KV of their layers themselves; [] when every rank runs on this node."""
        return self.peers.remote_stages if self.peers is not None else []

    def _copy_blocks(self, block_copies) -> None:
        for src, dst in block_copies:
            self.kv_cache[dst].copy_(self.kv_cache[src])
