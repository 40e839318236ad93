"""Server-sent events for streamed completions, whose accounting and clean-up run however the stream ends.

A stream ends in one of three ways: it is sent in full (``data: [DONE]``), it fails (an error event in the
OpenAI format, then ``[DONE]``), or the client goes away (Starlette cancels the response; the generator may
then be stopped at any ``yield``, or never have started). :class:`EventStreamResponse` calls ``on_close``
with the outcome in every case, so aborts reach the engine at once (C12) and every call is counted once.
"""

from __future__ import annotations

import contextlib
import logging
from typing import Any, AsyncIterator, Callable, Optional

from starlette.responses import StreamingResponse
from starlette.types import Receive, Scope, Send

from goodserve.engine.async_types import EngineDeadError, RequestFailedError
from goodserve.scheduler.policy import SLOUnattainableError
from goodserve.server.errors import APIError, internal_error, to_api_error

logger = logging.getLogger(__name__)

DONE = "data: [DONE]\n\n"


def sse(obj: Any) -> str:
    """One ``data:`` event holding a pydantic model as JSON."""
    return f"data: {obj.model_dump_json()}\n\n"


class EventStreamResponse(StreamingResponse):
    """A ``text/event-stream`` response that ends with ``[DONE]`` and reports how it ended.

    Args:
        events: The stream's events (without ``[DONE]``). An exception it raises is sent as an error event.
        on_close: Called exactly once when the response is over, with ``None`` if every event was sent,
            the :class:`APIError` sent if it failed, or ``"aborted"`` if the client left first.
    """

    def __init__(self, events: AsyncIterator[str], on_close: Callable[[Optional[APIError | str]], None]) -> None:
        self._outcome: Optional[APIError | str] = "aborted"
        self._on_close = on_close
        super().__init__(self._wrap(events), media_type="text/event-stream")

    async def _wrap(self, events: AsyncIterator[str]) -> AsyncIterator[str]:
        try:
            async with contextlib.aclosing(events):
                async for event in events:
                    yield event
        except Exception as e:  # noqa: BLE001 - reported to the client in the stream
            # Once a stream is open the client's input was accepted: only the engine's own errors keep their
            # status; anything else is a fault of ours (a 500, logged with its traceback), never a 400.
            if isinstance(e, (APIError, EngineDeadError, RequestFailedError, SLOUnattainableError)):
                err = to_api_error(e)
                logger.warning("stream failed: %s", err.message)
            else:
                err = internal_error(e, "streaming")
            yield sse(err.body())
            self._outcome = err  # only once the client has the error event; a client gone before is an abort
            yield DONE
            return
        self._outcome = None
        yield DONE

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            try:
                self._on_close(self._outcome)
            finally:
                await self.body_iterator.aclose()  # type: ignore[attr-defined]
