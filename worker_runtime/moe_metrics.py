"""Prometheus families of a Mixture-of-Experts model's routing: tokens per expert, and each layer's imbalance.

  pdserve:moe_expert_tokens_total{role,worker,expert}  counter: (token, expert) pairs routed to the expert,
      summed over the sparse layers (a token counts once per expert it chose, in every sparse layer). Its
      rate by expert shows hot and idle experts; max / avg of that rate is the worker's imbalance now.
  pdserve:moe_layer_imbalance{role,worker,layer}       gauge: in one sparse layer, the busiest expert's
      tokens over the mean expert's, over the tokens between the last two readings that saw any (1:
      perfectly balanced; E: one expert took every token). With expert parallelism the busiest expert's rank is the
      layer's straggler, so this is the layer's slowdown against a balanced split.

Cardinality: E + L series per worker (E experts, L sparse layers): Mixtral-8x7B 8 + 32, Qwen3-30B-A3B
128 + 48. Per (layer, expert) pairs would be L x E (6,144 for Qwen3-30B-A3B, per worker): too many for
Prometheus, so they stay in the engine (`MoeDecoder.expert_token_counts`).

What is counted is what the engine computed: prompt tokens not found in the prefix cache, decode tokens,
speculative tokens verified (accepted or not), and with CUDA decode graphs their padding rows. With
expert parallelism rank 0 routes every token, so its counts cover all experts. Dense models export none
of these series.

`MoeRoutingReader.read()` runs on the engine thread (worker_runtime/engine_loop.py `_snapshot`) and copies
the counts off the device at most every `interval_s` (one small device sync), so the scrape only reads
the snapshot.
"""
from __future__ import annotations

import time
from collections.abc import Callable

import torch
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

INTERVAL_S = 5.0


class MoeRoutingReader:
    def __init__(self, model, interval_s: float = INTERVAL_S, clock: Callable[[], float] = time.monotonic) -> None:
        """`model`: the engine's decoder; only one with `expert_token_counts` (engine/model/moe_block.py)
        yields a snapshot."""
        self._counts = getattr(model, "expert_token_counts", None)
        self.interval_s = interval_s
        self._clock = clock
        self._last_read: float | None = None
        self._previous: dict[int, list[int]] = {}
        self._snapshot: dict | None = None

    def read(self) -> dict | None:
        """{"experts": [E] tokens per expert over the sparse layers, "imbalance": {layer: max / mean since
        the previous reading that saw tokens}}, refreshed at most every `interval_s`; None for a dense model."""
        if self._counts is None:
            return None
        now = self._clock()
        if self._last_read is not None and now - self._last_read < self.interval_s:
            return self._snapshot
        self._last_read = now
        per_layer = self._counts()
        if not per_layer:
            return None
        layers = sorted(per_layer)
        table = torch.stack([per_layer[i] for i in layers]).cpu()  # [L, E]: one copy off the device
        counts = {i: row.tolist() for i, row in zip(layers, table, strict=True)}
        imbalance = dict(self._snapshot["imbalance"]) if self._snapshot else {i: 1.0 for i in layers}
        for i in layers:
            delta = [now_ - before for now_, before in zip(counts[i], self._previous.get(i, [0] * len(counts[i])),
                                                            strict=True)]
            if sum(delta) > 0:
                imbalance[i] = max(delta) * len(delta) / sum(delta)
        self._previous = counts
        self._snapshot = {"experts": table.sum(dim=0).tolist(), "imbalance": imbalance}
        return self._snapshot


def moe_families(moe: dict, labels: list[str]):
    """Families for a `MoeRoutingReader.read()` snapshot with the worker's label values (role, worker)."""
    tokens = CounterMetricFamily("pdserve:moe_expert_tokens",
                                 "MoE: (token, expert) pairs routed to each expert, summed over the sparse layers",
                                 labels=["role", "worker", "expert"])
    for expert, count in enumerate(moe["experts"]):
        tokens.add_metric([*labels, str(expert)], float(count))
    yield tokens
    imbalance = GaugeMetricFamily("pdserve:moe_layer_imbalance",
                                  "MoE: busiest expert's tokens / the mean expert's in one sparse layer, over the "
                                  "tokens since the previous reading (1 = balanced)",
                                  labels=["role", "worker", "layer"])
    for layer, value in sorted(moe["imbalance"].items()):
        imbalance.add_metric([*labels, str(layer)], float(value))
    yield imbalance
