"""OpenAI-style error bodies, `{"error": {"message", "type", "param", "code"}}`, with HTTP statuses."""
from __future__ import annotations

import math

import grpc
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse

from router.openai.protocol import BODY_FIELDS
from router.requests import RequestFailed

# gRPC status of a failed request -> (HTTP status, OpenAI error type, error code)
_STATUS = {
    grpc.StatusCode.INVALID_ARGUMENT: (400, "invalid_request_error", "invalid_value"),
    grpc.StatusCode.ALREADY_EXISTS: (409, "invalid_request_error", "conflict"),
    grpc.StatusCode.RESOURCE_EXHAUSTED: (429, "rate_limit_error", "rate_limit_exceeded"),
    grpc.StatusCode.UNAVAILABLE: (503, "server_error", "service_unavailable"),
    grpc.StatusCode.DEADLINE_EXCEEDED: (504, "server_error", "timeout"),
    grpc.StatusCode.CANCELLED: (499, "server_error", "cancelled"),
}
_INTERNAL = (500, "server_error", "internal_error")
DEFAULT_RETRY_AFTER_S = 1.0


def error_body(message: str, error_type: str, code: str, param: str | None = None) -> dict:
    return {"error": {"message": message, "type": error_type, "param": param, "code": code}}


def error_response(status: int, message: str, error_type: str, code: str, param: str | None = None,
                   headers: dict | None = None) -> JSONResponse:
    return JSONResponse(error_body(message, error_type, code, param), status_code=status, headers=headers)


def invalid(param: str | None, message: str) -> JSONResponse:
    """400 naming the OpenAI parameter at fault."""
    return error_response(400, message, "invalid_request_error", "invalid_value", param)


def model_not_found(model: str) -> JSONResponse:
    return error_response(404, f"The model `{model}` does not exist.", "invalid_request_error", "model_not_found",
                          "model")


def failed_status(exc: RequestFailed) -> tuple[int, dict]:
    """(HTTP status, headers) of a failed request."""
    status = _STATUS.get(exc.code, _INTERNAL)[0]
    headers = {}
    if status == 429:
        headers["Retry-After"] = str(math.ceil(exc.retry_after_s or DEFAULT_RETRY_AFTER_S))
    return status, headers


def failed_body(exc: RequestFailed, message: str, param: str | None) -> dict:
    _, error_type, code = _STATUS.get(exc.code, _INTERNAL)
    return error_body(message, error_type, code, param)


def validation_error(exc: RequestValidationError) -> JSONResponse:
    """A body that is not JSON or does not fit the request model: 400 naming the first field at fault."""
    first = exc.errors()[0]
    loc = []
    for part in first.get("loc", ())[1:]:  # after "body"
        if not isinstance(part, int) and part not in BODY_FIELDS:
            break
        loc.append(part)
    if first.get("type") == "json_invalid" or not loc:
        return invalid(None, f"the request body is not a valid JSON object: {first.get('msg')}")
    param = str(loc[0]) + "".join(f"[{p}]" if isinstance(p, int) else f".{p}" for p in loc[1:])
    return invalid(param, f"{param}: {first.get('msg')}")
