"""Streaming HTTP client of the serving benchmark: sends requests on an arrival schedule and times them.

Each request is a streamed OpenAI completion (``/v1/completions`` or ``/v1/chat/completions``) with
``max_tokens`` + ``ignore_eos`` (forced output length) and ``stream_options.include_usage`` (so the
output token count comes from the server). Times are taken with ``time.perf_counter`` at the client:

* the first server-sent event that carries output text (or a finish reason) gives TTFT;
* each later such event adds one ITL (the gap since the previous one); TTFT is never an ITL (C11);
* the end of the stream gives E2E.

Failed requests (HTTP errors, error events, broken streams) become records with ``success=False`` and
the error message; they are never dropped.
"""

from __future__ import annotations

import asyncio
import json
import time
from dataclasses import dataclass
from typing import Any, Callable, Optional, Sequence

from goodserve.bench.datasets import BenchRequest
from goodserve.workload.metrics import RequestRecord

TIMEOUT_S = 6 * 3600.0


@dataclass(frozen=True)
class Target:
    """Where and how to send the requests.

    Attributes:
        base_url: Server root, e.g. ``http://127.0.0.1:8000`` (a trailing ``/v1`` is tolerated).
        endpoint: ``/v1/completions`` or ``/v1/chat/completions``.
        model: The ``model`` field to send (``None``: leave it out).
    """

    base_url: str
    endpoint: str = "/v1/completions"
    model: Optional[str] = None

    @property
    def url(self) -> str:
        base = self.base_url.rstrip("/")
        if base.endswith("/v1") and self.endpoint.startswith("/v1/"):
            base = base[:-3]
        return base + self.endpoint


def request_body(target: Target, req: BenchRequest) -> dict[str, Any]:
    """The JSON body of one benchmark request (streamed, greedy, forced output length)."""
    body: dict[str, Any] = {"max_tokens": req.output_len, "ignore_eos": True, "temperature": 0.0,
                            "stream": True, "stream_options": {"include_usage": True}}
    if target.model:
        body["model"] = target.model
    if req.slo_class is not None:
        body["slo_class"] = req.slo_class
    if target.endpoint.endswith("chat/completions"):
        content = req.prompt if isinstance(req.prompt, str) else " ".join(str(t) for t in req.prompt)
        body["messages"] = [{"role": "user", "content": content}]
    else:
        body["prompt"] = req.prompt if isinstance(req.prompt, str) else list(req.prompt)
    return body


def _chunk_has_output(event: dict[str, Any]) -> bool:
    for choice in event.get("choices") or ():
        if choice.get("text") or (choice.get("delta") or {}).get("content") or choice.get("finish_reason"):
            return True
    return False


async def send_one(client: httpx.AsyncClient, target: Target, req: BenchRequest, arrival: float = 0.0) -> RequestRecord:
    """Send one streamed request and time it; never raises for server or network errors.

    Args:
        client: The shared async client.
        target: Server and endpoint.
        req: The request.
        arrival: Scheduled send time, seconds from the benchmark start (stored in the record).

    Returns:
        The record; ``success`` is False with ``error`` set when the request failed.
    """
    import httpx  # imported where used: `goodserve chat` builds the bench parsers, never a client
    rec = RequestRecord(arrival=arrival, prompt_tokens=req.prompt_len, expected_output_tokens=req.output_len)
    body = request_body(target, req)
    chunks = 0
    usage_tokens: Optional[int] = None
    last: Optional[float] = None
    send = time.perf_counter()
    try:
        async with client.stream("POST", target.url, json=body) as resp:
            if resp.status_code != 200:
                text = (await resp.aread()).decode(errors="replace")
                rec.error = f"HTTP {resp.status_code}: {text[:300]}"
                return rec
            async for line in resp.aiter_lines():
                if not line.startswith("data:"):
                    continue
                data = line[5:].strip()
                if data == "[DONE]":
                    break
                now = time.perf_counter()
                event = json.loads(data)
                if "error" in event:
                    err = event["error"]
                    rec.error = f"stream error: {err.get('message', err) if isinstance(err, dict) else err}"
                    return rec
                if _chunk_has_output(event):
                    if last is None:
                        rec.ttft = now - send
                    else:
                        rec.itls.append(now - last)
                    last = now
                    chunks += 1
                usage = event.get("usage")
                if usage:
                    usage_tokens = usage.get("completion_tokens", usage_tokens)
                    if usage.get("prompt_tokens"):
                        rec.prompt_tokens = int(usage["prompt_tokens"])
        rec.e2e = time.perf_counter() - send
    except (httpx.HTTPError, json.JSONDecodeError, OSError) as e:
        rec.error = f"{type(e).__name__}: {e}"
        return rec
    rec.output_tokens = int(usage_tokens) if usage_tokens is not None else chunks
    if rec.ttft is None:
        rec.error = "the stream ended without any output"
        return rec
    rec.success = True
    return rec


async def run_requests(target: Target, requests: Sequence[BenchRequest], arrivals: Sequence[float],
                       max_concurrency: Optional[int] = None,
                       on_done: Optional[Callable[[RequestRecord], None]] = None) -> tuple[list[RequestRecord], float]:
    """Send ``requests[i]`` at ``arrivals[i]`` seconds from now; wait for all of them.

    With ``max_concurrency`` a request due while that many are in flight waits for a slot; its TTFT and
    E2E are timed from when it is actually sent.

    Returns:
        ``(records in request order, duration in seconds from the start to the last completion)``.

    Raises:
        ValueError: if ``requests`` and ``arrivals`` differ in length or ``max_concurrency < 1``.
    """
    import httpx
    if len(requests) != len(arrivals):
        raise ValueError(f"{len(requests)} requests but {len(arrivals)} arrival times")
    if max_concurrency is not None and max_concurrency < 1:
        raise ValueError(f"max_concurrency must be >= 1, got {max_concurrency}")
    sem = asyncio.Semaphore(max_concurrency) if max_concurrency else None
    limits = httpx.Limits(max_connections=max_concurrency or None, max_keepalive_connections=64)
    async with httpx.AsyncClient(timeout=httpx.Timeout(TIMEOUT_S, connect=60.0), limits=limits) as client:
        start = time.perf_counter()

        async def one(req: BenchRequest, at: float) -> RequestRecord:
            delay = at - (time.perf_counter() - start)
            if delay > 0:
                await asyncio.sleep(delay)
            if sem is None:
                rec = await send_one(client, target, req, at)
            else:
                async with sem:
                    rec = await send_one(client, target, req, at)
            if on_done is not None:
                on_done(rec)
            return rec

        records = await asyncio.gather(*(one(r, a) for r, a in zip(requests, arrivals)))
        duration = time.perf_counter() - start
    return list(records), max(duration, 1e-9)


async def wait_ready(base_url: str, timeout_s: float = 300.0, is_alive: Optional[Callable[[], bool]] = None) -> None:
    """Poll ``/v1/models`` until the server answers 200.

    Raises:
        RuntimeError: if it does not within ``timeout_s`` or ``is_alive()`` turns False.
    """
    import httpx
    deadline = time.monotonic() + timeout_s
    url = base_url.rstrip("/").removesuffix("/v1") + "/v1/models"
    async with httpx.AsyncClient(timeout=5.0) as client:
        while time.monotonic() < deadline:
            if is_alive is not None and not is_alive():
                raise RuntimeError(f"the server for {base_url} exited before it was ready")
            try:
                if (await client.get(url)).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            await asyncio.sleep(0.5)
    raise RuntimeError(f"{base_url} was not ready after {timeout_s:.0f} s")


def server_info(base_url: str) -> dict[str, Any]:
    """The first model card of ``GET /v1/models`` (``{}`` if the server has none or fails)."""
    import httpx
    url = base_url.rstrip("/").removesuffix("/v1") + "/v1/models"
    try:
        data = httpx.get(url, timeout=30.0).json()
        return (data.get("data") or [{}])[0]
    except (httpx.HTTPError, ValueError):
        return {}


def server_tokenize(base_url: str, text: str, model: Optional[str] = None) -> Optional[list[int]]:
    """Token ids from the server's ``POST /tokenize`` (goodserve's), or ``None`` if it has none."""
    import httpx
    url = base_url.rstrip("/").removesuffix("/v1") + "/tokenize"
    body: dict[str, Any] = {"prompt": text, "add_special_tokens": False}
    if model:
        body["model"] = model
    try:
        resp = httpx.post(url, json=body, timeout=30.0)
        if resp.status_code != 200:
            return None
        tokens = resp.json().get("tokens")
        return [int(t) for t in tokens] if isinstance(tokens, list) else None
    except (httpx.HTTPError, ValueError):
        return None

