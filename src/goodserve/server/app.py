"""The OpenAI-compatible HTTP routes around an :class:`AsyncEngine` (routes only: schemas live in
:mod:`goodserve.server.protocol`, errors in :mod:`goodserve.server.errors`, streams in
:mod:`goodserve.server.streaming`, metrics in :mod:`goodserve.server.metrics`).

Every request is validated and accepted by the engine *before* a response starts, so a bad parameter or a
prompt over the context length is an HTTP 400 with an OpenAI error body even when ``stream=true`` (C09);
text that is not valid Unicode is refused before any tokenizer sees it (C19). A choice of ``n`` (and each
prompt of a batch) is an independent engine request; with a ``seed``, choice ``i`` uses ``seed + i``.
Streamed deltas are the engine's delta outputs, which are whole UTF-8 characters and never include a prefix
of a stop string that might still match (C05, C10); one generator streams completions and chat alike. A client that goes away, streaming or
not, has its requests aborted at once, which frees their KV blocks (C12). One request whose processing
fails gets a 500 (or an error event in its stream) and the engine serves on.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
import uuid
from typing import Any, AsyncIterator, Callable, Optional, Union

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from goodserve.engine.async_engine import AsyncEngine
from goodserve.engine.async_types import RequestStream
from goodserve.engine.chat import render_chat
from goodserve.sampling_params import SamplingParams
from goodserve.server import protocol as P
from goodserve.server.choices import Choice, chat_logprobs, completion_logprobs, iterate_choices, usage
from goodserve.server.errors import APIError, install_error_handlers
from goodserve.server.metrics import ServerMetrics
from goodserve.server.openapi import install_schema, responses
from goodserve.server.streaming import EventStreamResponse, sse

COMPLETIONS, CHAT, TOKENIZE, DETOKENIZE = "/v1/completions", "/v1/chat/completions", "/tokenize", "/detokenize"
API_ENDPOINTS = (COMPLETIONS, CHAT, TOKENIZE, DETOKENIZE, "/v1/models")


async def _wait_disconnect(request: Request) -> None:
    """Return once the client has disconnected (the body has already been read)."""
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


def build_app(engine: AsyncEngine, served_model_name: Optional[str] = None,
              max_waiting_requests: Optional[int] = None, slo_ttft: Optional[float] = None,
              slo_tpot: Optional[float] = None) -> FastAPI:
    """Build the FastAPI app.

    Args:
        engine: A started :class:`AsyncEngine`.
        served_model_name: The model name clients must use (default: the model's file name).
        max_waiting_requests: Answer 429 (with ``Retry-After``) while this many requests wait; ``None``: no
            limit.
        slo_ttft: TTFT SLO in seconds for the goodput counters.
        slo_tpot: TPOT SLO in seconds for the goodput counters.

    Returns:
        The app; ``app.state`` holds ``engine``, ``metrics`` and ``served_model_name``.
    """
    app = FastAPI(title="goodserve", description="OpenAI-compatible LLM server")
    metrics = ServerMetrics(engine, slo_ttft, slo_tpot)
    model_name = served_model_name or engine.model_name
    app.state.engine, app.state.metrics, app.state.served_model_name = engine, metrics, model_name
    tokenizer = engine.tokenizer

    def endpoint_of(request: Request) -> str:
        path = request.url.path
        return path if path in API_ENDPOINTS else "other"

    install_error_handlers(app, lambda request, err: metrics.count_error(endpoint_of(request), err.status, err.reason),
                           lambda request: metrics.count_aborted(endpoint_of(request)))
    install_schema(app)

    # ------------------------------------------------------------------------------------------ helpers
    def check_model(name: Optional[str]) -> None:
        if name and name != model_name:
            raise APIError(404, f"The model `{name}` does not exist; this server serves `{model_name}`.",
                           param="model", code="model_not_found")

    async def start(prompts: list[Union[str, list[int]]], params: list[SamplingParams], request_id: str,
                    priority: int, cache_salt: Optional[str] = None) -> list[Choice]:
        """Add ``len(prompts) * len(params)`` engine requests; all accepted, or none (error raised)."""
        if max_waiting_requests is not None and engine.num_waiting_total() >= max_waiting_requests:
            raise APIError(429, f"The server is busy: {max_waiting_requests} requests are already waiting. "
                           "Retry later.", code="queue_full", headers={"Retry-After": "1"})
        jobs = []
        for p, prompt in enumerate(prompts):
            for j, sp in enumerate(params):
                jobs.append((p, j, engine.add_request(prompt, sp, f"{request_id}-{p * len(params) + j}", priority,
                                                      cache_salt)))
        results = await asyncio.gather(*(job for _, _, job in jobs), return_exceptions=True)
        streams = [r for r in results if isinstance(r, RequestStream)]
        failure = next((r for r in results if isinstance(r, BaseException)), None)
        if failure is not None:
            engine.abort([s.request_id for s in streams])
            raise failure
        return [Choice(index=i, stream=s, tracker=metrics.tracker(), prompt_index=p, first_of_prompt=j == 0)
                for i, ((p, j, _), s) in enumerate(zip(jobs, streams))]

    def finish(subs: list[Choice]) -> None:
        """Abort whatever has not finished (client gone, error) and count it."""
        ids = []
        for s in subs:
            if not s.tracker.done:
                ids.append(s.stream.request_id)
                s.tracker.ended("abort")
        if ids:
            engine.abort(ids)

    async def collect(request: Request, subs: list[Choice]) -> Optional[list[Choice]]:
        """Run all choices' requests to the end; ``None`` if the client disconnected first."""
        async def run() -> None:
            async with contextlib.aclosing(iterate_choices(subs)) as it:
                async for _ in it:
                    pass

        task = asyncio.create_task(run())
        watcher = asyncio.create_task(_wait_disconnect(request))
        try:
            await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
            if not task.done():
                return None
            task.result()
            return subs
        finally:
            for t in (task, watcher):
                t.cancel()
            finish(subs)

    async def answer(request: Request, subs: list[Choice], build: Callable[[], Any]) -> Response:
        """A non-streamed answer: wait for every choice, then ``build()`` the body (499 if the client left)."""
        endpoint = endpoint_of(request)
        if await collect(request, subs) is None:
            metrics.count_aborted(endpoint)
            return Response(status_code=499)
        body = build()
        metrics.count_finished(endpoint)
        return JSONResponse(body.model_dump())

    def stream(request: Request, subs: list[Choice], head: list[str], chunk: Callable[[Choice, str], str],
               usage_event: Optional[Callable[[], str]]) -> Response:
        """The one streamed answer of completions and chat: ``head`` events, then a ``chunk(choice, new_text)``
        per new piece of text (or finish) of any choice, then the ``usage_event`` if asked for. Tokens whose
        text is held back (a partial character, a possible stop string) go out with the next chunk."""
        endpoint = endpoint_of(request)

        async def events() -> AsyncIterator[str]:
            for event in head:
                yield event
            async with contextlib.aclosing(iterate_choices(subs)) as it:
                async for choice, out in it:
                    if out.text or out.finished:
                        yield chunk(choice, out.text)
            if usage_event is not None:
                yield usage_event()

        def on_close(outcome: Optional[APIError | str]) -> None:
            finish(subs)
            if outcome is None:
                metrics.count_finished(endpoint)
            elif isinstance(outcome, APIError):
                metrics.count_error(endpoint, outcome.status, outcome.reason)
            else:
                metrics.count_aborted(endpoint)

        return EventStreamResponse(events(), on_close)

    def chat_prompt(messages: list[dict[str, Any]]) -> list[int]:
        return render_chat(tokenizer, engine.chat_template, messages)

    # ------------------------------------------------------------------------------------------- routes
    @app.get("/health", response_class=Response, responses={
        200: {"description": "The engine loop is running (empty body)."},
        503: {"model": P.ErrorResponse, "description": "The engine loop is not running."}})
    async def health() -> Response:
        if engine.is_healthy():
            return Response(status_code=200)
        return APIError(503, "the engine loop is not running", code="engine_dead").response()

    @app.get("/v1/models", response_model=P.ModelList)
    async def models() -> P.ModelList:
        return P.ModelList(data=[P.ModelCard(id=model_name, root=engine.model_path,
                                             max_model_len=engine.max_model_len)])

    @app.get("/metrics", response_class=Response, responses={200: {
        "description": "Prometheus text exposition format.",
        "content": {CONTENT_TYPE_LATEST.split(";")[0]: {"schema": {"type": "string"}}}}})
    async def prometheus_metrics() -> Response:
        return Response(generate_latest(metrics.registry), media_type=CONTENT_TYPE_LATEST)

    @app.post(TOKENIZE, response_model=P.TokenizeResponse, responses=responses(errors=(400, 404, 500)))
    async def tokenize(body: P.TokenizeRequest) -> P.TokenizeResponse:
        check_model(body.model)
        if body.messages is not None:
            conv = P.ChatCompletionRequest(messages=body.messages).conversation()
            tokens = chat_prompt(conv)
        elif body.prompt is not None:
            tokens = list(tokenizer.encode(body.prompt, add_special_tokens=body.add_special_tokens))
        else:
            raise ValueError("give either 'prompt' or 'messages'")
        metrics.count_finished(TOKENIZE)
        return P.TokenizeResponse(tokens=tokens, count=len(tokens), max_model_len=engine.max_model_len)

    @app.post(DETOKENIZE, response_model=P.DetokenizeResponse, responses=responses(errors=(400, 404, 500)))
    async def detokenize(body: P.DetokenizeRequest) -> P.DetokenizeResponse:
        check_model(body.model)
        vocab = len(tokenizer)
        bad = [t for t in body.tokens if not 0 <= t < vocab]
        if bad:
            raise ValueError(f"tokens must be integers in [0, {vocab}), got {bad[:5]}")
        text = tokenizer.decode(body.tokens)
        metrics.count_finished(DETOKENIZE)
        return P.DetokenizeResponse(prompt=text)

    @app.post(COMPLETIONS, response_class=Response, responses=responses(P.CompletionResponse, stream=True))
    async def completions(body: P.CompletionRequest, request: Request) -> Response:
        check_model(body.model)
        prompts = body.prompts()
        body.check_n(len(prompts))
        params = [body.build_params(body.max_tokens, body.logprobs, j) for j in range(body.n)]
        rid = f"cmpl-{uuid.uuid4().hex}"
        created = int(time.time())
        subs = await start(prompts, params, rid, body.priority, body.cache_salt)
        echo = {}
        if body.echo:
            for p, prompt in enumerate(prompts):
                echo[p] = prompt if isinstance(prompt, str) else tokenizer.decode(prompt)

        def chunk(choices: list[P.CompletionChoice], usage_info: Optional[P.UsageInfo] = None) -> str:
            return sse(P.CompletionChunk(id=rid, created=created, model=model_name, choices=choices,
                                         usage=usage_info))

        if not body.stream:
            def build() -> P.CompletionResponse:
                return P.CompletionResponse(id=rid, created=created, model=model_name, usage=usage(subs), choices=[
                    P.CompletionChoice(index=c.index, text=echo.get(c.prompt_index, "") + c.text,
                                       logprobs=completion_logprobs(tokenizer, c),
                                       finish_reason=c.finish_reason or "abort", stop_reason=c.stop_reason)
                    for c in subs])
            return await answer(request, subs, build)

        head = [chunk([P.CompletionChoice(index=c.index, text=echo[c.prompt_index])]) for c in subs
                if c.prompt_index in echo]
        return stream(request, subs, head, lambda c, delta: chunk([P.CompletionChoice(
            index=c.index, text=delta, logprobs=completion_logprobs(tokenizer, c), finish_reason=c.finish_reason,
            stop_reason=c.stop_reason)]), (lambda: chunk([], usage(subs))) if body.include_usage else None)

    @app.post(CHAT, response_class=Response, responses=responses(P.ChatCompletionResponse, stream=True))
    async def chat_completions(body: P.ChatCompletionRequest, request: Request) -> Response:
        check_model(body.model)
        body.check_n()
        logprobs = body.num_logprobs
        params = [body.build_params(body.resolved_max_tokens, logprobs, j) for j in range(body.n)]
        prompt_ids = chat_prompt(body.conversation())
        rid = f"chatcmpl-{uuid.uuid4().hex}"
        created = int(time.time())
        subs = await start([prompt_ids], params, rid, body.priority, body.cache_salt)

        def chunk(choices: list[P.ChatStreamChoice], usage_info: Optional[P.UsageInfo] = None) -> str:
            return sse(P.ChatCompletionChunk(id=rid, created=created, model=model_name, choices=choices,
                                             usage=usage_info))

        if not body.stream:
            def build() -> P.ChatCompletionResponse:
                return P.ChatCompletionResponse(id=rid, created=created, model=model_name, usage=usage(subs), choices=[
                    P.ChatChoice(index=c.index, message=P.ChatMessage(content=c.text),
                                 logprobs=chat_logprobs(tokenizer, c), finish_reason=c.finish_reason or "abort",
                                 stop_reason=c.stop_reason)
                    for c in subs])
            return await answer(request, subs, build)

        head = [chunk([P.ChatStreamChoice(index=c.index, delta=P.DeltaMessage(role="assistant", content=""))])
                for c in subs]
        return stream(request, subs, head, lambda c, delta: chunk([P.ChatStreamChoice(
            index=c.index, delta=P.DeltaMessage(content=delta or None), logprobs=chat_logprobs(tokenizer, c),
            finish_reason=c.finish_reason)]), (lambda: chunk([], usage(subs))) if body.include_usage else None)

    return app
