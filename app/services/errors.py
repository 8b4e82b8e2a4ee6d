"""Errors services raise; the web layer turns them into pages or JSON with the message."""

from __future__ import annotations


class NotFound(LookupError):
    """A row or file the user asked for does not exist (404)."""

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message = message


class InvalidInput(ValueError):
    """The user's input cannot be used; `errors` maps a form field to a plain message."""

    def __init__(self, message: str, errors: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.errors = errors or {}
