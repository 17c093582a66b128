"""Attention over the paged KV cache: metadata, the backend interface, backends."""
from engine.attention.backend import (
    FULL_ATTENTION,
    AttentionBackend,
    AttentionMetadata,
    LayerAttention,
    PrefillSpan,
    make_backend,
)

__all__ = ["FULL_ATTENTION", "AttentionBackend", "AttentionMetadata", "LayerAttention", "PrefillSpan",
           "make_backend"]
