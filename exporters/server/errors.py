"""Every refused request is one JSON error in OpenAI's shape, with an HTTP 4xx; the server keeps serving."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class ApiError(Exception):
    """A request the server refuses: what was wrong and what to do, the field at fault, the HTTP status."""

    status: int
    message: str
    param: str | None = None
    code: str | None = None
    retry_after: int | None = None  # seconds (HTTP 429)

    @property
    def kind(self) -> str:
        return {401: "authentication_error", 404: "not_found_error", 429: "rate_limit_error"}.get(
            self.status, "invalid_request_error" if self.status < 500 else "server_error")

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.kind, "param": self.param, "code": self.code}}

    def headers(self) -> dict[str, str]:
        return {"Retry-After": str(self.retry_after)} if self.retry_after is not None else {}
