"""What crosses between the event loop and the engine thread of :class:`~goodserve.engine.async_engine.AsyncEngine`:
typed commands in, per-request output streams out, and the errors either side can meet."""

from __future__ import annotations

import asyncio
import concurrent.futures
from dataclasses import dataclass
from typing import Any, Callable, Optional, Union

from goodserve.outputs import RequestOutput
from goodserve.request_options import RequestOptions
from goodserve.sampling_params import SamplingParams
from goodserve.scheduler.policy import SLOUnattainableError


class EngineDeadError(RuntimeError):
    """The engine loop has stopped (it raised, or the engine was shut down)."""


class EngineShutdownError(EngineDeadError):
    """The engine was shut down on purpose (the server is stopping); its requests were aborted."""


class RequestFailedError(RuntimeError):
    """One request's own processing raised inside the engine (our fault, not the client's); the engine serves
    on without it."""


class InjectedStepFault(RuntimeError):
    """Raised by an engine step chosen with ``inject_step_fault`` (fault-injection tests and soaks)."""


STREAM_END = object()  # put into a stream's queue when its request was aborted without a final output


class RequestStream:
    """The outputs of one request, as an async iterator of delta :class:`RequestOutput`\\ s.

    Iteration ends after the finished output, or silently when the request is aborted. If the request's own
    processing failed, iteration raises :class:`RequestFailedError`; if the engine loop dies,
    :class:`EngineDeadError`.

    Args:
        request_id: The request.
        loop: The event loop the consumer runs on (outputs are delivered there).
    """

    def __init__(self, request_id: str, loop: asyncio.AbstractEventLoop) -> None:
        self.request_id = request_id
        self.loop = loop
        self.finished = False
        self._queue: asyncio.Queue = asyncio.Queue()

    def put(self, item: Any) -> None:
        """Queue an output, ``STREAM_END`` or an exception (on the event loop's thread only)."""
        self._queue.put_nowait(item)

    def __aiter__(self) -> "RequestStream":
        return self

    async def __anext__(self) -> RequestOutput:
        if self.finished:
            raise StopAsyncIteration
        item = await self._queue.get()
        if item is STREAM_END:
            self.finished = True
            raise StopAsyncIteration
        if isinstance(item, BaseException):
            self.finished = True
            raise item
        if item.finished:
            self.finished = True
            if item.finish_reason == "shed":
                raise SLOUnattainableError(item.error)
            if item.error is not None:
                raise RequestFailedError(item.error)
        return item


@dataclass
class AddCommand:
    """Queue a request (see :meth:`AsyncEngine.add_request`); ``future`` gets ``None`` or the error."""

    prompt: Union[str, list[int]]
    prompt_token_ids: Optional[list[int]]  # the text prompt, already tokenised off the engine thread
    params: SamplingParams
    request_id: str
    arrival_time: float
    stream: RequestStream
    future: concurrent.futures.Future
    options: Optional[RequestOptions] = None  # None: the engine's defaults


@dataclass
class AbortCommand:
    """Abort requests by id (unknown or finished ids are ignored)."""

    request_ids: list[str]


@dataclass
class CallCommand:
    """Run ``fn(engine)`` between steps; ``future`` gets its result or its exception."""

    fn: Callable[[Any], Any]
    future: concurrent.futures.Future


Command = Union[AddCommand, AbortCommand, CallCommand]
