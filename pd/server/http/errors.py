"""Errors answered in OpenAI's shape: ``{"error": {message, type, param, code}}``.

Every error the server answers goes through ``APIError``: validation failures, refusals
(401, 413, 429, 503, 504) and, via the catch-all middleware, anything unexpected (500).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

from fastapi.responses import JSONResponse


class APIError(Exception):
    """An error answered in OpenAI's shape; ``headers`` go on the response (Retry-After, ...)."""

    def __init__(
        self,
        message: str,
        *,
        status_code: int = 400,
        type: str = "invalid_request_error",
        param: str | None = None,
        code: str | None = None,
        headers: Mapping[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.message = message
        self.status_code = status_code
        self.type = type
        self.param = param
        self.code = code
        self.headers = dict(headers or {})

    def to_dict(self) -> dict[str, Any]:
        return {
            "error": {
                "message": self.message,
                "type": self.type,
                "param": self.param,
                "code": self.code,
            }
        }

    def response(self) -> JSONResponse:
        return JSONResponse(self.to_dict(), status_code=self.status_code, headers=self.headers)


def rate_limited(message: str, code: str, retry_after_s: int) -> APIError:
    """A 429 in OpenAI's shape, with ``Retry-After`` in whole seconds."""
    return APIError(
        message,
        status_code=429,
        type="rate_limit_error",
        code=code,
        headers={"Retry-After": str(retry_after_s)},
    )


def stalled_error(e: BaseException) -> APIError:
    """A stream ended because its client did not catch up with it (``ReaderStalled``)."""
    return APIError(str(e), status_code=408, type="timeout_error", code="client_too_slow")


def internal_error(e: BaseException) -> APIError:
    return APIError(f"internal error: {e!r}", status_code=500, type="server_error")


def validation_error(errors: Iterable[Mapping[str, Any]]) -> APIError:
    """One 400 naming each bad field once (a union type reports one error per branch)."""
    by_field: dict[str, str] = {}
    for err in errors:
        loc = [str(x) for x in err.get("loc", ()) if x != "body"]
        if err.get("type") == "json_invalid":
            return APIError(f"invalid JSON body: {err.get('msg')}")
        if not loc:
            return APIError(f"the request body must be a JSON object: {err.get('msg')}")
        if err.get("type") == "extra_forbidden":
            name = ".".join(loc)
            by_field.setdefault(loc[0], f"{name}: unknown field; this server does not support it")
            continue
        got = repr(err.get("input"))
        got = got if len(got) <= 60 else got[:57] + "..."
        by_field.setdefault(loc[0], f"{loc[0]}: {err.get('msg')} (got {got})")
    return APIError("; ".join(by_field.values()), param=next(iter(by_field), None))
