"""ASGI middleware: `Authorization: Bearer KEY` on every route but /health when API keys are on.

A missing or unknown key gets 401 with an OpenAI-style error body (what the
`openai` client raises as AuthenticationError); a known key's tenant is left in
the scope for the routes (`tenant_of`).
"""
from __future__ import annotations

from router.auth import ApiKeys
from router.openai import errors

OPEN_PATHS = frozenset({"/health"})
"""Probes need no key."""
_TENANT = "pdserve.tenant"


def tenant_of(scope) -> str | None:
    """The authenticated caller's tenant; None when keys are off."""
    return scope.get(_TENANT)


class ApiKeyAuth:
    def __init__(self, app, keys: ApiKeys) -> None:
        self.app = app
        self.keys = keys

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http" or not self.keys.enabled or scope["path"] in OPEN_PATHS:
            await self.app(scope, receive, send)
            return
        header = next((v for k, v in scope["headers"] if k == b"authorization"), None)
        tenant = self.keys.tenant_of_authorization(header.decode("latin-1") if header is not None else None)
        if tenant is None:
            message = ("Incorrect API key provided." if header is not None
                       else "You didn't provide an API key: send the header 'Authorization: Bearer KEY'.")
            response = errors.error_response(401, message, "invalid_request_error", "invalid_api_key",
                                             headers={"WWW-Authenticate": "Bearer"})
            await response(scope, receive, send)
            return
        await self.app({**scope, _TENANT: tenant}, receive, send)
