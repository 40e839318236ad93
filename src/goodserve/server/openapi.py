"""What ``/openapi.json`` says each route answers: the real statuses, bodies and content types.

FastAPI documents a 422 for every route with a body; this server answers validation errors with a 400 and
an OpenAI error body instead (see :mod:`goodserve.server.errors`), so :func:`install_schema` takes the 422s
and their schemas out. Checked by a schemathesis run in the tests.
"""

from __future__ import annotations

from typing import Any, Optional

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi

from goodserve.server import protocol as P

_ERRORS = {
    400: "The request is invalid: malformed JSON, a field out of range, text that is not valid Unicode, a "
         "prompt over the context length (`context_length_exceeded`), a field this server does not implement "
         "(`unsupported_parameter`) or one the API does not define (`unrecognized_argument`); `param` names the "
         "field.",
    404: "The model does not exist on this server (`model_not_found`).",
    413: "The body is larger than the server accepts (16 MiB).",
    415: "The body is not JSON (`Content-Type: application/json` expected).",
    429: "Too many requests are waiting; retry after the seconds in the `Retry-After` header.",
    500: "The server failed while processing this request; other requests are unaffected.",
    503: "The server is shutting down (`shutting_down`), or its engine died (`engine_dead`) and the process is "
         "about to exit so that a supervisor restarts it.",
}


# One server-sent event, as schemathesis and OpenAPI 3.2 (``itemSchema``) read a stream: each event's fields.
_SSE_EVENT = {"type": "object", "required": ["data"], "properties": {"data": {"type": "string", "description": (
    "A chunk as JSON; or an error body `{\"error\": {...}}` if the request fails after the stream opened; the "
    "last event is `[DONE]`.")}}}


def responses(ok: Optional[type] = None, stream: bool = False,
              errors: tuple[int, ...] = (400, 404, 413, 415, 429, 500, 503),
              ok_description: str = "Success.") -> dict[int | str, dict[str, Any]]:
    """The ``responses=`` argument of a route.

    Args:
        ok: The JSON model of a 200, if any.
        stream: A 200 may also be ``text/event-stream`` (``stream: true``): ``data:`` lines of chunk JSON,
            an error event on failure, and ``data: [DONE]``.
        errors: The error statuses the route can answer, each with an OpenAI error body.
        ok_description: What a 200 means.
    """
    out: dict[int | str, dict[str, Any]] = {}
    if ok is not None or stream:
        entry: dict[str, Any] = {"description": ok_description}
        if ok is not None:
            entry["model"] = ok
        if stream:
            entry["content"] = {"text/event-stream": {"schema": _SSE_EVENT}}
        out[200] = entry
    for status in errors:
        out[status] = {"model": P.ErrorResponse, "description": _ERRORS[status]}
        if status == 429:
            out[status]["headers"] = {"Retry-After": {"description": "Seconds to wait before retrying.",
                                                      "schema": {"type": "integer"}}}
    return out


def install_schema(app: FastAPI) -> None:
    """Make ``app.openapi()`` drop FastAPI's 422 responses and the validation-error schemas."""
    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            schema = get_openapi(title=app.title, version=app.version, description=app.description,
                                 routes=app.routes)
            for path in schema.get("paths", {}).values():
                for op in path.values():
                    op.get("responses", {}).pop("422", None)
            for name in ("HTTPValidationError", "ValidationError"):
                schema.get("components", {}).get("schemas", {}).pop(name, None)
            app.openapi_schema = schema
        return app.openapi_schema

    app.openapi = openapi  # type: ignore[method-assign]
