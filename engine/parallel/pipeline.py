"""Pipeline parallelism: each stage process holds a contiguous range of the decoder's layers.

As vLLM splits a model over `--pipeline-parallel-size` K stages: stage 0 holds the embedding, stage K-1
the final norm and the LM head, and every stage the layers of its range (`stage_layers`: an even split,
the remainder one layer each to the first stages, or the user's `pp_layer_partition`) and the KV cache of
those layers only, for the same block ids (one block table, kept by the scheduler on stage 0).

Several steps in flight (`EngineConfig.pipeline_microbatches`, M; default K): the first stage launches a step on
requests not in flight, sends its hidden states on without waiting (`send`), and receives a step's logits only
when M are in flight (engine/engine_steps.py): each stage computes another step, so the bubble is about
(K-1)/(M+K-1) of the time instead of (K-1)/K.

One step, for every stage at once: stage 0 hands the step's inputs to every stage (the executor's pipes,
as for tensor parallelism); then stage s runs its layers on the hidden states stage s-1 sent it (stage 0
on the embedded tokens) and sends the residual stream [tokens, hidden] to stage s+1; the last stage sends
the logits of the sampled rows back to stage 0, which samples: whole where the sampler reads more than the
argmax (random sampling, logprobs, penalties, grammars), else the argmax alone (`send_logits`), so a greedy
decode row crosses as 8 bytes instead of vocab x dtype. The tensors go point to point over the
group (`PipelineStage.send` / `recv`: gloo on CPU, NCCL on CUDA).

Pure functions and a thin wrapper over the group: no processes are started here (executor.py does).
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from engine.parallel.tp_group import TPGroup


def stage_layers(num_layers: int, pp_size: int, partition: tuple[int, ...] | None = None) -> list[tuple[int, int]]:
    """The [start, end) layer range of each of `pp_size` stages: `partition` (layers per stage) when given,
    else an even split with the remainder going one layer each to the first stages (the last stage also
    runs the LM head). Raises ValueError when a stage would get no layer or the counts do not add up."""
    if pp_size < 1:
        raise ValueError(f"pipeline_parallel_size must be >= 1, got {pp_size}")
    if partition is None:
        if pp_size > num_layers:
            raise ValueError(f"pipeline_parallel_size {pp_size} is more than the model's {num_layers} layers")
        base, extra = divmod(num_layers, pp_size)
        partition = tuple(base + (1 if s < extra else 0) for s in range(pp_size))
    if len(partition) != pp_size or any(n < 1 for n in partition) or sum(partition) != num_layers:
        raise ValueError(f"pp_layer_partition {list(partition)} must give each of the {pp_size} stages at least "
                         f"one layer and add up to the model's {num_layers} layers")
    ranges, start = [], 0
    for n in partition:
        ranges.append((start, start + n))
        start += n
    return ranges


@dataclass
class PendingLogits:
    """A launched step's logits the first stage has yet to receive from the last (`ModelRunner.collect`)."""

    shape: tuple[int, int]
    whole_rows: torch.Tensor | None


@dataclass
class PipelineStage:
    """One stage's place in the pipeline, and the point-to-point links to its neighbours."""

    rank: int
    size: int
    start: int
    """First layer (global index) this stage holds."""
    end: int
    """One past its last layer."""
    group: TPGroup | None = None
    """The stages' group (None: a single stage)."""
    _sending: list = field(default_factory=list)
    """(work, tensor) of sends still in progress: a send never waits for its receiver (see `send`)."""

    @property
    def is_first(self) -> bool:
        return self.rank == 0

    @property
    def is_last(self) -> bool:
        return self.rank == self.size - 1

    @property
    def num_layers(self) -> int:
        return self.end - self.start

    def send(self, x: torch.Tensor, dst: int) -> None:
        """`x` to stage `dst`, which knows its shape (nothing is sent when it is empty: a step that samples
        nothing has no logits). No shape travels: on CUDA reading one would sync the stream every step. The
        send goes on in the background (the tensor kept until it is done): with several steps in flight the
        first stage sends step B's hidden states while the last still sends step A's logits, and neither may
        wait for the other's receive."""
        self._sending = [(work, t) for work, t in self._sending if not work.is_completed()]
        if x.numel():
            x = x.contiguous()
            self._sending.append((self.group.isend(x, dst), x))

    def send_logits(self, logits: torch.Tensor, whole_rows: torch.Tensor | None) -> None:
        """The last stage's logits to the first: the argmax of every row, then the rows `whole_rows` marks (the
        sampler reads more of them than the argmax). A greedy decode row costs 8 bytes, not vocab x dtype."""
        if whole_rows is None:
            return self.send(logits, 0)
        self.send(logits.argmax(dim=-1), 0)
        self.send(logits[whole_rows.to(logits.device)], 0)

    def recv_logits(self, shape: tuple[int, int], whole_rows: torch.Tensor | None, dtype: torch.dtype,
                    device: torch.device) -> torch.Tensor:
        """What `send_logits` sent, as logits of `shape`: the whole rows as computed, the others -inf but 0 at
        their argmax (the same argmax, so the same greedy token)."""
        src = self.size - 1
        if whole_rows is None:
            return self.recv(src, shape, dtype, device)
        argmax = self.recv(src, (shape[0],), torch.int64, device)
        whole = whole_rows.to(device)
        rows = self.recv(src, (int(whole_rows.sum()), shape[1]), dtype, device)
        logits = torch.full(shape, float("-inf"), dtype=dtype, device=device)
        logits[torch.arange(shape[0], device=device), argmax] = 0.0
        logits[whole] = rows
        return logits

    def recv(self, src: int, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        """The tensor of `shape` stage `src` sends next."""
        x = torch.empty(shape, dtype=dtype, device=device)
        if x.numel():
            self.group.recv(x, src)
        return x
