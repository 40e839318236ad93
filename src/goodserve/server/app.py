"""The OpenAI-compatible HTTP routes around an :class:`AsyncEngine`: routes only. How a completion or chat call
is served lives in :mod:`goodserve.server.serving`, schemas in :mod:`goodserve.server.protocol`, errors in
:mod:`goodserve.server.errors`, streams in :mod:`goodserve.server.streaming`, metrics in
:mod:`goodserve.server.metrics`.

Text that is not valid Unicode is refused before any tokenizer sees it (C19); one request whose processing
fails gets a 500 (or an error event in its stream) and the engine serves on.
"""

from __future__ import annotations

import asyncio
import uuid
from typing import Optional

from fastapi import APIRouter, FastAPI, Request
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from goodserve.engine.async_engine import AsyncEngine
from goodserve.server import protocol as P
from goodserve.server.choices import chat_logprobs, completion_logprobs
from goodserve.server.errors import APIError, install_error_handlers
from goodserve.server.metrics import ServerMetrics
from goodserve.server.slo_classes import SLOTarget
from goodserve.server.openapi import install_schema, responses
from goodserve.server.serving import OpenAIServing, Shapes

router = APIRouter()
MAX_BODY_BYTES = 16 << 20  # a larger body is refused with a 413 before it is parsed


def _serving(request: Request) -> OpenAIServing:
    return request.app.state.serving


@router.get("/health", response_class=Response, responses={
    200: {"description": "The engine loop is running (empty body)."},
    503: {"model": P.ErrorResponse, "description": "The engine loop is not running."}})
async def health(request: Request) -> Response:
    if _serving(request).engine.is_healthy():
        return Response(status_code=200)
    return APIError(503, "the engine loop is not running", code="engine_dead").response()


@router.get("/v1/kv_events", responses={
    200: {"description": "Where this instance publishes its KV events: `endpoint`, `replay_endpoint`, `topic`, "
                         "`stream_id` (a new one after a restart), `block_size`."},
    404: {"model": P.ErrorResponse, "description": "This instance publishes no KV events."}})
async def kv_events(request: Request) -> Response:
    info = _serving(request).engine.kv_events_info
    if info is None:
        raise APIError(404, "this instance publishes no KV events (start it with --kv-events-config)",
                       code="kv_events_disabled")
    return JSONResponse(info)


@router.get("/v1/models", response_model=P.ModelList)
async def models(request: Request) -> P.ModelList:
    s = _serving(request)
    return P.ModelList(data=[P.ModelCard(id=s.model_name, root=s.engine.model_path,
                                         max_model_len=s.engine.max_model_len)])


@router.get("/v1/models/{model_id:path}", response_model=P.ModelCard,
            responses=responses(errors=(404,)))
async def model_card(model_id: str, request: Request) -> P.ModelCard:
    s = _serving(request)
    if model_id != s.model_name:
        raise APIError(404, f"The model `{model_id}` does not exist; this server serves `{s.model_name}`.",
                       param="model", code="model_not_found")
    return P.ModelCard(id=s.model_name, root=s.engine.model_path, max_model_len=s.engine.max_model_len)


@router.get("/metrics", response_class=Response, responses={200: {
    "description": "Prometheus text exposition format.",
    "content": {CONTENT_TYPE_LATEST.split(";")[0]: {"schema": {"type": "string"}}}}})
async def prometheus_metrics(request: Request) -> Response:
    return Response(generate_latest(_serving(request).metrics.registry), media_type=CONTENT_TYPE_LATEST)


@router.post("/tokenize", response_model=P.TokenizeResponse, responses=responses(errors=(400, 404, 413, 415, 500)))
async def tokenize(body: P.TokenizeRequest, request: Request) -> Response:
    s = _serving(request)
    s.check_model(body.model)
    if body.messages is not None:
        conv = P.conversation(body.messages)
        tokens = await asyncio.to_thread(s.chat_prompt, conv)
    elif body.prompt is not None:
        tokens = await asyncio.to_thread(s.tokenizer.encode, body.prompt, add_special_tokens=body.add_special_tokens)
    else:
        raise ValueError("give either 'prompt' or 'messages'")
    return s.json(request, P.TokenizeResponse(tokens=list(tokens), count=len(tokens),
                                              max_model_len=s.engine.max_model_len))


@router.post("/detokenize", response_model=P.DetokenizeResponse, responses=responses(errors=(400, 404, 413, 415, 500)))
async def detokenize(body: P.DetokenizeRequest, request: Request) -> Response:
    s = _serving(request)
    s.check_model(body.model)
    vocab = len(s.tokenizer)
    bad = [t for t in body.tokens if not 0 <= t < vocab]
    if bad:
        raise ValueError(f"tokens must be integers in [0, {vocab}), got {bad[:5]}")
    text = await asyncio.to_thread(s.tokenizer.decode, body.tokens)
    return s.json(request, P.DetokenizeResponse(prompt=text))


@router.post("/v1/completions", response_class=Response, responses=responses(P.CompletionResponse, stream=True))
async def completions(body: P.CompletionRequest, request: Request) -> Response:
    s = _serving(request)
    s.check_model(body.model)
    prompts = body.prompts()
    body.check_n(len(prompts))
    prompt_logprobs = body.logprobs if body.echo else None
    params = [body.build_params(body.max_tokens, body.logprobs, j, prompt_logprobs) for j in range(body.n)]
    rid = f"cmpl-{uuid.uuid4().hex}"
    choices = await s.start(prompts, params, rid, s.options_of(body))
    if body.echo:
        echo = [p if isinstance(p, str) else s.tokenizer.decode(p) for p in prompts]
        for c in choices:
            c.echo = echo[c.prompt_index]
    tb = s.token_bytes if body.logprobs is not None else None
    echo_len = {c.index: len(c.echo or "") for c in choices}

    def full(c):
        text = c.take_echo() + c.text
        return P.CompletionChoice(index=c.index, text=text, logprobs=completion_logprobs(tb, c, echo_len[c.index]),
                                  finish_reason=c.finish_reason or "abort", stop_reason=c.stop_reason)

    def delta(c, d):
        return P.CompletionChoice(index=c.index, text=c.take_echo() + d,
                                  logprobs=completion_logprobs(tb, c, echo_len[c.index]),
                                  finish_reason=c.finish_reason, stop_reason=c.stop_reason)

    shapes = Shapes(P.CompletionResponse, P.CompletionChunk, full=full, delta=delta)
    return await s.respond(request, body, choices, rid, shapes, [])


@router.post("/v1/chat/completions", response_class=Response,
             responses=responses(P.ChatCompletionResponse, stream=True))
async def chat_completions(body: P.ChatCompletionRequest, request: Request) -> Response:
    s = _serving(request)
    s.check_model(body.model)
    body.check_n()
    params = [body.build_params(body.resolved_max_tokens, body.num_logprobs, j) for j in range(body.n)]
    conv = body.conversation()
    prompt_ids = await asyncio.to_thread(s.chat_prompt, conv)
    rid = f"chatcmpl-{uuid.uuid4().hex}"
    choices = await s.start([prompt_ids], params, rid, s.options_of(body))
    tb = s.token_bytes if body.logprobs else None
    shapes = Shapes(P.ChatCompletionResponse, P.ChatCompletionChunk, full=lambda c: P.ChatChoice(
        index=c.index, message=P.ChatMessage(content=c.text), logprobs=chat_logprobs(tb, c),
        finish_reason=c.finish_reason or "abort", stop_reason=c.stop_reason), delta=lambda c, d: P.ChatStreamChoice(
        index=c.index, delta=P.DeltaMessage(content=d or None), logprobs=chat_logprobs(tb, c),
        finish_reason=c.finish_reason))
    head = [P.ChatStreamChoice(index=c.index, delta=P.DeltaMessage(role="assistant", content="")) for c in choices]
    return await s.respond(request, body, choices, rid, shapes, head)


@router.post("/v1/kv_transfer/release", include_in_schema=False)
async def kv_transfer_release(request: Request) -> Response:
    """Producer (internal, for the router): free at once the blocks a handle holds, checked against its lease,
    when the client left before any consumer pulled them. Body ``{"kv_transfer_params": <handle>}``; answers
    ``{"released": true}`` (freed), ``{"released": false}`` (a consumer is reading them: freed when it ends),
    404 ``kv_hold_not_found`` when no live hold matches, 400 for a malformed handle."""
    try:
        body = await request.json()
    except ValueError:
        raise ValueError("the body is not valid JSON") from None
    params = body.get("kv_transfer_params") if isinstance(body, dict) else None
    try:
        released = await _serving(request).engine.call_async(lambda e: e.release_kv_hold(params))
    except LookupError as e:
        raise APIError(404, str(e), param="kv_transfer_params", code="kv_hold_not_found") from None
    return JSONResponse({"released": released})


def build_app(engine: AsyncEngine, served_model_name: Optional[str] = None,
              max_waiting_requests: Optional[int] = None,
              slo_classes: Optional[dict[str, SLOTarget]] = None) -> FastAPI:
    """Build the FastAPI app.

    Args:
        engine: A started :class:`AsyncEngine`.
        served_model_name: The model name clients must use (default: the model's file name).
        max_waiting_requests: Answer 429 (with ``Retry-After``) while this many requests wait; ``None``: no
            limit.
        slo_classes: Named SLO classes requests may pick with ``slo_class`` (see :func:`parse_slo_classes`); the
            engine's ``slo_ttft`` / ``slo_tpot`` are the default class.

    Returns:
        The app; ``app.state`` holds ``engine``, ``metrics``, ``served_model_name`` and ``serving``.
    """
    app = FastAPI(title="goodserve", description="OpenAI-compatible LLM server", max_body_size=MAX_BODY_BYTES)
    metrics = ServerMetrics(engine, slo_classes)
    model_name = served_model_name or engine.model_name
    app.state.engine, app.state.metrics, app.state.served_model_name = engine, metrics, model_name
    app.state.serving = OpenAIServing(engine, metrics, model_name, max_waiting_requests, slo_classes)
    install_error_handlers(app, lambda scope, err: metrics.count(scope, "error", err.status, err.reason),
                           lambda scope: metrics.count(scope, "aborted"))
    app.include_router(router)
    install_schema(app)
    return app
