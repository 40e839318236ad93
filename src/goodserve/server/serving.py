"""How an OpenAI completion or chat call is served: its choices become engine requests, and their delta
outputs become one JSON response or one event stream, for both endpoints alike.

Every request is validated and accepted by the engine *before* a response starts, so a bad parameter or a
prompt over the context length is an HTTP 400 with an OpenAI error body even when ``stream=true`` (C09). A
choice of ``n`` (and each prompt of a batch) is an independent engine request; with a ``seed``, choice ``i``
uses ``seed + i``. Streamed deltas are the engine's delta outputs, which are whole UTF-8 characters and never
include a prefix of a stop string that might still match (C05, C10). A client that goes away, streaming or
not, has its requests aborted at once, which frees their KV blocks (C12). Every call ends in exactly one of
the four outcome counters (finished, aborted, rejected, failed).
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from dataclasses import dataclass
from typing import Any, AsyncIterator, Callable, Optional, Union

from fastapi import Request
from fastapi.responses import JSONResponse, Response

from goodserve.engine.async_engine import AsyncEngine
from goodserve.engine.async_types import RequestStream
from goodserve.engine.chat import render_chat
from goodserve.request_options import RequestOptions
from goodserve.sampling_params import SamplingParams
from goodserve.server import protocol as P
from goodserve.server.choices import Choice, iterate_choices, usage
from goodserve.server.errors import APIError, internal_error
from goodserve.server.metrics import ServerMetrics
from goodserve.server.slo_classes import SLOTarget, resolve_slo
from goodserve.server.streaming import EventStreamResponse, sse
from goodserve.server.token_bytes import TokenBytes

@dataclass(frozen=True)
class Shapes:
    """How one endpoint writes its answer: the response and chunk models, a choice of the full response, and
    a choice of a stream chunk carrying ``new_text``."""

    response: type
    chunk: type
    full: Callable[[Choice], Any]
    delta: Callable[[Choice, str], Any]


class OpenAIServing:
    """Serves completion and chat calls on an engine.

    Args:
        engine: A started :class:`AsyncEngine`.
        metrics: The app's metrics.
        model_name: The model name clients must use.
        max_waiting_requests: Answer 429 (with ``Retry-After``) while this many requests wait; ``None``: no
            limit.
        slo_classes: Named SLO classes a request may pick with ``slo_class``.
    """

    def __init__(self, engine: AsyncEngine, metrics: ServerMetrics, model_name: str,
                 max_waiting_requests: Optional[int] = None,
                 slo_classes: Optional[dict[str, SLOTarget]] = None) -> None:
        self.engine, self.metrics, self.model_name = engine, metrics, model_name
        self.max_waiting_requests = max_waiting_requests
        self.slo_classes = dict(slo_classes or {})
        self.tokenizer = engine.tokenizer
        self._token_bytes: Optional[TokenBytes] = None

    @property
    def token_bytes(self) -> TokenBytes:
        """Each token id's own bytes (built on first use: a few hundred ms for a 50k vocabulary)."""
        if self._token_bytes is None:
            self._token_bytes = TokenBytes(self.tokenizer, self.engine.vocab_size)
        return self._token_bytes

    async def check_params(self, params: list[SamplingParams]) -> None:
        """What only the engine can check (``logit_bias`` ids, a grammar that compiles), off the event loop:
        compiling a JSON schema can take a while, and the engine thread then finds it cached.

        Raises:
            ValueError: naming the field.
        """
        if params and (params[0].structured_outputs is not None or params[0].logit_bias):
            await asyncio.to_thread(self.engine.check_params, params[0])

    def check_model(self, name: Optional[str]) -> None:
        """Raises a 404 :class:`APIError` unless ``name`` is empty or the served model."""
        if name and name != self.model_name:
            raise APIError(404, f"The model `{name}` does not exist; this server serves `{self.model_name}`.",
                           param="model", code="model_not_found")

    def options_of(self, body: P.SamplingRequest) -> RequestOptions:
        """The request's :class:`RequestOptions`, built once from its body: priority, prefix-cache salt, SLOs
        (its own, its class's, else the engine's) and part in disaggregated serving.

        Raises:
            ValueError: naming ``slo_class`` for an unknown class, or a malformed ``kv_transfer_params``.
        """
        slo = resolve_slo(body.slo_class, body.slo_ttft_ms, body.slo_tpot_ms, self.slo_classes)
        return self.engine.config.request_options(body.priority, body.cache_salt, slo.ttft, slo.tpot, slo.name,
                                                  body.kv_transfer_params)

    def chat_prompt(self, messages: list[dict[str, Any]]) -> list[int]:
        """Prompt token ids of a conversation (see :func:`render_chat`)."""
        return render_chat(self.tokenizer, self.engine.chat_template, messages)

    def json(self, request: Request, body: Any) -> Response:
        """A JSON answer, counted as finished once it is serialised.

        Raises:
            APIError: a 500 if serialising it fails (a fault of ours, never a 400).
        """
        try:
            response = JSONResponse(body.model_dump())
        except Exception as e:  # noqa: BLE001 - the client's input was accepted: whatever fails here is ours
            raise internal_error(e, "building the response") from e
        self.metrics.count(request.scope, "finished")
        return response

    async def start(self, prompts: list[Union[str, list[int]]], params: list[SamplingParams], request_id: str,
                    options: RequestOptions) -> list[Choice]:
        """Add ``len(prompts) * len(params)`` engine requests; all accepted, or none (error raised).

        Args:
            options: The requests' options (:meth:`options_of`), the same for every prompt and choice.

        Raises:
            APIError: 429 while ``max_waiting_requests`` wait.
            SLOUnattainableError: when load shedding refuses one (answered 429).
            ValueError, EngineDeadError, Exception: as :meth:`AsyncEngine.add_request` (nothing is left queued).
        """
        await self.check_params(params)
        limit = self.max_waiting_requests
        if limit is not None and self.engine.num_waiting_total() >= limit:
            raise APIError(429, f"The server is busy: {limit} requests are already waiting. Retry later.",
                           code="queue_full", headers={"Retry-After": "1"})
        jobs = []
        for p, prompt in enumerate(prompts):
            for j, sp in enumerate(params):
                rid = f"{request_id}-{p * len(params) + j}"
                jobs.append((p, j, self.engine.add_request(prompt, sp, rid, options)))
        results = await asyncio.gather(*(job for _, _, job in jobs), return_exceptions=True)
        streams = [r for r in results if isinstance(r, RequestStream)]
        failure = next((r for r in results if isinstance(r, BaseException)), None)
        if failure is not None:
            self.engine.abort([s.request_id for s in streams])
            raise failure
        return [Choice(index=i, stream=s, tracker=self.metrics.tracker(options), prompt_index=p, first_of_prompt=j == 0,
                       skip_special_tokens=params[j].skip_special_tokens)
                for i, ((p, j, _), s) in enumerate(zip(jobs, streams))]

    def finish(self, choices: list[Choice]) -> None:
        """Abort whatever has not finished (client gone, error) and count it."""
        ids = []
        for c in choices:
            if not c.tracker.done:
                ids.append(c.stream.request_id)
                c.tracker.ended("abort")
        if ids:
            self.engine.abort(ids)

    async def respond(self, request: Request, body: P.SamplingRequest, choices: list[Choice], rid: str,
                      shapes: Shapes, head: list[Any]) -> Response:
        """The answer of completions and chat alike: a full response, or a stream of chunks (``head`` choices
        first, then deltas, then usage if asked for), in the endpoint's ``shapes``."""
        created = int(time.time())

        def chunk(items: list[Any], usage_info: Optional[P.UsageInfo] = None) -> str:
            return sse(shapes.chunk(id=rid, created=created, model=self.model_name, choices=items, usage=usage_info))

        if not body.stream:
            return await self._answer(request, choices, lambda: shapes.response(
                id=rid, created=created, model=self.model_name, usage=usage(choices),
                choices=[shapes.full(c) for c in choices], kv_transfer_params=choices[0].kv_transfer_params))
        return self._stream(request, choices, [chunk([h]) for h in head], lambda c, d: chunk([shapes.delta(c, d)]),
                            (lambda: chunk([], usage(choices))) if body.include_usage else None)

    async def _answer(self, request: Request, choices: list[Choice], build: Callable[[], Any]) -> Response:
        """A non-streamed answer: wait for every choice, then ``build()`` the body (499 if the client left).

        Raises:
            APIError: a 500 if building or serialising the body fails (a fault of ours, never a 400).
        """
        if await self._collect(request, choices) is None:
            self.metrics.count(request.scope, "aborted")
            await self._release_kv_holds(choices)
            return Response(status_code=499)
        try:
            body = build()
        except Exception as e:  # noqa: BLE001 - the client's input was accepted: whatever fails here is ours
            raise internal_error(e, "building the response") from e
        return self.json(request, body)

    async def _collect(self, request: Request, choices: list[Choice]) -> Optional[list[Choice]]:
        """Run all choices' requests to the end; ``None`` if the client disconnected first (or meanwhile)."""
        async def run() -> None:
            async with contextlib.aclosing(iterate_choices(choices)) as it:
                async for _ in it:
                    pass

        task = asyncio.create_task(run())
        watcher = asyncio.create_task(_wait_disconnect(request))
        try:
            await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
            if not task.done() or watcher.done():
                return None
            task.result()
            return choices
        finally:
            for t in (task, watcher):
                t.cancel()
            self.finish(choices)

    async def _release_kv_holds(self, choices: list[Choice]) -> None:
        """A producer whose client left just as its prefill finished frees the hold the answer would have
        published: nobody will pull it."""
        for c in choices:
            if c.kv_transfer_params is not None:
                handle = c.kv_transfer_params
                with contextlib.suppress(LookupError, ValueError):
                    await self.engine.call_async(lambda e: e.release_kv_hold(handle))

    def _stream(self, request: Request, choices: list[Choice], head: list[str], chunk: Callable[[Choice, str], str],
                usage_event: Optional[Callable[[], str]]) -> Response:
        """The one event stream of completions and chat: ``head`` events, then a ``chunk(choice, new_text)`` per
        new piece of text (or finish) of any choice, then the ``usage_event`` if asked for. Tokens whose text
        is held back (a partial character, a possible stop string) go out with the next chunk."""
        async def events() -> AsyncIterator[str]:
            for event in head:
                yield event
            async with contextlib.aclosing(iterate_choices(choices)) as it:
                async for choice, out in it:
                    if out.text or out.finished:
                        yield chunk(choice, out.text)
            if usage_event is not None:
                yield usage_event()

        def on_close(outcome: Optional[APIError | str]) -> None:
            self.finish(choices)
            if outcome is None:
                self.metrics.count(request.scope, "finished")
            elif isinstance(outcome, APIError):
                self.metrics.count(request.scope, "error", outcome.status, outcome.reason)
            else:
                self.metrics.count(request.scope, "aborted")

        return EventStreamResponse(events(), on_close)


async def _wait_disconnect(request: Request) -> None:
    """Return once the client has disconnected (the body has already been read)."""
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return
