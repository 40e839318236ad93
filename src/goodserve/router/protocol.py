"""The router's wire rules: the P/D two-hop request bodies and OpenAI error bodies (pure functions), and its
errors (a request it refuses, a backend lost before answering).

The P/D hop protocol follows vLLM's disaggregated-serving proxy (``kv_transfer_params``): the first hop asks
a prefill instance for one token and to keep the prompt's KV for a remote decode
(``do_remote_decode: true``); its answer carries a top-level ``kv_transfer_params`` object, which the second
hop hands, with the client's original body, to a decode instance.
"""

from __future__ import annotations

import copy
from typing import Any, Optional, Union


class RouterRequestError(ValueError):
    """A request the router refuses itself (HTTP 400, ``invalid_request_error``).

    Args:
        message: What is wrong, for the client.
        param: The request field at fault.
    """

    def __init__(self, message: str, param: Optional[str] = None) -> None:
        super().__init__(message)
        self.message, self.param = message, param


class UpstreamLostError(Exception):
    """The connection to a backend was lost after the request was sent and before any byte of its answer
    arrived (the router retries once, then answers 503).

    Args:
        url: The backend's base URL.
        cause: The transport error.
    """

    def __init__(self, url: str, cause: BaseException) -> None:
        super().__init__(f"the backend {url} was lost before answering ({type(cause).__name__}: {cause})")
        self.url = url


def error_body(message: str, type_: str, code: Union[int, str, None], param: Optional[str] = None) -> dict:
    """An OpenAI-style error body: ``{"error": {"message", "type", "param", "code"}}``."""
    return {"error": {"message": message, "type": type_, "param": param, "code": code}}


def prefill_request_body(body: dict[str, Any]) -> dict[str, Any]:
    """The first hop's body, for a prefill instance: ``body`` with ``max_tokens: 1`` (and
    ``max_completion_tokens: 1`` if present), ``stream: false``, no ``stream_options``, and
    ``kv_transfer_params: {"do_remote_decode": true, "do_remote_prefill": false}``. ``body`` is not changed.

    Raises:
        RouterRequestError: if ``n`` is given and is not 1 (one prefill serves one sequence), param ``n``.
    """
    n = body.get("n")
    if n is not None and (not isinstance(n, int) or isinstance(n, bool) or n != 1):
        raise RouterRequestError(f"n must be 1 with disaggregated prefill/decode, got {n!r}", param="n")
    first = copy.deepcopy(body)
    first["max_tokens"] = 1
    if "max_completion_tokens" in first:
        first["max_completion_tokens"] = 1
    first["stream"] = False
    first.pop("stream_options", None)
    first["kv_transfer_params"] = {"do_remote_decode": True, "do_remote_prefill": False}
    return first


def decode_request_body(body: dict[str, Any], prefill_response: Any) -> dict[str, Any]:
    """The second hop's body, for a decode instance: the client's original ``body`` plus the prefill answer's
    ``kv_transfer_params`` object. ``body`` is not changed.

    Raises:
        LookupError: if ``prefill_response`` is not a JSON object with a ``kv_transfer_params`` object (the
            router answers 502).
    """
    params = prefill_response.get("kv_transfer_params") if isinstance(prefill_response, dict) else None
    if not isinstance(params, dict):
        raise LookupError("the prefill instance's response has no kv_transfer_params object")
    second = copy.deepcopy(body)
    second["kv_transfer_params"] = params
    return second
