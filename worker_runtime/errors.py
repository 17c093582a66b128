"""Failures a worker reports to the router, each mapped to one gRPC status code."""
from __future__ import annotations

import grpc


class WorkerError(Exception):
    code = grpc.StatusCode.INTERNAL


class Overloaded(WorkerError):
    """The worker holds as many requests as it accepts (or its KV stayed full)."""

    code = grpc.StatusCode.RESOURCE_EXHAUSTED


class Draining(WorkerError):
    """The process is shutting down and takes no new requests."""

    code = grpc.StatusCode.UNAVAILABLE


class EngineBroken(WorkerError):
    """A tensor-parallel rank or pipeline stage of the worker is gone: the worker leaves and is replaced, and
    the router retries or migrates what it held (UNAVAILABLE, as for a worker that died)."""

    code = grpc.StatusCode.UNAVAILABLE
