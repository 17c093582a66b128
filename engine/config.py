"""Engine configuration: one dataclass per concern, validated on construction."""
from __future__ import annotations

from dataclasses import dataclass, field, replace

from engine.kv_offload.config import OffloadConfig


def layer_counts(text: str) -> tuple[int, ...]:
    """`--pp-layer-partition`'s type: `10,11, 9` -> (10, 11, 9)."""
    try:
        return tuple(int(item) for item in text.split(",") if item.strip())
    except ValueError:
        raise ValueError(f"expected layer counts separated by commas (e.g. 10,11), got {text!r}") from None


DTYPES = ("auto", "float32", "bfloat16", "float16")
EXECUTOR_BACKENDS = ("mp", "ray")
ATTENTION_BACKENDS = ("auto", "torch", "triton", "flash")
SPECULATIVE_METHODS = ("ngram", "draft")
QUANTIZATIONS = ("int8", "fp8")
"""Weight quantization applied at load to an unquantized checkpoint (engine/model/quantization.py)."""
CHECKPOINT_QUANTIZATIONS = ("fp8", "mxfp4")
"""`quantization_config.quant_method`s of checkpoints loaded as they are; mxfp4 only for gpt-oss, whose
experts it holds (dequantised at load, engine/model/mxfp4.py)."""
KV_CACHE_DTYPES = ("auto", "fp8", "fp8_e4m3")
DEFAULT_CPU_KV_CACHE_BYTES = 2 << 30


@dataclass
class SchedulerConfig:
    max_num_batched_tokens: int = field(default=2048, metadata={
        "help": "token budget of one engine step (prefill chunks plus decode tokens)"})
    """Token budget of one engine step (prefill chunks plus decode tokens)."""
    max_num_seqs: int = field(default=256, metadata={"help": "most sequences running at once"})
    """Most sequences running at once."""

    def __post_init__(self) -> None:
        if self.max_num_batched_tokens < 1:
            raise ValueError("max_num_batched_tokens must be >= 1")
        if self.max_num_seqs < 1:
            raise ValueError("max_num_seqs must be >= 1")


@dataclass
class CacheConfig:
    block_size: int = field(default=16, metadata={"help": "tokens per KV block (a power of two)"})
    """Tokens per KV block."""
    kv_cache_memory_bytes: int | None = field(default=None, metadata={
        "flag": "--kv-cache-memory-gib", "unit": "GiB",
        "help": "KV cache size (default: 2 on CPU; on CUDA what --gpu-memory-utilization leaves)"})
    """Memory budget for the KV cache; the number of blocks is derived from it. None: on CUDA, what
    gpu_memory_utilization leaves after weights and the activation peak; on CPU, 2 GiB. With tensor
    parallelism, per rank (a rank's block holds only its KV heads, so N ranks hold N times the tokens)."""
    gpu_memory_utilization: float = field(default=0.9, metadata={
        "help": "CUDA: fraction of device memory for weights, activations and the KV cache"})
    """CUDA: the fraction of the device's memory this engine may use in all (weights, activations, KV)."""
    num_blocks: int | None = None
    """Exact number of KV blocks (overrides the memory budget; for tests)."""
    enable_prefix_caching: bool = field(default=True, metadata={
        "flag": "--no-prefix-caching", "help": "do not reuse the KV of prompt blocks shared with earlier prompts"})
    """Reuse KV of full blocks shared with earlier prompts."""
    kv_cache_dtype: str = field(default="auto", metadata={
        "choices": KV_CACHE_DTYPES,
        "help": "auto: the model's dtype; fp8: float8_e4m3 K/V with per-layer scales (half the bytes)"})
    """auto (the model's dtype) or fp8 / fp8_e4m3 (float8_e4m3fn with per-layer scales: half of bf16's bytes
    per block, so twice the blocks in one budget, at a small cost in precision)."""
    offload: OffloadConfig = field(default_factory=OffloadConfig, metadata={"group": "KV cache tiers"})
    """KV tiers below the pool: evicted prefix blocks kept in host memory and on local disk."""

    def __post_init__(self) -> None:
        if self.offload.enabled and not self.enable_prefix_caching:
            raise ValueError("KV offload keeps prefix-cache blocks: it needs prefix caching on")
        if self.block_size < 1 or self.block_size & (self.block_size - 1):
            raise ValueError("block_size must be a power of two")
        if self.kv_cache_memory_bytes is not None and self.kv_cache_memory_bytes <= 0:
            raise ValueError("kv_cache_memory_bytes must be > 0")
        if not 0 < self.gpu_memory_utilization <= 1:
            raise ValueError("gpu_memory_utilization must be in (0, 1]")
        if self.num_blocks is not None and self.num_blocks < 1:
            raise ValueError("num_blocks must be >= 1")
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(f"kv_cache_dtype must be one of {KV_CACHE_DTYPES}, got {self.kv_cache_dtype!r}")

    @property
    def fp8_kv(self) -> bool:
        """True when K/V are stored as float8_e4m3fn."""
        return self.kv_cache_dtype != "auto"


@dataclass
class SpeculativeConfig:
    """Speculative decoding (exact): a proposer guesses the next tokens, one target forward verifies them."""

    method: str | None = field(default=None, metadata={
        "flag": "--speculative-method", "choices": SPECULATIVE_METHODS,
        "help": "speculative decoding (exact): ngram (prompt lookup) or draft (--speculative-model)"})
    """None (off), ngram (prompt lookup in the sequence's own tokens) or draft (a smaller model)."""
    num_speculative_tokens: int = field(default=4, metadata={
        "help": "tokens proposed per sequence and step (K); a verifying step computes K + 1"})
    """Most tokens proposed per sequence and step (K); a verifying step computes K + 1 tokens."""
    model: str | None = field(default=None, metadata={
        "flag": "--speculative-model",
        "help": "draft checkpoint directory (same tokenizer as --model) for --speculative-method draft"})
    """draft: directory of the draft checkpoint (same tokenizer as the target)."""
    ngram_min: int = field(default=1, metadata={"help": "ngram: shortest suffix looked up"})
    """ngram: shortest suffix of the sequence looked up in its earlier tokens."""
    ngram_max: int = field(default=4, metadata={"help": "ngram: longest suffix looked up (tried first)"})
    """ngram: longest suffix tried first."""

    def __post_init__(self) -> None:
        if self.method is not None and self.method not in SPECULATIVE_METHODS:
            raise ValueError(f"speculative method must be one of {SPECULATIVE_METHODS}, got {self.method!r}")
        if not 1 <= self.num_speculative_tokens <= 64:
            raise ValueError("num_speculative_tokens must be in [1, 64]")
        if not 1 <= self.ngram_min <= self.ngram_max:
            raise ValueError("need 1 <= ngram_min <= ngram_max")
        if self.method == "draft" and not self.model:
            raise ValueError("speculative method 'draft' needs a draft model (speculative_model)")
        if self.method != "draft" and self.model:
            raise ValueError("a speculative model is only used with method 'draft'")

    @property
    def enabled(self) -> bool:
        return self.method is not None


@dataclass
class EngineConfig:
    model: str = field(default="default", metadata={
        "help": "checkpoint directory, or 'default' (SmolLM2-135M-Instruct)"})
    """A directory with config.json and *.safetensors, or 'default' (SmolLM2-135M-Instruct)."""
    dtype: str = field(default="auto", metadata={"choices": DTYPES, "help": "weights' and activations' dtype"})
    """auto (the checkpoint's dtype), float32, bfloat16 or float16."""
    device: str = field(default="auto", metadata={"help": "auto (cuda when a GPU is present), cpu or cuda[:N]"})
    """torch device for weights and KV: cpu, cuda[:N], or auto (cuda when a GPU is present, else cpu)."""
    max_model_len: int | None = field(default=None, metadata={
        "help": "longest prompt plus output (default: the model's max_position_embeddings)"})
    """Longest prompt plus output; defaults to the model's max_position_embeddings."""
    attention_backend: str = field(default="auto", metadata={
        "choices": ATTENTION_BACKENDS, "help": "auto: triton on CUDA, torch on CPU"})
    """torch (CPU and CUDA), triton (our paged kernels: CUDA, or CPU under the interpreter), flash,
    or auto (triton on CUDA, torch on CPU)."""
    cuda_graphs: bool = field(default=True, metadata={
        "flag": "--enforce-eager", "help": "CUDA: no graphs for decode batches"})
    """CUDA: replay captured graphs for decode batches (eager prefill and mixed steps)."""
    overlap_steps: bool | None = None
    """Launch step N+1 before detokenizing and reporting step N; None: on CUDA, where the launch is
    asynchronous (on CPU it would delay every report by a whole step)."""
    async_scheduling: bool = field(default=True, metadata={
        "flag": "--no-async-scheduling",
        "help": "CUDA: read each step's tokens before scheduling the next (no step launched ahead of them)"})
    """With overlap_steps: schedule and launch step N+1 before step N's tokens are read, its continuing requests'
    inputs copied on the device (engine/engine_steps.py); False: collect step N first, then launch N+1."""
    quantization: str | None = field(default=None, metadata={
        "choices": QUANTIZATIONS,
        "help": "quantize the layers' linear weights at load: int8 (weight-only) or fp8 (e4m3); "
                "a checkpoint already in fp8 needs no flag"})
    """Weights of the four linears of each layer: None (the checkpoint's own: unquantized, or fp8 for an
    fp8 checkpoint), int8 (weight-only, per channel) or fp8 (e4m3, per channel), quantized at load."""
    seed: int = 0
    """Seed for requests that give none."""
    tensor_parallel_size: int = field(default=1, metadata={
        "help": "processes (GPUs on CUDA) that split each layer's heads and MLP; must divide the "
                "model's attention and KV head counts"})
    """Ranks (processes; GPUs on CUDA) that split each layer's heads and MLP, and the KV heads of every
    block, as vLLM does (engine/parallel/). Must divide the model's attention and KV head counts."""
    enable_expert_parallel: bool = field(default=False, metadata={
        "help": "Mixture-of-Experts models with --tensor-parallel-size > 1: each rank holds whole experts "
                "(E / ranks of them) instead of a slice of every expert; attention stays split by heads"})
    """Mixture-of-Experts models with tensor_parallel_size > 1: each rank holds E / tensor_parallel_size whole
    experts instead of a slice of every expert; attention stays split by heads
    (engine/parallel/expert_parallel.py). Refused for a dense model, one rank, or an E the ranks do not split."""
    pipeline_parallel_size: int = field(default=1, metadata={
        "help": "processes (GPUs on CUDA) that each hold a contiguous range of the layers (pipeline stages); "
                "hidden states pass stage to stage"})
    """Pipeline stages (processes; GPUs on CUDA), each holding a contiguous range of the layers and their KV
    (engine/parallel/pipeline.py): the embedding on the first, the LM head on the last. With
    tensor_parallel_size N too, each stage is N ranks (K x N processes). Not with KV tiers yet."""
    pp_layer_partition: tuple[int, ...] | None = field(default=None, metadata={
        "type": layer_counts, "metavar": "N,N,...",
        "help": "layers per pipeline stage, first to last (default: an even split, the remainder to the first)"})
    """Layers per stage, first to last (None: an even split, one more layer each for the first stages)."""
    pipeline_microbatches: int = field(default=0, metadata={
        "help": "steps a pipeline keeps in flight, each with its own requests (0: one per stage; 1: one step at "
                "a time)"})
    """With pipeline_parallel_size K > 1: how many steps (micro-batches of different requests) are in flight at
    once, so every stage has work (0: K, the bubble then (K-1)/(M+K-1) of M = K; 1: one step at a time)."""
    distributed_executor_backend: str = field(default="mp", metadata={
        "choices": EXECUTOR_BACKENDS,
        "help": "how the other pipeline stages start: mp (processes on this node) or ray (Ray actors on the "
                "nodes of the worker's placement group, one stage per node)"})
    """`mp`: every rank a process spawned on this node (its KV mapped by this process). `ray`: pipeline stages
    1.. as Ray actors, one per bundle of the worker's placement group (across nodes), each serving the KV of
    its layers from a sender of its own (engine/parallel/ray_stages.py, remote_stages.py); with
    tensor_parallel_size N a stage's first rank starts the stage's other N-1 ranks on its node."""
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    cache: CacheConfig = field(default_factory=CacheConfig, metadata={"group": "KV cache"})
    speculative: SpeculativeConfig = field(default_factory=SpeculativeConfig,
                                           metadata={"group": "speculative decoding"})

    def __post_init__(self) -> None:
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {DTYPES}, got {self.dtype!r}")
        if self.attention_backend not in ATTENTION_BACKENDS:
            raise ValueError(f"attention_backend must be one of {ATTENTION_BACKENDS}")
        if self.max_model_len is not None and self.max_model_len < 2:
            raise ValueError("max_model_len must be >= 2")
        if self.quantization is not None and self.quantization not in QUANTIZATIONS:
            raise ValueError(f"quantization must be one of {QUANTIZATIONS}, got {self.quantization!r}")
        if self.tensor_parallel_size < 1:
            raise ValueError(f"tensor_parallel_size must be >= 1, got {self.tensor_parallel_size}")
        if self.enable_expert_parallel and self.tensor_parallel_size < 2:
            raise ValueError("enable_expert_parallel needs tensor_parallel_size > 1 (the ranks the experts are "
                             f"split over), got {self.tensor_parallel_size}")
        if self.pipeline_parallel_size < 1:
            raise ValueError(f"pipeline_parallel_size must be >= 1, got {self.pipeline_parallel_size}")
        if self.pp_layer_partition is not None and len(self.pp_layer_partition) != self.pipeline_parallel_size:
            raise ValueError(f"pp_layer_partition needs one layer count per pipeline stage "
                             f"({self.pipeline_parallel_size}), got {list(self.pp_layer_partition)}")
        if self.pipeline_microbatches < 0:
            raise ValueError(f"pipeline_microbatches must be >= 0, got {self.pipeline_microbatches}")
        if self.distributed_executor_backend not in EXECUTOR_BACKENDS:
            raise ValueError(f"distributed_executor_backend must be one of {EXECUTOR_BACKENDS}, "
                             f"got {self.distributed_executor_backend!r}")
        if self.pipeline_parallel_size > 1 and self.cache.offload.enabled:
            raise ValueError("KV offload tiers with pipeline_parallel_size > 1 are not supported yet")
        if not (self.device in ("cpu", "auto") or self.device.startswith("cuda")):
            raise ValueError(f"device must be auto, cpu or cuda[:N], got {self.device!r}")

    def resolved(self) -> EngineConfig:
        """A copy with `auto` made concrete on this machine (where the engine runs: a config built
        on a GPU-less head and shipped to a GPU worker keeps `auto` until then)."""
        device = self.device
        if device == "auto":
            import torch
            device = "cuda" if torch.cuda.is_available() else "cpu"
        backend = self.attention_backend
        if backend == "auto":
            backend = "triton" if device.startswith("cuda") else "torch"
        return replace(self, device=device, attention_backend=backend)
