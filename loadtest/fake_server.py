"""A trivial Generation server with known delays, to measure the load tester itself.

Each request gets max_tokens one-token chunks: the first after `ttft_s`, the
next ones `itl_s` apart, then a Complete. No model, no router: what the load
tester reports beyond these delays is its own overhead. Every `fail_every`-th
request is refused with RESOURCE_EXHAUSTED (0: none), to exercise failure counts.
Its usage reports as cached_tokens the leading 16-token blocks of the prompt's token
ids that an earlier request already sent (an unbounded prefix cache, filled on arrival).
"""
from __future__ import annotations

import asyncio

import grpc

from common.grpc_common import new_server
from common.protocol import generate_pb2, generate_pb2_grpc
from loadtest.prefix import block_keys, cached_prefix_tokens


class FakeGeneration(generate_pb2_grpc.GenerationServicer):
    def __init__(self, ttft_s: float, itl_s: float, fail_every: int = 0) -> None:
        self.ttft_s = ttft_s
        self.itl_s = itl_s
        self.fail_every = fail_every
        self.num_requests = 0
        self.in_flight = 0
        self.max_in_flight = 0
        self.request_ids: list[str] = []
        """Every request's id, in the order they arrived."""
        self._blocks: set[int] = set()

    async def Generate(self, request, context):
        self.num_requests += 1
        self.request_ids.append(request.request_id)
        if self.fail_every and self.num_requests % self.fail_every == 0:
            await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, "fake overload")
        keys = block_keys(request.tokens.ids)
        cached = cached_prefix_tokens(keys, self._blocks)
        self._blocks.update(keys)
        n = request.params.max_tokens if request.params.HasField("max_tokens") else 16
        self.in_flight += 1
        self.max_in_flight = max(self.max_in_flight, self.in_flight)
        try:
            await asyncio.sleep(self.ttft_s)
            for i in range(n):
                if i:
                    await asyncio.sleep(self.itl_s)
                yield generate_pb2.GenerateResponse(request_id=request.request_id,
                                                    chunk=generate_pb2.Chunk(token_ids=[100 + i], text="x"))
        finally:
            self.in_flight -= 1
        yield generate_pb2.GenerateResponse(request_id=request.request_id, complete=generate_pb2.Complete(
            finish_reason=generate_pb2.FINISH_REASON_LENGTH,
            usage=generate_pb2.Usage(prompt_tokens=len(request.tokens.ids), completion_tokens=n,
                                     cached_tokens=cached)))


async def start_fake_server(ttft_s: float, itl_s: float, fail_every: int = 0, host: str = "127.0.0.1"):
    """Start serving on a free port; returns (server, servicer, "host:port")."""
    server = new_server()
    servicer = FakeGeneration(ttft_s, itl_s, fail_every)
    generate_pb2_grpc.add_GenerationServicer_to_server(servicer, server)
    port = server.add_insecure_port(f"{host}:0")
    await server.start()
    return server, servicer, f"{host}:{port}"


class FakeServerThread:
    """The fake server on an event loop of its own thread (callers keep their own loop)."""

    def __init__(self, ttft_s: float, itl_s: float, fail_every: int = 0) -> None:
        import threading
        self.loop = asyncio.new_event_loop()
        threading.Thread(target=self.loop.run_forever, daemon=True, name="fake-generation").start()
        self.server, self.servicer, self.address = asyncio.run_coroutine_threadsafe(
            start_fake_server(ttft_s, itl_s, fail_every), self.loop).result(30)

    def stop(self) -> None:
        asyncio.run_coroutine_threadsafe(self.server.stop(0), self.loop).result(30)
        self.loop.call_soon_threadsafe(self.loop.stop)


def main(argv: list[str] | None = None) -> int:
    """`python -m loadtest.fake_server --ttft-ms 20 --itl-ms 5`: serve until killed."""
    import argparse
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--ttft-ms", type=float, default=20.0)
    p.add_argument("--itl-ms", type=float, default=5.0)
    args = p.parse_args(argv)

    async def serve() -> None:
        server, _, address = await start_fake_server(args.ttft_ms / 1000, args.itl_ms / 1000)
        print(f"ready: fake generation at {address}", flush=True)
        await server.wait_for_termination()

    asyncio.run(serve())
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
