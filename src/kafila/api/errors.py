"""Errors in OpenAI's shape: every failure a client can cause or meet is a body with the status
code OpenAI would use, so SDKs raise their usual exceptions."""

from __future__ import annotations

from fastapi.responses import JSONResponse

# What a 503 asks a client to wait before it tries again, while the session gets ready or replans
# after a break (a replan over cached stage files takes a second or two). The official OpenAI SDKs
# retry a 503 twice by default and wait what `Retry-After` says.
RETRY_AFTER_S = 2
TRY_AGAIN = {"Retry-After": str(RETRY_AFTER_S)}


class ApiError(Exception):
    def __init__(
        self,
        status: int,
        message: str,
        kind: str,
        code: str | None = None,
        param: str | None = None,
        headers: dict[str, str] | None = None,
    ):
        super().__init__(message)
        self.status, self.message, self.kind, self.code, self.param = status, message, kind, code, param
        self.headers = dict(headers or {})
        if status == 401:
            self.headers["WWW-Authenticate"] = "Bearer"

    def response(self) -> JSONResponse:
        body = {"error": {"message": self.message, "type": self.kind, "param": self.param, "code": self.code}}
        return JSONResponse(body, status_code=self.status, headers=self.headers or None)


def invalid(message: str, param: str | None = None, code: str | None = None) -> ApiError:
    return ApiError(400, message, "invalid_request_error", code, param)
