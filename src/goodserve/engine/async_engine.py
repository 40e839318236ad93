"""The bridge between the synchronous :class:`Engine` and an asyncio server.

One thread owns the engine and is the only code that ever touches it. Other threads talk to it through a
queue of typed commands (:mod:`goodserve.engine.async_types`) guarded by a condition variable: adds, aborts
and calls are applied by the engine thread before each step, so engine state is never shared. Outputs of a
step are handed to per-request streams with ``loop.call_soon_threadsafe`` (one call per event loop per
step), so the event loop never waits on a model step. When nothing is queued or running the engine thread
sleeps on the condition (no busy spin).

Request life as seen from the event loop::

    stream = await async_engine.add_request(prompt, params)   # ValueError here, before any byte is sent
    async for output in stream:                               # delta RequestOutputs until finished
        ...
    async_engine.abort(stream.request_id)                     # e.g. the client went away
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import os
import time
import uuid
from typing import Any, AsyncIterator, Callable, Optional

from goodserve.engine.args import EngineArgs
from goodserve.engine.async_types import (AbortCommand, AddCommand, CallCommand, EngineDeadError,
                                          EngineShutdownError, InjectedStepFault, RequestFailedError,
                                          RequestStream)
from goodserve.engine.engine import Engine, PromptType
from goodserve.engine.engine_thread import EngineThread
from goodserve.models.quant import make_dense_copies
from goodserve.outputs import RequestOutput
from goodserve.request_options import RequestOptions
from goodserve.runner.draft_model import DraftModelProposer
from goodserve.sampling_params import SamplingParams
from goodserve.scheduler.output import SchedulerStats

logger = logging.getLogger(__name__)

__all__ = ["AsyncEngine", "EngineDeadError", "EngineShutdownError", "InjectedStepFault", "RequestFailedError",
           "RequestStream"]


class AsyncEngine:
    """Runs an :class:`Engine` in its own thread and serves it to asyncio code.

    Give either a built ``engine`` or a ``build`` function that the engine thread calls to build it. The
    server uses ``build`` (see :meth:`from_engine_args`) so that every torch operation, loading included,
    runs on the one engine thread: each thread that runs parallel torch ops on CPU gets its own OpenMP
    worker pool, and with two pools on the machine's cores OpenMP stops spinning between parallel regions,
    which made every step of a small model about 1.7x slower on 2 cores.

    Args:
        engine: A built engine; from now on only the engine thread may touch it.
        start: Start the engine thread at once (with ``build``: and wait until the engine is built).
        step_trace: Write a line per step to this file (see :mod:`goodserve.engine.step_trace`).
        build: Builds the engine on the engine thread, instead of ``engine``.
        on_dead: Called once, on the engine thread, with the exception if the engine loop dies (not on a
            normal :meth:`shutdown`); the server uses it to exit so that a supervisor restarts the process.
        inject_step_fault: Make engine step number ``N`` (1-based, counted over the engine's life) raise
            :class:`InjectedStepFault`: a test-only hook for fault-injection tests and soaks.

    Attributes:
        tokenizer: The engine's tokenizer (safe for encode/decode from the event loop).
        chat_template: The model's chat template (or ``None``: the tokenizer's).
        max_model_len: Longest prompt + output in tokens.
        model_path: Where the model came from.
        config: The engine's resolved config (its ``request_options`` builds a request's options).
        (With ``build``, these are ``None`` until the engine is built.)

    Raises:
        ValueError: if both or neither of ``engine`` and ``build`` are given; whatever ``build`` raises.
        OSError: if ``step_trace`` cannot be opened.
    """

    def __init__(self, engine: Optional[Engine] = None, start: bool = True, step_trace: Optional[str] = None,
                 build: Optional[Callable[[], Engine]] = None,
                 on_dead: Optional[Callable[[BaseException], None]] = None,
                 inject_step_fault: Optional[int] = None) -> None:
        if (engine is None) == (build is None):
            raise ValueError("give AsyncEngine a built engine or a build function, not both or neither")
        self.engine = engine
        self.tokenizer: Any = None
        self.chat_template: Optional[str] = None
        self.max_model_len: Optional[int] = None
        self.model_path: Optional[str] = None
        self.config: Any = None
        self.kv_events_info: Optional[dict] = None  # where the KV events go (GET /v1/kv_events), if published
        self.vocab_size: Optional[int] = None
        if engine is not None:
            self._adopt(engine)
        self._engine_thread = EngineThread(engine, build, self._adopt, step_trace, on_dead, inject_step_fault)
        if start:
            self.start()

    def _adopt(self, engine: Engine) -> None:
        self.engine = engine
        self.tokenizer = engine.tokenizer
        self.chat_template = engine.chat_template
        self.max_model_len = engine.max_model_len
        self.model_path = engine.config.model_path
        self.config = engine.config
        publisher = getattr(getattr(engine, "core", None), "kv_events", None)
        self.kv_events_info = publisher.info(engine.config.cache.block_size) if publisher is not None else None
        model = getattr(engine.config, "model", None)
        self.vocab_size = model.vocab_size if model is not None else len(engine.tokenizer)

    def check_params(self, params: SamplingParams) -> None:
        """:meth:`Engine.check_params`, callable from any thread (it reads only immutable config and the
        thread-safe grammar compiler).

        Raises:
            ValueError: naming the field.
        """
        self.engine.check_params(params)

    @classmethod
    def from_engine_args(cls, args: EngineArgs, step_trace: Optional[str] = None, **kwargs: Any) -> "AsyncEngine":
        """Start the engine thread, load the model on it and return once it is ready.

        Raises:
            ValueError, FileNotFoundError: as :class:`Engine`.
            OSError: if ``step_trace`` cannot be opened.
        """
        return cls(build=lambda: _serving_engine(args), step_trace=step_trace, **kwargs)

    @property
    def model_name(self) -> str:
        """A short name for the model: its file or directory name without extension."""
        base = os.path.basename(os.path.normpath(self.model_path))
        return os.path.splitext(base)[0] if base.endswith(".gguf") else base

    # ---------------------------------------------------------------------------------------- control
    # ---------------------------------------------------------------------------------------- control
    def start(self) -> None:
        """Start the engine thread (once); with a ``build`` function, wait until the engine is built.

        Raises:
            EngineDeadError: if the engine was shut down before it was built.
            Exception: whatever building the engine raised.
        """
        self._engine_thread.start()

    def shutdown(self, timeout: float = 10.0) -> None:
        """Stop the engine thread after its current step: unfinished requests are aborted (their KV blocks
        freed) and open streams end with :class:`EngineShutdownError`.

        Args:
            timeout: Seconds to wait for the thread to end (``0``: do not wait, e.g. from an event loop).
        """
        self._engine_thread.shutdown(timeout)

    def pause(self) -> None:
        """Stop stepping (commands are still applied, so requests queue up). For tests and maintenance."""
        self._engine_thread.pause()

    def resume(self) -> None:
        """Undo :meth:`pause`."""
        self._engine_thread.resume()

    @property
    def error(self) -> Optional[BaseException]:
        """What killed the engine loop, or ``None`` while it runs or after a normal shutdown."""
        return self._engine_thread.error

    def is_running(self) -> bool:
        """Whether the engine thread is still alive (it may be finishing its last step after a shutdown)."""
        return self._engine_thread.is_running()

    def is_healthy(self) -> bool:
        """Whether the engine loop is alive and has not failed."""
        return self._engine_thread.is_healthy()

    @property
    def stats(self) -> SchedulerStats:
        """The scheduler's state after the latest step or command batch (read by ``/metrics`` and admission)."""
        return self._engine_thread.stats

    def num_waiting_total(self) -> int:
        """Requests waiting in the scheduler plus adds not yet applied (for admission control)."""
        return self._engine_thread.num_waiting_total()

    async def add_request(self, prompt: PromptType, params: Optional[SamplingParams] = None,
                          request_id: Optional[str] = None,
                          options: Optional[RequestOptions] = None) -> RequestStream:
        """Queue a request and wait (without blocking the loop) until the engine has accepted it.

        Args:
            prompt: Text or token ids.
            params: Sampling parameters.
            request_id: Unique id; a random one when ``None``.
            options: Its :class:`RequestOptions` (see :meth:`Engine.add_request`); ``None``: the engine's
                defaults.

        Returns:
            The request's output stream (iterating it raises :class:`SLOUnattainableError` if the ``slo``
            policy sheds the request while it is queued).

        Raises:
            ValueError: on invalid parameters, an empty or invalid prompt or a prompt over the context length
                (the engine's message, e.g. "... the maximum context length is N tokens ...").
            EngineDeadError: if the engine loop is not running.
            SLOUnattainableError: if load shedding refuses it on arrival.
            Exception: whatever else tokenising raises (a fault of ours).
        """
        arrival = time.monotonic()
        request_id = request_id or f"req-{uuid.uuid4().hex}"
        # Text is tokenised here, in a worker thread, so a huge prompt never stalls the engine's steps.
        ids = await asyncio.to_thread(self.engine.tokenize, prompt) if isinstance(prompt, str) else None
        stream = RequestStream(request_id, asyncio.get_running_loop())
        future: concurrent.futures.Future = concurrent.futures.Future()
        self._engine_thread.submit(AddCommand(prompt, ids, params or SamplingParams(), request_id, arrival, stream,
                                              future, options))
        try:
            await asyncio.wrap_future(future)
        except asyncio.CancelledError:  # the caller went away while the engine was accepting it
            self.abort(request_id)
            raise
        return stream

    async def generate(self, prompt: PromptType, params: Optional[SamplingParams] = None,
                       request_id: Optional[str] = None,
                       options: Optional[RequestOptions] = None) -> AsyncIterator[RequestOutput]:
        """Yield the request's outputs (deltas unless ``params.output_kind`` says otherwise) until it finishes;
        aborts it if the consumer stops early.

        Validation happens on the first ``__anext__``, before any output is yielded.

        Raises:
            ValueError: as :meth:`add_request`.
        """
        stream = await self.add_request(prompt, params, request_id, options)
        try:
            async for out in stream:
                yield out
        finally:
            if not stream.finished:
                self.abort(stream.request_id)

    def abort(self, request_id: str | list[str]) -> None:
        """Abort requests from any thread; never blocks on a step. Unknown or finished ids are ignored."""
        ids = [request_id] if isinstance(request_id, str) else list(request_id)
        if ids:
            try:
                self._engine_thread.submit(AbortCommand(ids))
            except EngineDeadError:
                pass  # a stopped engine has aborted everything already

    def call(self, fn: Callable[[Engine], Any], timeout: Optional[float] = 30.0) -> Any:
        """Run ``fn(engine)`` on the engine thread between steps and return its result (blocking).

        For tests and diagnostics, e.g. ``call(lambda e: e.core.check_integrity())``.
        Must not be called from the engine thread.
        """
        future: concurrent.futures.Future = concurrent.futures.Future()
        self._engine_thread.submit(CallCommand(fn, future))
        return future.result(timeout)

    async def call_async(self, fn: Callable[[Engine], Any]) -> Any:
        """Like :meth:`call`, awaited from the event loop."""
        future: concurrent.futures.Future = concurrent.futures.Future()
        self._engine_thread.submit(CallCommand(fn, future))
        return await asyncio.wrap_future(future)


def _serving_engine(args: EngineArgs) -> Engine:
    """An :class:`Engine` for serving: the dense copies of its quantized layers, and of its draft model's, are made
    before the first step (:func:`goodserve.models.quant.make_dense_copies`), so no served step pays for them (made
    in a draft model's first catch-up, they priced every later one at several times its cost)."""
    engine = Engine(args)
    runner = engine.core.runner
    draft = runner.proposer.runner if isinstance(runner.proposer, DraftModelProposer) else None
    made = sum(make_dense_copies(r.model) for r in (runner, draft) if r is not None)
    if made:
        logger.debug("made the dense copies of %d quantized layers", made)
    return engine
