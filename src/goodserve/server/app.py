"""The OpenAI-compatible HTTP routes around an :class:`AsyncEngine` (routes only: schemas live in
:mod:`goodserve.server.protocol`, metrics in :mod:`goodserve.server.metrics`).

Every request is validated and accepted by the engine *before* a response starts, so a bad parameter or a
prompt over the context length is an HTTP 400 with an OpenAI error body even when ``stream=true`` (C09).
A choice of ``n`` (and each prompt of a batch) is an independent engine request; with a ``seed``, choice
``i`` uses ``seed + i``. Streamed deltas are differences of the engine's cumulative texts, which are whole
UTF-8 characters and never include a prefix of a stop string that might still match (C05, C10). A client
that goes away, streaming or not, has its requests aborted at once, which frees their KV blocks (C12).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import re
import time
import uuid
from dataclasses import dataclass
from typing import Any, AsyncIterator, Optional, Union

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.exceptions import HTTPException as StarletteHTTPException

from goodserve.engine.async_engine import AsyncEngine, EngineDeadError, RequestStream
from goodserve.outputs import RequestOutput
from goodserve.sampling_params import SamplingParams
from goodserve.server import protocol as P
from goodserve.server.metrics import RequestTracker, ServerMetrics

logger = logging.getLogger(__name__)


class APIError(Exception):
    """An error answered with an OpenAI error body."""

    def __init__(self, status: int, message: str, type_: str, param: Optional[str] = None,
                 code: Optional[Union[int, str]] = None, headers: Optional[dict[str, str]] = None) -> None:
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type_, param, code
        self.headers = headers


def _error_response(status: int, message: str, type_: str, param: Optional[str] = None,
                    code: Optional[Union[int, str]] = None, headers: Optional[dict[str, str]] = None) -> JSONResponse:
    body = P.ErrorResponse(error=P.ErrorInfo(message=message, type=type_, param=param,
                                             code=code if code is not None else status))
    return JSONResponse(body.model_dump(), status_code=status, headers=headers)


def _bad_request(e: ValueError) -> JSONResponse:
    msg = str(e)
    m = re.match(r"(\w+) must", msg)
    return _error_response(400, msg, "BadRequestError", param=m.group(1) if m else None)


@dataclass
class _Sub:
    """One engine request behind one choice."""

    index: int
    stream: RequestStream
    tracker: RequestTracker
    prompt_index: int
    first_of_prompt: bool
    last: Optional[RequestOutput] = None
    sent_text: str = ""
    sent_tokens: int = 0
    text_offset: int = 0


def _usage(subs: list[_Sub]) -> P.UsageInfo:
    prompt = cached = completion = 0
    for s in subs:
        if s.last is None:
            continue
        completion += len(s.last.token_ids)
        if s.first_of_prompt:
            prompt += len(s.last.prompt_token_ids)
            cached += s.last.metrics.num_cached_tokens if s.last.metrics else 0
    return P.UsageInfo(prompt_tokens=prompt, completion_tokens=completion, total_tokens=prompt + completion,
                       prompt_tokens_details=P.PromptTokensDetails(cached_tokens=cached))


async def _iterate(subs: list[_Sub]) -> AsyncIterator[_Sub]:
    """Outputs of all sub-requests as they come; each yields the ``_Sub`` with ``last`` updated."""
    queue: asyncio.Queue = asyncio.Queue()

    async def pump(sub: _Sub) -> None:
        try:
            async for out in sub.stream:
                queue.put_nowait((sub, out))
        except BaseException as e:  # noqa: BLE001 - forwarded to the consumer
            queue.put_nowait((sub, e))
            return
        queue.put_nowait((sub, None))

    tasks = [asyncio.create_task(pump(s)) for s in subs]
    try:
        remaining = len(subs)
        while remaining:
            sub, item = await queue.get()
            if item is None:
                remaining -= 1
                continue
            if isinstance(item, BaseException):
                raise item
            sub.tracker.observe(item)
            sub.last = item
            yield sub
    finally:
        for t in tasks:
            t.cancel()


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

    # ------------------------------------------------------------------------------------------- errors
    @app.exception_handler(APIError)
    async def _api_error(_: Request, e: APIError) -> JSONResponse:
        return _error_response(e.status, e.message, e.type, e.param, e.code, e.headers)

    @app.exception_handler(RequestValidationError)
    async def _validation_error(_: Request, e: RequestValidationError) -> JSONResponse:
        errors = e.errors()
        first = errors[0] if errors else {"loc": (), "msg": "invalid request"}
        loc = ".".join(str(x) for x in first.get("loc", ()) if x != "body")
        return _error_response(400, f"{loc}: {first.get('msg')}" if loc else str(first.get("msg")),
                               "BadRequestError", param=loc or None)

    @app.exception_handler(ValueError)
    async def _value_error(_: Request, e: ValueError) -> JSONResponse:
        return _bad_request(e)

    @app.exception_handler(EngineDeadError)
    async def _engine_dead(_: Request, e: EngineDeadError) -> JSONResponse:
        return _error_response(503, str(e), "ServiceUnavailableError")

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(_: Request, e: StarletteHTTPException) -> JSONResponse:
        return _error_response(e.status_code, str(e.detail), "NotFoundError" if e.status_code == 404 else
                               "BadRequestError", headers=getattr(e, "headers", None))

    # ------------------------------------------------------------------------------------------ helpers
    def check_model(name: Optional[str]) -> None:
        if name and name != model_name:
            raise APIError(404, f"The model `{name}` does not exist; this server serves `{model_name}`.",
                           "NotFoundError", param="model", code="model_not_found")

    async def start(prompts: list[Union[str, list[int]]], params: list[SamplingParams], request_id: str,
                    priority: int, cache_salt: Optional[str] = None) -> list[_Sub]:
        """Add ``len(prompts) * len(params)`` engine requests; all accepted, or none (error raised)."""
        if max_waiting_requests is not None and engine.num_waiting_total() >= max_waiting_requests:
            raise APIError(429, f"The server is busy: {max_waiting_requests} requests are already waiting. "
                           "Retry later.", "RateLimitError", headers={"Retry-After": "1"})
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
        return [_Sub(index=i, stream=s, tracker=metrics.tracker(), prompt_index=p, first_of_prompt=j == 0)
                for i, ((p, j, _), s) in enumerate(zip(jobs, streams))]

    def finish(subs: list[_Sub]) -> None:
        """Abort whatever has not finished (client gone, error) and count it."""
        ids = []
        for s in subs:
            if not s.tracker.done:
                ids.append(s.stream.request_id)
                s.tracker.aborted()
        if ids:
            engine.abort(ids)

    async def collect(request: Request, subs: list[_Sub]) -> Optional[list[_Sub]]:
        """Run all sub-requests to the end; ``None`` if the client disconnected first."""
        async def run() -> None:
            async with contextlib.aclosing(_iterate(subs)) as it:
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

    def token_str(token_id: int) -> str:
        return tokenizer.decode([token_id])

    def completion_logprobs(sub: _Sub, out: RequestOutput, start: int, offset: int) -> Optional[P.CompletionLogprobs]:
        c = out.outputs[0]
        if c.logprobs is None:
            return None
        lp = P.CompletionLogprobs()
        for i in range(start, len(c.token_ids)):
            tok = token_str(c.token_ids[i])
            lp.tokens.append(tok)
            lp.token_logprobs.append(c.logprobs[i] if i < len(c.logprobs) else None)
            top = c.top_logprobs[i] if c.top_logprobs and i < len(c.top_logprobs) else []
            lp.top_logprobs.append({token_str(t): v for t, v in top})
            lp.text_offset.append(offset)
            offset += len(tok)
        sub.text_offset = offset
        return lp

    def chat_logprobs(out: RequestOutput, start: int) -> Optional[P.ChatLogprobs]:
        c = out.outputs[0]
        if c.logprobs is None:
            return None
        content = []
        for i in range(start, min(len(c.token_ids), len(c.logprobs))):
            tok = token_str(c.token_ids[i])
            top = c.top_logprobs[i] if c.top_logprobs and i < len(c.top_logprobs) else []
            content.append(P.ChatTokenLogprob(
                token=tok, logprob=c.logprobs[i], bytes=list(tok.encode()),
                top_logprobs=[P.TopLogprob(token=token_str(t), logprob=v, bytes=list(token_str(t).encode()))
                              for t, v in top]))
        return P.ChatLogprobs(content=content)

    def chat_prompt(messages: list[dict[str, Any]]) -> list[int]:
        if not (engine.chat_template or getattr(tokenizer, "chat_template", None)):
            raise ValueError("this model has no chat template; use /v1/completions")
        try:
            out = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True,
                                                chat_template=engine.chat_template)
        except Exception as e:  # noqa: BLE001 - a template that rejects the conversation is a user error
            raise ValueError(f"messages could not be rendered with the chat template: {e}") from e
        if isinstance(out, dict) or hasattr(out, "input_ids"):
            out = out["input_ids"]
        return list(out)

    def sse(obj: Any) -> str:
        return f"data: {obj.model_dump_json()}\n\n"

    def stream_error(e: BaseException) -> str:
        body = P.ErrorResponse(error=P.ErrorInfo(message=str(e), type="InternalServerError", code=500))
        return f"data: {body.model_dump_json()}\n\n"

    # ------------------------------------------------------------------------------------------- routes
    @app.get("/health")
    async def health() -> Response:
        return Response(status_code=200 if engine.is_healthy() else 503)

    @app.get("/v1/models")
    async def models() -> P.ModelList:
        return P.ModelList(data=[P.ModelCard(id=model_name, root=engine.model_path,
                                             max_model_len=engine.max_model_len)])

    @app.get("/metrics")
    async def prometheus_metrics() -> Response:
        return Response(generate_latest(metrics.registry), media_type=CONTENT_TYPE_LATEST)

    @app.post("/tokenize")
    async def tokenize(body: P.TokenizeRequest) -> dict:
        check_model(body.model)
        if body.messages is not None:
            conv = P.ChatCompletionRequest(messages=body.messages).conversation()
            tokens = chat_prompt(conv)
        elif body.prompt is not None:
            tokens = list(tokenizer.encode(body.prompt, add_special_tokens=body.add_special_tokens))
        else:
            raise ValueError("give either 'prompt' or 'messages'")
        return {"tokens": tokens, "count": len(tokens), "max_model_len": engine.max_model_len}

    @app.post("/detokenize")
    async def detokenize(body: P.DetokenizeRequest) -> dict:
        check_model(body.model)
        vocab = len(tokenizer)
        bad = [t for t in body.tokens if not 0 <= t < vocab]
        if bad:
            raise ValueError(f"tokens must be integers in [0, {vocab}), got {bad[:5]}")
        return {"prompt": tokenizer.decode(body.tokens)}

    @app.post("/v1/completions")
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

        if not body.stream:
            if await collect(request, subs) is None:
                return Response(status_code=499)
            choices = []
            for s in subs:
                out = s.last
                text = out.text if out else ""
                choices.append(P.CompletionChoice(
                    index=s.index, text=echo.get(s.prompt_index, "") + text,
                    logprobs=completion_logprobs(s, out, 0, 0) if out else None,
                    finish_reason=(out.finish_reason if out else None) or "abort",
                    stop_reason=out.outputs[0].stop_reason if out else None))
            return JSONResponse(P.CompletionResponse(id=rid, created=created, model=model_name, choices=choices,
                                                     usage=_usage(subs)).model_dump())

        async def events() -> AsyncIterator[str]:
            try:
                for s in subs:
                    if s.prompt_index in echo:
                        yield sse(P.CompletionChunk(id=rid, created=created, model=model_name, choices=[
                            P.CompletionChoice(index=s.index, text=echo[s.prompt_index])]))
                async with contextlib.aclosing(_iterate(subs)) as it:
                    async for s in it:
                        out = s.last
                        delta = out.text[len(s.sent_text):]
                        if not delta and not out.finished:
                            continue
                        lp = completion_logprobs(s, out, s.sent_tokens, s.text_offset)
                        s.sent_text, s.sent_tokens = out.text, len(out.token_ids)
                        yield sse(P.CompletionChunk(id=rid, created=created, model=model_name, choices=[
                            P.CompletionChoice(index=s.index, text=delta, logprobs=lp,
                                               finish_reason=out.finish_reason,
                                               stop_reason=out.outputs[0].stop_reason)]))
                if body.include_usage:
                    yield sse(P.CompletionChunk(id=rid, created=created, model=model_name, choices=[],
                                                usage=_usage(subs)))
                yield "data: [DONE]\n\n"
            except EngineDeadError as e:
                yield stream_error(e)
            finally:
                finish(subs)

        return StreamingResponse(events(), media_type="text/event-stream")

    @app.post("/v1/chat/completions")
    async def chat_completions(body: P.ChatCompletionRequest, request: Request) -> Response:
        check_model(body.model)
        body.check_n()
        logprobs = body.num_logprobs
        params = [body.build_params(body.resolved_max_tokens, logprobs, j) for j in range(body.n)]
        prompt_ids = chat_prompt(body.conversation())
        rid = f"chatcmpl-{uuid.uuid4().hex}"
        created = int(time.time())
        subs = await start([prompt_ids], params, rid, body.priority, body.cache_salt)

        if not body.stream:
            if await collect(request, subs) is None:
                return Response(status_code=499)
            choices = []
            for s in subs:
                out = s.last
                choices.append(P.ChatChoice(
                    index=s.index, message=P.ChatMessage(content=out.text if out else ""),
                    logprobs=chat_logprobs(out, 0) if out else None,
                    finish_reason=(out.finish_reason if out else None) or "abort",
                    stop_reason=out.outputs[0].stop_reason if out else None))
            return JSONResponse(P.ChatCompletionResponse(id=rid, created=created, model=model_name,
                                                         choices=choices, usage=_usage(subs)).model_dump())

        def chunk(choices: list[P.ChatStreamChoice], usage: Optional[P.UsageInfo] = None) -> str:
            return sse(P.ChatCompletionChunk(id=rid, created=created, model=model_name, choices=choices,
                                             usage=usage))

        async def events() -> AsyncIterator[str]:
            try:
                for s in subs:
                    yield chunk([P.ChatStreamChoice(index=s.index, delta=P.DeltaMessage(role="assistant",
                                                                                        content=""))])
                async with contextlib.aclosing(_iterate(subs)) as it:
                    async for s in it:
                        out = s.last
                        delta = out.text[len(s.sent_text):]
                        if not delta and not out.finished:
                            continue
                        lp = chat_logprobs(out, s.sent_tokens)
                        s.sent_text, s.sent_tokens = out.text, len(out.token_ids)
                        yield chunk([P.ChatStreamChoice(index=s.index, delta=P.DeltaMessage(content=delta or None),
                                                        logprobs=lp, finish_reason=out.finish_reason)])
                if body.include_usage:
                    yield chunk([], _usage(subs))
                yield "data: [DONE]\n\n"
            except EngineDeadError as e:
                yield stream_error(e)
            finally:
                finish(subs)

        return StreamingResponse(events(), media_type="text/event-stream")

    return app
