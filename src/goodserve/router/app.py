"""The OpenAI-compatible router: FastAPI in front of goodserve (or any OpenAI-compatible) servers.

Two modes:

- **replicas**: each request goes to one backend chosen by a policy (:mod:`goodserve.router.policies`); its
  body is forwarded unchanged and the answer (JSON or an SSE stream) comes back unchanged, status included.
- **P/D** (disaggregated prefill/decode): a first hop to a prefill instance (least queued prefill tokens)
  and a second to a decode instance (least KV usage, then outstanding tokens); see
  :mod:`goodserve.router.protocol` for the bodies. The decode instance's answer is the client's.

Faults: a backend that refuses the connection or does not accept it within ``connect_timeout`` is marked
unhealthy and the request goes to another backend of the same kind (nothing was sent, so nothing is lost);
with none left the router answers 503 at once, with ``Retry-After`` (``health_interval`` rounded up, at least
1 s), and in P/D mode sends no prefill hop while no decode instance is healthy. A connection lost after the
request was sent but before any byte of the answer reached the client (e.g. the instance was killed while
prefilling) marks the backend unhealthy and retries the request once on another backend; without one left, or
on a second loss, the client gets a 503. A connection lost mid-stream, after bytes were relayed, ends the
client's stream with an OpenAI error event (``code`` 503) and ``[DONE]``. Every backend's ``/health`` is
probed every ``health_interval`` seconds (logged at DEBUG; a backend going down or coming back at WARNING),
which brings a restarted backend back. A client that leaves during a stream closes the upstream stream (the
backend aborts the request). In P/D mode a client that leaves during a hop closes that hop's upstream request
too (the backend sees the disconnect and aborts it), and once the prefill hop has published a handle that
no consumer will pull (the client left, no decode instance took it, or it answered an error) the router asks
the producer to free the hold at once (``POST /v1/kv_transfer/release``, checked against the handle's lease)
instead of leaving it to the producer's timeout. In-flight counters are released in ``finally`` blocks,
whatever happens.
``/health`` reports every backend's state and its own last ``/health`` answer; ``/metrics`` is the router's
registry followed by every backend's metrics, each sample labelled ``instance="<backend url>"``
(:func:`goodserve.router.metrics.relabel_metrics`).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import logging
import math
from typing import Optional, Sequence

import anyio
import httpx
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest

from goodserve.kv_events.index import KVIndex
from goodserve.router.kv_follow import KVEventFollower
from goodserve.router.metrics import FixedFamilies, RouterMetrics, relabel_metrics
from goodserve.router.policies import (BackendState, KVAware, LeastLoaded, NoHealthyBackendError, RouteRequest,
                                       RoutingPolicy, make_policy)
from goodserve.router.disaggregated import forward_disaggregated
from goodserve.router.protocol import RouterRequestError, UpstreamLostError, error_body
from goodserve.router.tokenize import PromptTokenizer

logger = logging.getLogger(__name__)


@dataclasses.dataclass
class Backend:
    """One upstream server: ``url`` (base URL, no trailing slash), ``role`` (replica, prefill or decode) and
    the :class:`BackendState` the policies read."""

    url: str
    role: str
    state: BackendState
    last_health: Optional[dict] = None  # the last probe: {"status_code", "body"} or {"error"}


class _Flight:
    """One request in flight at one backend: counts it in, and out exactly once."""

    def __init__(self, router: "Router", backend: Backend, request: RouteRequest, prefill_tokens: int) -> None:
        self.router, self.backend, self.request = router, backend, request
        self.prefilled = self.ended = False
        self.outcome = "aborted"
        self.prefill_tokens = backend.state.start(request, prefill_tokens)
        router.metrics.in_flight.labels(backend.url).inc()

    def first_output(self) -> None:
        if not self.prefilled:
            self.prefilled = True
            self.backend.state.prefilled(self.request, self.prefill_tokens)

    def end(self, outcome: Optional[str] = None) -> None:
        if self.ended:
            return
        self.ended = True
        self.backend.state.finish(self.request, self.prefilled, self.prefill_tokens)
        m = self.router.metrics
        m.in_flight.labels(self.backend.url).dec()
        m.requests.labels(self.backend.url, self.backend.role, outcome or self.outcome).inc()


class _RelayResponse(StreamingResponse):
    """Streams an upstream SSE response whose first chunk was already read; however the stream ends (done,
    client gone, cancelled, never started), the flight is counted out and the upstream response closed (which
    aborts it at the backend). A connection lost mid-stream ends the client's stream with an OpenAI error
    event (``code`` 503) and ``data: [DONE]``."""

    def __init__(self, upstream: httpx.Response, chunks, first: bytes, flight: _Flight) -> None:
        self.upstream, self.flight = upstream, flight
        super().__init__(self._chunks(chunks, first), status_code=upstream.status_code,
                         media_type=upstream.headers.get("content-type"))

    async def _chunks(self, chunks, first: bytes):
        last = first
        try:
            yield first
            async for chunk in chunks:
                yield chunk
                last = chunk
            self.flight.outcome = "ok" if self.upstream.is_success else "http_error"
        except httpx.HTTPError as e:  # the backend went away mid-stream
            self.flight.outcome = "backend_error"
            router, url = self.flight.router, self.flight.backend.url
            router.metrics.backend_errors.labels(url, type(e).__name__).inc()
            router.set_health(self.flight.backend, False, f"connection lost mid-stream: {type(e).__name__}")
            body = error_body(f"the backend {url} was lost mid-stream ({type(e).__name__}); the answer is "
                              "incomplete", "service_unavailable", 503)
            sep = b"" if last.endswith(b"\n\n") else b"\n\n"  # close a partly relayed event first
            yield sep + b"data: " + json.dumps(body).encode() + b"\n\ndata: [DONE]\n\n"

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self.flight.end()
            with anyio.CancelScope(shield=True):
                await self.upstream.aclose()


def _error(status: int, message: str, type_: str, param: Optional[str] = None,
           headers: Optional[dict] = None) -> JSONResponse:
    return JSONResponse(error_body(message, type_, status, param), status_code=status, headers=headers)


def quiet_client_logs() -> None:
    """Raise the ``httpx`` and ``httpcore`` loggers to WARNING: httpx logs every request at INFO (``HTTP
    Request: GET .../health ...``), so the router's health probes would be most of its log. A level already
    set on those loggers is kept, and so is DEBUG (``--log-level DEBUG`` still shows every request)."""
    for name in ("httpx", "httpcore"):
        log = logging.getLogger(name)
        if log.level == logging.NOTSET and log.getEffectiveLevel() > logging.DEBUG:
            log.setLevel(logging.WARNING)


class Router:
    """Backends, policies, the HTTP client and the health prober behind the routes.

    Args:
        replicas: Base URLs of colocated replicas (replicas mode).
        prefill: Base URLs of prefill instances (P/D mode, with ``decode``).
        decode: Base URLs of decode instances.
        policy: The replicas' policy (ignored in P/D mode, whose pools use :class:`LeastLoaded`).
        connect_timeout: Seconds to wait for a TCP connection before the backend counts as down.
        health_interval: Seconds between ``/health`` probes of every backend.
        tokenizer: The served model's tokenizer: text and chat prompts get token ids for ``kv-aware`` routing
            (``None``: only prompts sent as token ids do).

    Raises:
        ValueError: if neither or both modes are given, or a URL is not ``http(s)://``.
    """

    def __init__(self, replicas: Sequence[str] = (), prefill: Sequence[str] = (), decode: Sequence[str] = (),
                 policy: Optional[RoutingPolicy] = None, connect_timeout: float = 1.0,
                 health_interval: float = 1.0, tokenizer: Optional[PromptTokenizer] = None) -> None:
        if bool(replicas) == bool(prefill or decode) or bool(prefill) != bool(decode):
            raise ValueError("give either replicas, or both prefill and decode instances")
        self.pools: dict[str, list[Backend]] = {}
        for role, urls in (("replica", replicas), ("prefill", prefill), ("decode", decode)):
            if urls:
                self.pools[role] = [self._backend(u, role) for u in urls]
        self.policies: dict[str, RoutingPolicy] = {
            "replica": policy or make_policy("round-robin"),
            "prefill": LeastLoaded("queued_prefill_tokens"), "decode": LeastLoaded("kv_usage")}
        replica_policy = self.policies["replica"]
        # The backends' KV events: the kv-aware policy's index, and the loads (KV usage) every policy may read.
        self.kv_events = KVEventFollower(replica_policy.index if isinstance(replica_policy, KVAware) else KVIndex())
        self.connect_timeout, self.health_interval = connect_timeout, health_interval
        self.tokenizer = tokenizer
        self.metrics = RouterMetrics()
        for b in self.backends:
            self.metrics.healthy.labels(b.url).set(1)
        self._client: Optional[httpx.AsyncClient] = None
        self._prober: Optional[asyncio.Task] = None

    @staticmethod
    def _backend(url: str, role: str) -> Backend:
        if not url.startswith(("http://", "https://")):
            raise ValueError(f"backend URL must start with http:// or https://, got {url!r}")
        url = url.rstrip("/")
        return Backend(url, role, BackendState(name=url))

    @property
    def backends(self) -> list[Backend]:
        return [b for pool in self.pools.values() for b in pool]

    @property
    def disaggregated(self) -> bool:
        return "prefill" in self.pools

    @property
    def retry_after(self) -> str:
        """The ``Retry-After`` of a 503 for no healthy backend: ``health_interval`` rounded up to whole
        seconds, at least 1 (the next probe may bring a backend back)."""
        return str(max(1, math.ceil(self.health_interval)))

    def unavailable(self, message: str) -> JSONResponse:
        """A 503 ``service_unavailable`` OpenAI error body with ``message``, and a ``Retry-After`` header
        (:attr:`retry_after`)."""
        return _error(503, message, "service_unavailable", headers={"Retry-After": self.retry_after})

    async def start(self) -> None:
        """Create the HTTP client and start the health prober (idempotent; routes call it); quiet httpx's
        per-request INFO log (:func:`quiet_client_logs`)."""
        if self._client is None:
            quiet_client_logs()
            self._client = httpx.AsyncClient(timeout=httpx.Timeout(None, connect=self.connect_timeout),
                                             limits=httpx.Limits(max_connections=None), trust_env=False)
            self._prober = asyncio.get_running_loop().create_task(self._probe_forever())

    async def close(self) -> None:
        """Stop the prober and the KV event subscribers, and close the client's connections."""
        await self.kv_events.close()
        if self._prober is not None:
            self._prober.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._prober
        if self._client is not None:
            await self._client.aclose()
        self._client = self._prober = None

    def set_health(self, backend: Backend, healthy: bool, why: str = "") -> None:
        if backend.state.healthy != healthy:
            logger.warning("backend %s (%s) is %s%s", backend.url, backend.role, "back" if healthy else "down",
                           f": {why}" if why else "")
        backend.state.healthy = healthy
        self.metrics.healthy.labels(backend.url).set(int(healthy))

    async def _probe(self, backend: Backend) -> None:
        try:
            r = await self._client.get(backend.url + "/health", timeout=max(self.connect_timeout, 1.0))
            try:
                body = r.json() if r.content else None
            except ValueError:
                body = r.text
            backend.last_health = {"status_code": r.status_code, "body": body}
            was_healthy = backend.state.healthy
            logger.debug("probe %s: /health answered %d", backend.url, r.status_code)
            self.set_health(backend, r.status_code == 200, f"/health answered {r.status_code}")
            if r.status_code == 200 and (not was_healthy or backend.url not in self.kv_events.info):
                await self.kv_events.check(self._client, backend.url, max(self.connect_timeout, 1.0))
        except httpx.HTTPError as e:
            backend.last_health = {"error": f"{type(e).__name__}: {e}"}
            logger.debug("probe %s: /health failed: %s", backend.url, backend.last_health["error"])
            self.set_health(backend, False, f"/health failed: {type(e).__name__}")

    async def _probe_forever(self) -> None:
        while True:
            await asyncio.sleep(self.health_interval)
            await asyncio.gather(*(self._probe(b) for b in self.backends))

    def refresh_kv_usage(self, pool: Sequence[Backend]) -> None:
        """Set each backend's ``kv_usage`` to what it last published with its KV events (``None``: nothing)."""
        for b in pool:
            load = self.kv_events.load(b.url)
            b.state.kv_usage = load.kv_usage if load is not None else None

    async def open(self, role: str, path: str, body: dict, request: RouteRequest) -> tuple[_Flight, httpx.Response]:
        """Send ``body`` to a backend of ``role`` chosen by its policy; on a failed connection mark that backend
        unhealthy and choose again.

        Returns:
            The flight (counted in; the caller ends it) and the upstream response, headers read, body unread.

        Raises:
            NoHealthyBackendError: no healthy backend of ``role`` is left.
            UpstreamLostError: the connection was lost after the request was sent, before the answer's
                headers (the backend is marked unhealthy).
        """
        pool, policy = self.pools[role], self.policies[role]
        self.refresh_kv_usage(pool)
        while True:
            backend = pool[policy.select([b.state for b in pool], request)]
            flight = _Flight(self, backend, request, policy.prefill_tokens(backend.state, request))
            try:
                req = self._client.build_request("POST", backend.url + path, json=body)
                return flight, await self._client.send(req, stream=True)
            except (httpx.ConnectError, httpx.ConnectTimeout) as e:
                flight.end("connect_error")
                self.metrics.backend_errors.labels(backend.url, type(e).__name__).inc()
                self.set_health(backend, False, f"{type(e).__name__}: {e}")
            except httpx.HTTPError as e:  # sent, then lost before the answer's headers
                flight.end("backend_error")
                self.metrics.backend_errors.labels(backend.url, type(e).__name__).inc()
                self.set_health(backend, False, f"connection lost before the answer: {type(e).__name__}")
                raise UpstreamLostError(backend.url, e) from e
            except BaseException as e:
                flight.end("aborted" if isinstance(e, asyncio.CancelledError) else "backend_error")
                raise

    async def relay(self, flight: _Flight, upstream: httpx.Response) -> Response:
        """The client's response: the upstream's status, content type and body, streamed if it is SSE. The
        first chunk (or the whole body) is read before anything goes to the client.

        Raises:
            UpstreamLostError: the connection was lost before any byte was read (the backend is marked
                unhealthy; nothing reached the client, so the caller may retry elsewhere).
        """
        try:
            if upstream.headers.get("content-type", "").startswith("text/event-stream"):
                chunks = upstream.aiter_raw()
                first = b""
                while not first:  # an empty chunk carries nothing: wait for bytes (or the end)
                    first = await chunks.__anext__()
                flight.first_output()
                return _RelayResponse(upstream, chunks, first, flight)
            content = await upstream.aread()
            flight.outcome = "ok" if upstream.is_success else "http_error"
        except (httpx.HTTPError, StopAsyncIteration) as e:
            flight.outcome = "backend_error"
            flight.end()
            await upstream.aclose()
            self.metrics.backend_errors.labels(flight.backend.url, type(e).__name__).inc()
            self.set_health(flight.backend, False, f"connection lost before the answer: {type(e).__name__}")
            raise UpstreamLostError(flight.backend.url, e) from e
        except BaseException:
            flight.end()
            await upstream.aclose()
            raise
        flight.end()
        await upstream.aclose()
        return Response(content, status_code=upstream.status_code, media_type=upstream.headers.get("content-type"))

    async def route(self, role: str, path: str, body: dict, request: RouteRequest) -> Response:
        """Open a request on a backend of ``role`` and relay its answer; if the connection is lost before any
        byte of the answer arrived, retry once on another healthy backend of ``role``.

        Raises:
            NoHealthyBackendError: no healthy backend of ``role`` (also after a lost connection).
            UpstreamLostError: the connection was lost again on the retry.
        """
        try:
            return await self.relay(*await self.open(role, path, body, request))
        except UpstreamLostError as e:
            logger.warning("%s; retrying once on another %s backend", e, role)
            return await self.relay(*await self.open(role, path, body, request))

    async def forward(self, path: str, body: dict, http_request: Request) -> Response:
        """Route one completions/chat request (either mode) and answer it."""
        request = RouteRequest.from_openai_body(body)
        if self.tokenizer is not None and request.token_ids is None:
            ids = await asyncio.to_thread(self.tokenizer.token_ids, body)
            if ids:
                request = dataclasses.replace(request, token_ids=ids, prompt_tokens=len(ids))
        if not self.disaggregated:
            return await self.route("replica", path, body, request)
        return await forward_disaggregated(self, path, body, request, http_request)


async def _json_object(request: Request) -> dict:
    try:
        body = json.loads(await request.body())
    except ValueError as e:  # invalid JSON or invalid UTF-8
        raise RouterRequestError(f"the request body is not valid JSON: {e}") from None
    if not isinstance(body, dict):
        raise RouterRequestError("the request body must be a JSON object")
    return body


def build_router_app(router: Router) -> FastAPI:
    """The router's FastAPI app. Routes: ``POST /v1/completions``, ``POST /v1/chat/completions``,
    ``GET /v1/models`` (from the first healthy backend), ``GET /health`` (200 while every pool has a healthy
    backend, 503 otherwise; per-backend state as JSON) and ``GET /metrics``. Router-made errors are OpenAI
    error bodies: 400 ``invalid_request_error``, 502 ``bad_gateway``, 503 ``service_unavailable`` (with
    ``Retry-After`` when no backend of the needed kind is healthy)."""

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI):
        await router.start()
        yield
        await router.close()

    app = FastAPI(title="goodserve router", lifespan=lifespan)
    app.state.router = router

    async def completions(request: Request, path: str) -> Response:
        await router.start()
        try:
            return await router.forward(path, await _json_object(request), request)
        except RouterRequestError as e:
            router.metrics.local.labels("400", "invalid_request").inc()
            return _error(400, e.message, "invalid_request_error", e.param)
        except NoHealthyBackendError as e:
            router.metrics.local.labels("503", "no_healthy_backend").inc()
            return router.unavailable(str(e))
        except UpstreamLostError as e:
            router.metrics.local.labels("503", "backend_lost").inc()
            return _error(503, str(e), "service_unavailable")
        except httpx.HTTPError as e:
            router.metrics.local.labels("502", "backend_error").inc()
            return _error(502, f"the backend failed: {type(e).__name__}: {e}", "bad_gateway")

    @app.post("/v1/completions")
    async def create_completion(request: Request) -> Response:
        return await completions(request, "/v1/completions")

    @app.post("/v1/chat/completions")
    async def create_chat_completion(request: Request) -> Response:
        return await completions(request, "/v1/chat/completions")

    @app.get("/v1/models")
    async def models() -> Response:
        await router.start()
        for b in router.backends:
            if b.state.healthy:
                try:
                    r = await router._client.get(b.url + "/v1/models")
                    return Response(r.content, status_code=r.status_code, media_type=r.headers.get("content-type"))
                except httpx.HTTPError as e:
                    router.set_health(b, False, f"/v1/models failed: {type(e).__name__}")
        return router.unavailable("no backend is healthy")

    @app.get("/health")
    async def health() -> JSONResponse:
        await router.start()
        ok = all(any(b.state.healthy for b in pool) for pool in router.pools.values())
        backends = [{"url": b.url, "role": b.role, **dataclasses.asdict(b.state), "health": b.last_health,
                     "kv_events": router.kv_events.describe(b.url)} for b in router.backends]
        return JSONResponse({"healthy": ok, "backends": backends}, status_code=200 if ok else 503)

    @app.get("/metrics")
    async def metrics() -> Response:
        """The router's registry, then every reachable backend's metrics labelled ``instance="<url>"`` (a
        family several backends serve is exposed once, with all their samples)."""
        await router.start()

        async def scrape(b: Backend) -> list:
            try:
                r = await router._client.get(b.url + "/metrics", timeout=max(router.connect_timeout, 2.0))
                r.raise_for_status()
                return relabel_metrics(r.text, b.url)
            except (httpx.HTTPError, ValueError) as e:
                router.metrics.backend_errors.labels(b.url, f"metrics_{type(e).__name__}").inc()
                return []

        merged: dict[str, object] = {}
        for fams in await asyncio.gather(*(scrape(b) for b in router.backends)):
            for fam in fams:
                if fam.name in merged:
                    merged[fam.name].samples.extend(fam.samples)
                else:
                    merged[fam.name] = fam
        for b in router.backends:
            view = router.kv_events.index.instances.get(b.url)
            router.metrics.kv_index_blocks.labels(b.url).set(len(view.hashes) if view is not None else 0)
        text = generate_latest(router.metrics.registry)
        if merged:
            registry = CollectorRegistry(auto_describe=False)
            registry.register(FixedFamilies(list(merged.values())))
            text += generate_latest(registry)
        return Response(text, media_type=CONTENT_TYPE_LATEST)

    return app
