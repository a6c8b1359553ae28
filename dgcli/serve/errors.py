"""OpenAI's error object as this server sends it: `ApiError`, its text made safe to send (a request's field names
and values reach it as sent: a lone surrogate is spelled \\udXXX, and the middle of anything over `MAX_ERROR_CHARS`
is cut). Must not: parse requests (serve/protocol.py does).
"""

from __future__ import annotations

MAX_ERROR_CHARS = 1000  # an error message or param longer than this is clipped in the middle


class ApiError(Exception):
    """An error reply: HTTP status and OpenAI's error object (message, type, param, code)."""

    TYPES = {400: "invalid_request_error", 401: "authentication_error", 404: "invalid_request_error",
             413: "invalid_request_error", 429: "rate_limit_error", 503: "server_error", 500: "server_error"}

    def __init__(self, status: int, message: str, *, param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code

    def body(self) -> dict:
        return {"error": {"message": _clip(_utf8(self.message)),
                          "type": self.TYPES.get(self.status, "invalid_request_error"),
                          "param": _clip(_utf8(self.param)), "code": self.code}}


def _utf8(text: str | None) -> str | None:
    return None if text is None else text.encode("utf-8", "backslashreplace").decode("utf-8")


def _clip(text: str | None, limit: int = MAX_ERROR_CHARS) -> str | None:
    """`text` with its middle cut out past `limit` characters (the problem and the fix are said around the value)."""
    if text is None or len(text) <= limit:
        return text
    cut = f" …[{len(text) - limit + 40:,} characters cut]… "
    keep = (limit - len(cut)) // 2
    return text[:keep] + cut + text[-keep:]
