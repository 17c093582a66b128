"""Attention over the paged KV cache: metadata, the backend interface, backends."""
from engine.attention.backend import AttentionBackend, AttentionMetadata, PrefillSpan, make_backend

__all__ = ["AttentionBackend", "AttentionMetadata", "PrefillSpan", "make_backend"]
