"""The error a request is refused with: an HTTP status and OpenAI's JSON error body."""

from __future__ import annotations


class RequestError(Exception):
    """A request the server will not serve; str() is the message the client reads."""

    def __init__(self, message: str, param: str | None = None, code: str | None = None,
                 status: int = 400, type: str = "invalid_request_error"):  # fmt: skip
        super().__init__(message)
        self.message, self.param, self.code, self.status, self.type = (
            message, param, code, status, type,
        )  # fmt: skip

    def body(self) -> dict:
        return error_body(self.message, self.type, self.param, self.code)


def error_body(message: str, type: str = "invalid_request_error", param: str | None = None,
               code: str | None = None) -> dict:  # fmt: skip
    return {"error": {"message": message, "type": type, "param": param, "code": code}}
