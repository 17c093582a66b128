"""The public pdserve.v1.Generation service: the gRPC wire format of the RequestRunner.

With API keys configured, Generate and Abort need metadata `authorization: Bearer KEY`
(else UNAUTHENTICATED); the key's tenant salts the request's prefix-cache blocks and
scopes its request id, so Abort reaches only the caller's own requests. Health and
reflection are other services and stay open.
"""
from __future__ import annotations

import grpc

from common.protocol import generate_pb2, generate_pb2_grpc
from router.auth import ApiKeys
from router.requests import RequestFailed, RequestRunner

UNAUTHENTICATED_MESSAGE = "a valid API key is required (metadata 'authorization: Bearer KEY')"


class GenerationServicer(generate_pb2_grpc.GenerationServicer):
    def __init__(self, runner: RequestRunner, keys: ApiKeys | None = None, route_metadata: bool = False) -> None:
        self.runner = runner
        self.keys = keys or ApiKeys(env={})
        self.route_metadata = route_metadata
        """Name the workers in the trailing metadata (RouterConfig.route_metadata)."""

    async def Generate(self, request, context):
        tenant = await self._tenant(context)
        routes: list = []
        try:
            async for msg in self.runner.generate(request, context.time_remaining(), routes=routes, tenant=tenant):
                yield msg
        except RequestFailed as exc:
            if exc.retry_after_s is not None:
                context.set_trailing_metadata(retry_metadata(exc.code, str(exc), exc.retry_after_s))
            await context.abort(exc.code, str(exc))
        if self.route_metadata:
            context.set_trailing_metadata(route_metadata(routes))

    async def Abort(self, request, context):
        tenant = await self._tenant(context)
        return generate_pb2.AbortResponse(found=self.runner.abort(request.request_id, tenant))

    async def _tenant(self, context) -> str | None:
        """The caller's tenant (None when keys are off); aborts the call UNAUTHENTICATED without a valid key."""
        if not self.keys.enabled:
            return None
        header = next((value for key, value in context.invocation_metadata() or () if key == "authorization"), None)
        tenant = self.keys.tenant_of_authorization(header if isinstance(header, str) else None)
        if tenant is None:
            await context.abort(grpc.StatusCode.UNAUTHENTICATED, UNAUTHENTICATED_MESSAGE)
        return tenant


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
