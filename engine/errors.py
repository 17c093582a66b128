"""Errors the engine raises on a caller's bad input (they name the field, for INVALID_ARGUMENT)."""
from __future__ import annotations


class InvalidParameter(ValueError):
    """A request field is invalid; `field` names it."""

    def __init__(self, field_name: str, message: str) -> None:
        super().__init__(f"{field_name}: {message}")
        self.field = field_name
