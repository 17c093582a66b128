"""Tensor parallelism inside one engine: the rank group, weight sharding, and the rank processes."""
