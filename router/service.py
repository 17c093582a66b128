"""The public pdserve.v1.Generation service: the gRPC wire format of the RequestRunner."""
from __future__ import annotations

import grpc

from pdserve.protocol import generate_pb2, generate_pb2_grpc
from router.requests import RequestFailed, RequestRunner


class GenerationServicer(generate_pb2_grpc.GenerationServicer):
    def __init__(self, runner: RequestRunner) -> None:
        self.runner = runner

    async def Generate(self, request, context):
        routes: list = []
        try:
            async for msg in self.runner.generate(request, context.time_remaining(), routes=routes):
                yield msg
        except RequestFailed as exc:
            if exc.retry_after_s is not None:
                context.set_trailing_metadata(retry_metadata(exc.code, str(exc), exc.retry_after_s))
            await context.abort(exc.code, str(exc))
        context.set_trailing_metadata(route_metadata(routes))

    async def Abort(self, request, context):
        return generate_pb2.AbortResponse(found=self.runner.abort(request.request_id))


def route_metadata(routes) -> tuple:
    """Trailing metadata naming the workers of each sample, in index order ("-": none)."""
    ordered = sorted(routes, key=lambda item: item[0])
    return tuple([("pdserve-prefill-worker", route.prefill.address if route.prefill else "-")
                  for _, route in ordered]
                 + [("pdserve-decode-worker", route.decode.address) for _, route in ordered])


def retry_metadata(code: grpc.StatusCode, message: str, retry_after_s: float) -> tuple:
    """google.rpc.RetryInfo in the status details (what gRPC clients read), plus a plain hint."""
    from google.protobuf import any_pb2, duration_pb2
    from google.rpc import error_details_pb2, status_pb2
    detail = any_pb2.Any()
    detail.Pack(error_details_pb2.RetryInfo(retry_delay=duration_pb2.Duration(
        seconds=int(retry_after_s), nanos=int(retry_after_s % 1 * 1e9))))
    status = status_pb2.Status(code=code.value[0], message=message, details=[detail])
    return (("grpc-status-details-bin", status.SerializeToString()), ("retry-after-s", f"{retry_after_s:g}"))
