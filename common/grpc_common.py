"""What every pdserve gRPC server carries: health, reflection, message limits."""
from __future__ import annotations

import asyncio
import signal
from collections.abc import Callable

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from common.grpc_invalid_messages import InvalidMessages

MAX_MESSAGE_BYTES = 64 << 20
WORKER_MAX_REQUEST_BYTES = 16 << 20
"""What a worker reads of one request: internal requests carry token ids (a few bytes each), so this
holds millions of tokens; a larger one is refused before it is buffered."""
WORKER_STREAM_WINDOW_BYTES = 1 << 20
"""HTTP/2 window of one call to a worker, fixed (no BDP probing, which grows it to many MiB per call):
what gRPC may buffer of a call nobody reads, e.g. one refused for its token before its body is read."""
WORKER_SERVER_OPTIONS = [("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
                         ("grpc.max_receive_message_length", WORKER_MAX_REQUEST_BYTES),
                         ("grpc.http2.bdp_probe", 0), ("grpc.http2.lookahead_bytes", WORKER_STREAM_WINDOW_BYTES)]
CHANNEL_OPTIONS = [("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
                   ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES)]
# Health service name that stays SERVING while the process runs, draining included: what a
# Kubernetes liveness probe asks (readiness asks "" and turns NOT_SERVING on drain).
LIVENESS_SERVICE = "liveness"


def new_server(max_receive_bytes: int = MAX_MESSAGE_BYTES) -> grpc.aio.Server:
    """A server refusing request messages over `max_receive_bytes` (RESOURCE_EXHAUSTED) and those protobuf
    cannot parse (INVALID_ARGUMENT, common/grpc_invalid_messages.py)."""
    return grpc.aio.server(interceptors=[InvalidMessages()],
                           options=[("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
                                    ("grpc.max_receive_message_length", max_receive_bytes)])


def add_health_and_reflection(server: grpc.aio.Server, service_names: list[str]) -> health.aio.HealthServicer:
    """Register grpc.health.v1 (starting NOT_SERVING) and server reflection for the given services."""
    servicer = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(servicer, server)
    reflection.enable_server_reflection([*service_names, health.SERVICE_NAME, reflection.SERVICE_NAME], server)
    return servicer


async def set_serving(servicer: health.aio.HealthServicer, service_names: list[str], serving: bool) -> None:
    status = health_pb2.HealthCheckResponse.SERVING if serving else health_pb2.HealthCheckResponse.NOT_SERVING
    for name in ["", *service_names]:
        await servicer.set(name, status)
    if serving:
        await servicer.set(LIVENESS_SERVICE, status)


def insecure_channel(address: str) -> grpc.aio.Channel:
    return grpc.aio.insecure_channel(address, options=CHANNEL_OPTIONS)


def run_until_signalled(server, ready_line: Callable[[str], str]) -> int:
    """Process body of a router or worker: start `server`, print its ready line, and on
    SIGTERM/SIGINT drain it (no new requests, in-flight ones finish) and stop."""
    async def main() -> None:
        stop = asyncio.Event()
        for sig in (signal.SIGTERM, signal.SIGINT):
            asyncio.get_running_loop().add_signal_handler(sig, stop.set)
        address = await server.start()
        print(ready_line(address), flush=True)
        await stop.wait()
        await server.drain()
        await server.stop()

    asyncio.run(main())
    return 0
