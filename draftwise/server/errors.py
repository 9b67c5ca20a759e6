"""OpenAI-shaped errors: one exception type carrying the HTTP status, and the JSON body every error uses.

Body: {"error": {"message", "type", "param", "code"}} (the shape the official `openai` client parses into
`openai.APIStatusError`). Owns nothing else; routes raise APIError and app.py turns it into a response.
"""
from __future__ import annotations

from fastapi.responses import JSONResponse

# OpenAI's `type` for each status we send (their API uses these names)
_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    405: "invalid_request_error",
    413: "invalid_request_error",
    415: "invalid_request_error",
    429: "rate_limit_error",
    500: "server_error",
    503: "server_error",
    504: "timeout_error",
}


class APIError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 headers: dict | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code
        self.headers = headers  # extra response headers (Retry-After on a 429 or 503)


def error_body(status: int, message: str, param: str | None = None, code: str | None = None) -> dict:
    return {"error": {"message": message, "type": _TYPES.get(status, "invalid_request_error"),
                      "param": param, "code": code}}


def error_response(status: int, message: str, param: str | None = None, code: str | None = None,
                   headers: dict | None = None) -> JSONResponse:
    return JSONResponse(error_body(status, message, param, code), status_code=status, headers=headers)


def from_api_error(e: APIError) -> JSONResponse:
    headers = dict(e.headers or {})
    if e.status == 401:
        headers["WWW-Authenticate"] = "Bearer"
    return error_response(e.status, e.message, e.param, e.code, headers or None)
