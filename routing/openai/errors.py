"""OpenAI-format errors: the exception the gateway raises, its JSON body, and the
FastAPI handlers that turn every failure into `{"error": {...}}` with the right status.

Types and codes follow the OpenAI API where it has one (`invalid_request_error`,
`model_not_found`, `context_length_exceeded`, `rate_limit_exceeded`); statuses are
what the official `openai` client maps to its exception classes (400
BadRequestError, 404 NotFoundError, 429 RateLimitError, 5xx InternalServerError).
"""

from __future__ import annotations

import json
import logging
import re
from typing import Any

from pydantic import ValidationError

logger = logging.getLogger(__name__)

INVALID_REQUEST = "invalid_request_error"
RATE_LIMIT = "rate_limit_error"
SERVER_ERROR = "server_error"


class APIError(Exception):
    """An error the client sees: HTTP status plus the OpenAI error object."""

    def __init__(
        self,
        status: int,
        message: str,
        type: str = INVALID_REQUEST,
        param: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ):
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type
        self.param = param
        self.code = code
        self.headers = headers or {}

    def body(self) -> dict[str, Any]:
        return error_body(self.message, self.type, self.param, self.code)

    def __repr__(self) -> str:
        return f"APIError({self.status}, {self.message!r}, param={self.param!r}, code={self.code!r})"


def error_body(message: str, type: str = INVALID_REQUEST, param: str | None = None, code: str | None = None) -> dict:
    return {"error": {"message": message, "type": type, "param": param, "code": code}}


def invalid_request(message: str, param: str | None = None, code: str | None = None) -> APIError:
    return APIError(400, message, INVALID_REQUEST, param, code)


def model_not_found(model: str | None) -> APIError:
    return APIError(
        404,
        f"The model `{model}` does not exist.",
        INVALID_REQUEST,
        "model",
        "model_not_found",
    )


def context_length_exceeded(
    num_prompt_tokens: int, max_tokens: int | None, max_model_len: int, param: str = "messages"
) -> APIError:
    """400 with OpenAI's wording; `param` is "messages" for chat, "prompt" for completions."""
    what = "messages" if param == "messages" else "prompt"
    if max_tokens is None:
        msg = (
            f"This model's maximum context length is {max_model_len} tokens. However, your {what} "
            f"resulted in {num_prompt_tokens} tokens. Please reduce the length of the {what}."
        )
    else:
        msg = (
            f"This model's maximum context length is {max_model_len} tokens. However, you requested "
            f"{num_prompt_tokens + max_tokens} tokens ({num_prompt_tokens} in the {what}, {max_tokens} "
            f"in the completion). Please reduce the length of the {what} or completion."
        )
    return APIError(400, msg, INVALID_REQUEST, param, "context_length_exceeded")


def overloaded(message: str = "The server is overloaded; retry later.", retry_after_s: int = 1) -> APIError:
    """429: admission refused because queues are full (the client's retry path)."""
    return APIError(429, message, RATE_LIMIT, None, "rate_limit_exceeded", {"Retry-After": str(retry_after_s)})


def not_ready(message: str = "The server is starting up; retry later.", retry_after_s: int = 5) -> APIError:
    """503: weights not loaded or warm-up not finished, or no replica of a pool is up."""
    return APIError(503, message, SERVER_ERROR, None, "service_unavailable", {"Retry-After": str(retry_after_s)})


def unauthorized() -> APIError:
    """401: no API key, or not one the gateway accepts (OpenAI's `invalid_api_key`)."""
    return APIError(
        401, "Incorrect or missing API key: send `Authorization: Bearer <key>`.", INVALID_REQUEST, None,
        "invalid_api_key", {"WWW-Authenticate": "Bearer"},
    )


def payload_too_large(limit: int) -> APIError:
    """413: the request body is larger than `gateway.max_body_bytes`."""
    return APIError(413, f"The request body exceeds {limit} bytes.", INVALID_REQUEST, None, "payload_too_large")


def headers_too_large(what: str) -> APIError:
    """431: more header bytes or header fields than `gateway.max_header_bytes` / `max_headers`."""
    return APIError(431, f"Request headers too large: {what}.", INVALID_REQUEST, None, "headers_too_large")


def deadline_exceeded(seconds: float) -> APIError:
    """504: the request ran past `gateway.request_timeout_s`; whatever it held is freed."""
    return APIError(504, f"The request did not finish within {seconds:g} s.", SERVER_ERROR, None, "timeout")


def internal_error(message: str = "Internal server error.") -> APIError:
    return APIError(500, message, SERVER_ERROR, None, "internal_error")


_UNION_TAGS = {"str", "int", "float", "bool", "list", "dict", "none", "null"}


def _is_union_tag(part: Any) -> bool:
    """Pydantic adds the union member (`str`, `list[TextContentPart]`, `function-after[...]`,
    a model's class name such as `NamedToolChoice`) to an error's location; a client
    wants the field path only (our fields are snake_case)."""
    if not isinstance(part, str):
        return False
    tagged = part.startswith(("function-", "tagged-union", "lax-", "json-or-python"))
    return part in _UNION_TAGS or "[" in part or tagged or part[:1].isupper()


def _param_path(loc: tuple | list) -> str | None:
    parts = list(loc)
    if parts and parts[0] in ("body", "query", "path", "header"):
        parts = parts[1:]
    out = ""
    for part in parts:
        if _is_union_tag(part):
            continue
        if isinstance(part, int):
            out += f"[{part}]"
        else:
            out += f".{part}" if out else str(part)
    return out or None


def _top_field(param: str) -> str:
    return re.split(r"[.\[]", param, maxsplit=1)[0]


def _clean_msg(msg: str) -> str:
    for prefix in ("Value error, ", "Assertion failed, "):
        if msg.startswith(prefix):
            return msg[len(prefix) :]
    return msg


def from_validation_error(exc: ValidationError | Any) -> APIError:
    """400 from a pydantic ValidationError or FastAPI's RequestValidationError (anything with
    `.errors()`), `param` being the first offending field path, e.g. "messages[0].content"."""
    errors = list(exc.errors())
    if not errors:
        return invalid_request("Invalid request.")
    for err in errors:
        if err.get("type") == "json_invalid":
            detail = (err.get("ctx") or {}).get("error", err.get("msg", ""))
            return invalid_request(f"Invalid JSON in the request body: {detail}")
    first = errors[0]
    param = _param_path(first.get("loc", ()))
    if param is not None:
        # A union reports one error per member; the deepest one names what is wrong
        # (`messages[0].content[0].type`, not "content should be a string").
        top = _top_field(param)
        params = [q for q in (_param_path(e.get("loc", ())) for e in errors) if q and _top_field(q) == top]
        param = max(params, key=lambda q: q.count(".") + q.count("["))
    if param is None:
        if first.get("type") == "missing":
            return invalid_request("The request body is missing; send a JSON object.")
        if first.get("type") in ("model_attributes_type", "model_type", "dict_type"):
            return invalid_request("The request body must be a JSON object.")
        return invalid_request(_clean_msg(first.get("msg", "Invalid request.")))
    msgs: list[str] = []
    for err in errors:
        if _param_path(err.get("loc", ())) == param:
            if err.get("type") == "missing":
                return invalid_request(f"Missing required parameter: '{param}'.", param)
            m = _clean_msg(err.get("msg", ""))
            if m not in msgs:
                msgs.append(m)
    return invalid_request(f"Invalid value for '{param}': {' or '.join(msgs)}", param)


def json_response(err: APIError):
    from fastapi.responses import JSONResponse

    return JSONResponse(err.body(), status_code=err.status, headers=err.headers or None)


def install_error_handlers(app) -> None:
    """Make every error `app` returns an OpenAI error object: APIError with its status;
    request validation and malformed JSON as 400 (not FastAPI's 422); HTTP errors
    (404 route, 405 method) keep their status; anything else is a logged 500."""
    from fastapi.exceptions import RequestValidationError
    from starlette.exceptions import HTTPException as StarletteHTTPException

    async def on_api_error(request, exc: APIError):
        return json_response(exc)

    async def on_validation(request, exc):
        return json_response(from_validation_error(exc))

    async def on_json(request, exc: json.JSONDecodeError):
        return json_response(invalid_request(f"Invalid JSON in the request body: {exc}"))

    async def on_http(request, exc: StarletteHTTPException):
        status = exc.status_code
        typ = INVALID_REQUEST if status < 500 else SERVER_ERROR
        code = "not_found" if status == 404 else None
        err = APIError(status, str(exc.detail), typ, None, code, dict(exc.headers or {}))
        return json_response(err)

    async def on_unhandled(request, exc: Exception):
        logger.exception("unhandled error on %s", request.url.path, exc_info=exc)
        return json_response(internal_error())

    app.add_exception_handler(APIError, on_api_error)
    app.add_exception_handler(RequestValidationError, on_validation)
    app.add_exception_handler(ValidationError, on_validation)
    app.add_exception_handler(json.JSONDecodeError, on_json)
    app.add_exception_handler(StarletteHTTPException, on_http)
    app.add_exception_handler(Exception, on_unhandled)
