"""The choices of one API call: each is an engine request whose delta outputs are gathered here.

A call with ``n`` choices (and, for completions, several prompts) runs one engine request per choice.
:class:`Choice` accumulates its request's deltas (text, token ids, logprobs, finish, metrics) and remembers
how much of them a stream has sent; :func:`iterate_choices` merges the requests' streams as outputs arrive;
the formatting helpers build usage and logprobs in the OpenAI shapes from what a choice holds.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import AsyncIterator, Optional

from goodserve.engine.async_types import RequestFailedError, RequestStream
from goodserve.outputs import RequestMetrics, RequestOutput
from goodserve.scheduler.policy import SLOUnattainableError
from goodserve.server import protocol as P
from goodserve.server.metrics import RequestTracker
from goodserve.server.token_bytes import TextOffsets, TokenBytes


@dataclass
class Choice:
    """One engine request behind one choice, and what its outputs added up to so far.

    Attributes:
        index: The choice's index in the response.
        stream: The request's delta outputs.
        tracker: Feeds its tokens and latencies into the metrics.
        prompt_index: Which prompt of the call it answers.
        first_of_prompt: The first choice of its prompt (usage counts each prompt once).
        text: All text so far.
        token_ids: All generated token ids so far.
        logprobs, top_logprobs: Per token, when asked for.
        sent_tokens: Tokens whose logprobs a stream has sent.
        skip_special_tokens: Whether its text skips special tokens (they then have no bytes).
        echo: Completions ``echo``: the prompt text still to send before the output (``None``: none).
        prompt_logprobs: The prompt's logprobs (completions ``echo`` with ``logprobs``), once they came.
        offsets: Completions ``text_offset`` of the next token (created at the first logprobs sent).
        kv_transfer_params: On a producer, the handle of the request's held KV blocks, once it finished.
    """

    index: int
    stream: RequestStream
    tracker: RequestTracker
    prompt_index: int
    first_of_prompt: bool
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    logprobs: Optional[list[float]] = None
    top_logprobs: Optional[list[list[tuple[int, float]]]] = None
    prompt_token_ids: list[int] = field(default_factory=list)
    finish_reason: Optional[str] = None
    stop_reason: Optional[int | str] = None
    metrics: Optional[RequestMetrics] = None
    sent_tokens: int = 0
    skip_special_tokens: bool = True
    echo: Optional[str] = None
    prompt_logprobs: Optional[list] = None
    offsets: Optional[TextOffsets] = None
    kv_transfer_params: Optional[dict] = None

    def take_echo(self) -> str:
        """The echoed prompt text the first time, then ``""``."""
        echo, self.echo = self.echo or "", None
        return echo

    def add(self, out: RequestOutput) -> None:
        """Take one delta output (lists grow in place: a long stream never copies what it holds)."""
        c = out.outputs[0]
        self.text += c.text
        self.token_ids.extend(c.token_ids)
        if c.logprobs is not None:
            if self.logprobs is None:
                self.logprobs, self.top_logprobs = [], []
            self.logprobs.extend(c.logprobs)
            self.top_logprobs.extend(c.top_logprobs or [[] for _ in c.logprobs])
        self.prompt_token_ids = out.prompt_token_ids
        if out.prompt_logprobs is not None:
            self.prompt_logprobs = out.prompt_logprobs
        self.finish_reason, self.stop_reason, self.metrics = c.finish_reason, c.stop_reason, out.metrics
        if out.kv_transfer_params is not None:
            self.kv_transfer_params = out.kv_transfer_params


async def iterate_choices(choices: list[Choice]) -> AsyncIterator[tuple[Choice, RequestOutput]]:
    """Outputs of all choices' requests as they come, each after it was added to its choice.

    Raises:
        RequestFailedError, EngineDeadError: as the requests' streams do.
    """
    queue: asyncio.Queue = asyncio.Queue()

    async def pump(choice: Choice) -> None:
        try:
            async for out in choice.stream:
                queue.put_nowait((choice, out))
        except BaseException as e:  # noqa: BLE001 - forwarded to the consumer
            queue.put_nowait((choice, e))
            return
        queue.put_nowait((choice, None))

    tasks = [asyncio.create_task(pump(c)) for c in choices]
    try:
        remaining = len(choices)
        while remaining:
            choice, item = await queue.get()
            if item is None:
                remaining -= 1
                continue
            if isinstance(item, BaseException):
                if isinstance(item, RequestFailedError):
                    choice.tracker.ended("error")
                elif isinstance(item, SLOUnattainableError):
                    choice.tracker.ended("shed")
                raise item
            choice.tracker.observe(item)
            choice.add(item)
            yield choice, item
    finally:
        for t in tasks:
            t.cancel()


def usage(choices: list[Choice]) -> P.UsageInfo:
    """Prompt tokens (each prompt once), completion tokens and prefix-cache hits of a call."""
    prompt = cached = completion = 0
    for c in choices:
        completion += len(c.token_ids)
        if c.first_of_prompt:
            prompt += len(c.prompt_token_ids)
            cached += c.metrics.num_cached_tokens if c.metrics else 0
    return P.UsageInfo(prompt_tokens=prompt, completion_tokens=completion, total_tokens=prompt + completion,
                       prompt_tokens_details=P.PromptTokensDetails(cached_tokens=cached))


def completion_logprobs(tb: TokenBytes, choice: Choice, echo_len: int = 0) -> Optional[P.CompletionLogprobs]:
    """Completions ``logprobs`` of the tokens not yet sent (all of them for a full response); marks them sent.

    With ``echo`` (``echo_len`` characters of prompt text before the output), the first call also lists the
    prompt's tokens (the first with ``null`` logprobs), and ``text_offset`` counts from the start of the
    echoed text. Token strings and offsets come from each token's own bytes (see :mod:`token_bytes`).
    """
    if choice.logprobs is None:
        return None
    lp = P.CompletionLogprobs()

    def add(token_id: int, logprob: Optional[float], top: Optional[list[tuple[int, float]]], skip: bool,
            offsets: TextOffsets) -> None:
        lp.tokens.append(tb.token(token_id, skip))
        lp.token_logprobs.append(logprob)
        lp.top_logprobs.append(None if top is None else {tb.token(t, skip): v for t, v in top})
        lp.text_offset.append(offsets.next(tb.bytes(token_id, skip)))

    if choice.offsets is None:
        if choice.prompt_logprobs is not None:
            prompt_offsets = TextOffsets(0)
            for token_id, entry in zip(choice.prompt_token_ids, choice.prompt_logprobs):
                add(token_id, None if entry is None else entry[0], None if entry is None else entry[1], False,
                    prompt_offsets)
        choice.offsets = TextOffsets(echo_len)
    for i in range(choice.sent_tokens, len(choice.token_ids)):
        add(choice.token_ids[i], choice.logprobs[i], choice.top_logprobs[i], choice.skip_special_tokens,
            choice.offsets)
    choice.sent_tokens = len(choice.token_ids)
    return lp


def chat_logprobs(tb: TokenBytes, choice: Choice) -> Optional[P.ChatLogprobs]:
    """Chat ``logprobs`` of the tokens not yet sent (all of them for a full response); marks them sent. Each
    token's ``token`` and ``bytes`` are its own (a token holding part of a character has those bytes)."""
    if choice.logprobs is None:
        return None
    skip = choice.skip_special_tokens
    content = []
    for i in range(choice.sent_tokens, len(choice.token_ids)):
        t = choice.token_ids[i]
        top = [P.TopLogprob(token=tb.token(u, skip), logprob=v, bytes=list(tb.bytes(u, skip)))
               for u, v in choice.top_logprobs[i]]
        content.append(P.ChatTokenLogprob(token=tb.token(t, skip), logprob=choice.logprobs[i],
                                          bytes=list(tb.bytes(t, skip)), top_logprobs=top))
    choice.sent_tokens = len(choice.token_ids)
    return P.ChatLogprobs(content=content)
