"""The router's P/D mode: a prefill hop, then a decode hop (bodies in :mod:`goodserve.router.protocol`), and
what the router does when the request dies between or during them.

A hop whose client disconnects is cancelled: its upstream request is closed, the backend sees the
disconnect and aborts (a producer frees the prompt's blocks at once). Once the prefill hop has
published a handle, the producer holds the prompt's blocks for a consumer; whenever no consumer will pull
them (the client left, no decode instance took the request, or it answered an error) the router asks the
producer to free them at once (``POST /v1/kv_transfer/release`` with the handle, checked there against its
lease; a hold a consumer is reading is left to that consumer) instead of leaving them to the producer's
``--kv-transfer-timeout``. While no decode instance is healthy no prefill hop is sent at all (a 503 at once:
its hold would wait for nobody); a decode pool that goes down between that check and the decode hop is the
release case above.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import logging
from typing import TYPE_CHECKING, Any, Coroutine, Optional, TypeVar, Union

import httpx
from fastapi import Request
from fastapi.responses import JSONResponse, Response

from goodserve.router.policies import NoHealthyBackendError, RouteRequest
from goodserve.router.protocol import UpstreamLostError, decode_request_body, error_body, prefill_request_body

if TYPE_CHECKING:
    from goodserve.router.app import Backend, Router

logger = logging.getLogger(__name__)
T = TypeVar("T")


async def forward_disaggregated(router: "Router", path: str, body: dict, request: RouteRequest,
                                http_request: Request) -> Response:
    """Serve one completions/chat request through a prefill and a decode instance.

    Returns:
        The decode instance's answer (streamed or not), the prefill instance's error, a 502 if its answer has
        no handle, a bare 499 if the client left, or a 503 ``service_unavailable`` with ``Retry-After``
        before any hop if no decode instance is healthy (counted as ``local_errors{reason="no_healthy_decode"}``).

    Raises:
        RouterRequestError: a body the hops cannot carry (see :func:`prefill_request_body`).
        NoHealthyBackendError, UpstreamLostError, httpx.HTTPError: as :meth:`Router.route` (after the
            prefill hop, the hold is released first).
    """
    first = prefill_request_body(body)
    decode = router.pools["decode"]
    if not any(b.state.healthy for b in decode):
        router.metrics.local.labels("503", "no_healthy_decode").inc()
        return router.unavailable(f"no decode instance is healthy (0 of {len(decode)}); the request was not "
                                  "sent to a prefill instance")
    hop = await unless_client_leaves(http_request, _prefill(router, path, first, request))
    if hop is None:
        logger.info("client left during the prefill hop: its request to the prefill instance is closed")
        return Response(status_code=499)
    if isinstance(hop, Response):
        return hop  # the prefill's error is the client's
    producer, answer = hop
    try:
        second = decode_request_body(body, answer)
    except LookupError as e:
        router.metrics.local.labels("502", "no_kv_transfer_params").inc()
        return JSONResponse(error_body(f"{e} (prefill backend {producer.url})", "bad_gateway", 502), status_code=502)
    handle = second["kv_transfer_params"]
    if await http_request.is_disconnected():
        logger.info("client left after the prefill hop: no decode hop, the producer's hold is freed")
        await release_hold(router, producer, handle)
        return Response(status_code=499)
    try:
        response = await unless_client_leaves(http_request, router.route("decode", path, second, request))
    except (NoHealthyBackendError, UpstreamLostError, httpx.HTTPError):
        await release_hold(router, producer, handle)
        raise
    if response is None or response.status_code >= 400:
        await release_hold(router, producer, handle)  # client gone, or the decode instance refused the request
    return Response(status_code=499) if response is None else response


async def _prefill(router: "Router", path: str, first: dict,
                   request: RouteRequest) -> Union[tuple["Backend", Any], Response]:
    """The first hop: ``(prefill backend, its JSON answer or None)``, or the response relaying its error."""
    flight, upstream = await router.open("prefill", path, first, dataclasses.replace(request, max_tokens=1))
    if not upstream.is_success:
        return await router.relay(flight, upstream)
    try:
        answer = json.loads(await upstream.aread())
        flight.outcome = "ok"
    except ValueError:
        answer = None
    finally:
        flight.first_output()
        flight.end()
        await upstream.aclose()
    return flight.backend, answer


async def release_hold(router: "Router", producer: "Backend", handle: dict) -> None:
    """Ask ``producer`` to free the hold ``handle`` names at once, and count its answer (best effort: on any
    failure the hold ends by the producer's own timeout)."""
    try:
        r = await router._client.post(producer.url + "/v1/kv_transfer/release", json={"kv_transfer_params": handle},
                                      timeout=max(router.connect_timeout, 2.0))
        if r.status_code == 200:
            outcome = "released" if r.json().get("released") else "pulling"
        else:
            outcome = "not_found" if r.status_code == 404 else "error"
    except (httpx.HTTPError, ValueError, AttributeError) as e:
        logger.warning("freeing the KV hold of %s on %s failed: %s", handle.get("remote_request_id"), producer.url, e)
        outcome = "error"
    router.metrics.kv_releases.labels(producer.url, outcome).inc()


async def unless_client_leaves(http_request: Request, work: Coroutine[Any, Any, T]) -> Optional[T]:
    """Run ``work`` unless the client disconnects first; then cancel it (which closes its upstream request, so
    the backend sees the disconnect and aborts) and return ``None``."""
    task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(_wait_disconnect(http_request))
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
        if not task.done():
            task.cancel()
            with contextlib.suppress(BaseException):
                await task
    return None if task.cancelled() else task.result()


async def _wait_disconnect(http_request: Request) -> None:
    """Return once the client has disconnected (its body has been read)."""
    while (await http_request.receive())["type"] != "http.disconnect":
        pass
