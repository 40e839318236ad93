"""Errors of the OpenAI-compatible server: every failure becomes an OpenAI-style error body, and is counted.

Whose fault decides the status: what the client sent is a 400 (``ValueError`` from validation, a body that
is not JSON or not valid Unicode), an unknown model or route a 404, a full queue a 429; a fault of ours is a
500 (``InternalServerError``: a request whose own processing raised, or a bug in a route), and a dead
engine a 503. :func:`to_api_error` is the one mapping from exceptions to statuses; the server installs it as
the handler of every exception type, so no response ever leaves without an error body.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import re
from typing import Callable, Optional, Union

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from starlette.requests import ClientDisconnect
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from goodserve.engine.async_types import EngineDeadError, EngineShutdownError, RequestFailedError
from goodserve.scheduler.policy import SLOUnattainableError
from goodserve.server import protocol as P
from goodserve.validation import ParamError, safe_text

logger = logging.getLogger(__name__)

ERROR_TYPES = {400: "BadRequestError", 404: "NotFoundError", 405: "MethodNotAllowedError",
               413: "PayloadTooLargeError", 415: "UnsupportedMediaTypeError", 429: "RateLimitError",
               500: "InternalServerError", 503: "ServiceUnavailableError"}


class APIError(Exception):
    """An error answered with an OpenAI error body.

    Args:
        status: HTTP status code.
        message: What went wrong, for the client.
        type_: OpenAI error type (default: by status, e.g. ``BadRequestError``).
        param: The request field at fault, if any.
        code: A machine-readable code (default: the status).
        headers: Extra response headers (e.g. ``Retry-After``).
    """

    def __init__(self, status: int, message: str, type_: Optional[str] = None, param: Optional[str] = None,
                 code: Optional[Union[int, str]] = None, headers: Optional[dict[str, str]] = None) -> None:
        super().__init__(message)
        self.status, self.message, self.param = status, message, param
        self.type = type_ or ERROR_TYPES.get(status, "BadRequestError" if status < 500 else "InternalServerError")
        self.code = code if code is not None else status
        self.headers = headers

    @property
    def reason(self) -> str:
        """A short label for metrics: the string ``code`` if there is one, else the error type."""
        return self.code if isinstance(self.code, str) else self.type

    def body(self) -> P.ErrorResponse:
        """The OpenAI error body (any lone surrogate quoted from the input is escaped)."""
        return P.ErrorResponse(error=P.ErrorInfo(message=safe_text(self.message), type=self.type,
                                                 param=safe_text(self.param) if self.param else None, code=self.code))

    def response(self) -> JSONResponse:
        return JSONResponse(self.body().model_dump(), status_code=self.status, headers=self.headers)


_TYPE_TAGS = {"str", "int", "float", "bool", "list", "dict", "none"}


def _param(loc: tuple) -> str:
    """A pydantic error location as a field path, e.g. ``messages[0].content``: without the leading
    ``body`` and without the union-branch tags pydantic inserts (``constrained-str``, ``list[int]``)."""
    out = ""
    for x in loc[1:] if loc and loc[0] == "body" else loc:
        if isinstance(x, int):
            out += f"[{x}]"
        elif isinstance(x, str) and x.isidentifier() and x not in _TYPE_TAGS:
            out += f".{x}" if out else x
    return out


def _validation_error(e: RequestValidationError) -> APIError:
    errors = e.errors()
    first = errors[0] if errors else {"loc": (), "msg": "invalid request"}
    ctx = first.get("ctx") or {}
    if first.get("type") == "json_invalid":
        return APIError(400, f"the body is not valid JSON: {ctx.get('error', first.get('msg'))}",
                        code="invalid_json")
    if "param" in ctx:  # raised by our own validators, which name the field
        return APIError(400, str(first.get("msg")), param=ctx["param"], code=ctx.get("code"))
    loc = _param(first.get("loc", ()))
    if first.get("type") == "extra_forbidden":
        return APIError(400, f"Unrecognized request argument supplied: {loc} (docs/openai.md lists the fields this "
                        "server accepts)", param=loc or None, code="unrecognized_argument")
    return APIError(400, f"{loc}: {first.get('msg')}" if loc else str(first.get("msg")), param=loc or None)


def to_api_error(e: BaseException) -> APIError:
    """Map any exception to the error the client gets (see the module docstring)."""
    if isinstance(e, APIError):
        return e
    if isinstance(e, RequestValidationError):
        return _validation_error(e)
    if isinstance(e, ParamError):
        return APIError(400, str(e), param=e.param, code=e.code)
    if isinstance(e, ValueError):
        msg = str(e)
        m = re.match(r"(\w+) must", msg)
        return APIError(400, msg, param=m.group(1) if m else None)
    if isinstance(e, EngineShutdownError):
        return APIError(503, str(e), code="shutting_down")
    if isinstance(e, EngineDeadError):
        return APIError(503, str(e), code="engine_dead")
    if isinstance(e, SLOUnattainableError):
        return APIError(429, str(e), code="slo_unattainable", headers={"Retry-After": "1"})
    if isinstance(e, RequestFailedError):
        return APIError(500, f"the server failed while processing this request: {e}", code="request_failed")
    if isinstance(e, StarletteHTTPException):
        if isinstance(e.__cause__, UnicodeDecodeError):
            return APIError(400, f"the body is not valid JSON: it is not UTF-8 ({e.__cause__.reason})",
                            code="invalid_json")
        return APIError(e.status_code, str(e.detail), headers=getattr(e, "headers", None))
    return internal_error(e)


def internal_error(e: BaseException, doing: str = "") -> APIError:
    """A 500 for a fault of ours (logged with its traceback); never a 400, whatever the exception type."""
    logger.error("internal error%s", f" while {doing}" if doing else "", exc_info=e)
    return APIError(500, f"internal server error: {type(e).__name__}: {e}", code="internal_error")


def install_error_handlers(app: FastAPI, on_error: Callable[[dict, APIError], None],
                           on_abort: Callable[[dict], None]) -> None:
    """Answer every exception raised by a route with an OpenAI error body; ``on_error(scope, error)`` counts
    it. A client that left before its body was read is no error: ``on_abort(scope)`` counts it and the
    answer is a bare 499.

    FastAPI's own validation and HTTP errors get handlers here (they replace FastAPI's defaults: a 422, a
    plain ``detail``); everything else is caught by a middleware and mapped by :func:`to_api_error`, so a bug
    of ours is a 500 with a body, not Starlette's plain-text 500 and a dropped connection. A call cancelled
    by a shutdown is counted as a 503 ``shutting_down`` and answered so if its response has not started.
    """
    def answer(request: Request, e: BaseException) -> Response:
        if isinstance(e, ClientDisconnect) or isinstance(e.__cause__, ClientDisconnect):
            on_abort(request.scope)
            return Response(status_code=499)
        if isinstance(e, RequestValidationError) and not _is_json(request):
            err = APIError(415, "the body must be JSON: send it with 'Content-Type: application/json'",
                           code="unsupported_media_type")
        else:
            err = to_api_error(e)
        on_error(request.scope, err)
        return err.response()

    async def handle(request: Request, e: Exception) -> Response:
        return answer(request, e)

    for exc in (RequestValidationError, StarletteHTTPException):
        app.add_exception_handler(exc, handle)

    class CatchAll:
        def __init__(self, inner: ASGIApp) -> None:
            self.inner = inner

        async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
            if scope["type"] != "http":
                await self.inner(scope, receive, send)
                return
            started = False

            async def watch(message: Message) -> None:
                nonlocal started
                started = started or message["type"] == "http.response.start"
                await send(message)

            try:
                await self.inner(scope, receive, watch)
            except asyncio.CancelledError:  # the server is shutting down and cut this call short
                err = APIError(503, "the server is shutting down", code="shutting_down")
                on_error(scope, err)
                if not started:
                    with contextlib.suppress(BaseException):
                        await err.response()(scope, receive, send)
                raise
            except Exception as e:  # noqa: BLE001 - mapped to an error body; the server serves on
                if started:
                    logger.error("%s %s failed after its response started", scope.get("method"),
                                 scope.get("path"), exc_info=e)
                    return
                await answer(Request(scope), e)(scope, receive, send)

    app.add_middleware(CatchAll)


def _is_json(request: Request) -> bool:
    media = request.headers.get("content-type", "").split(";")[0].strip().lower()
    return media in ("", "application/json") or media.endswith("+json")
