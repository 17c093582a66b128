"""The public pdserve.v1.Generation service: the gRPC wire format of the RequestRunner."""
from __future__ import annotations

from pdserve.protocol import generate_pb2, generate_pb2_grpc
from router.requests import RequestFailed, RequestRunner


class GenerationServicer(generate_pb2_grpc.GenerationServicer):
    def __init__(self, runner: RequestRunner) -> None:
        self.runner = runner

    async def Generate(self, request, context):
        try:
            async for msg in self.runner.generate(request, context.time_remaining()):
                yield msg
        except RequestFailed as exc:
            await context.abort(exc.code, str(exc))

    async def Abort(self, request, context):
        return generate_pb2.AbortResponse(found=self.runner.abort(request.request_id))
