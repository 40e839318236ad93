"""The bridge between the synchronous :class:`Engine` and an asyncio server.

One thread owns the engine and is the only code that ever touches it. Other threads talk to it through a
command queue guarded by a condition variable: ``add`` and ``abort`` commands are applied by the engine
thread before each step, so engine state is never shared. Outputs of a step are handed to per-request
``asyncio.Queue``\\ s with ``loop.call_soon_threadsafe`` (one call per event loop per step), so the event loop
never waits on a model step. When nothing is queued or running the engine thread sleeps on the condition
(no busy spin).

Request life as seen from the event loop::

    stream = await async_engine.add_request(prompt, params)   # ValueError here, before any byte is sent
    async for output in stream:                               # cumulative RequestOutputs until finished
        ...
    async_engine.abort(stream.request_id)                     # e.g. the client went away
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import os
import threading
import time
import uuid
from collections import deque
from dataclasses import dataclass
from typing import Any, AsyncIterator, Callable, Optional, Union

from goodserve.engine.args import EngineArgs
from goodserve.engine.engine import Engine, PromptType
from goodserve.engine.step_trace import StepTraceWriter, TracedStep
from goodserve.outputs import RequestOutput
from goodserve.sampling_params import SamplingParams
from goodserve.scheduler.output import StepShape

logger = logging.getLogger(__name__)


class EngineDeadError(RuntimeError):
    """The engine loop has stopped (it raised, or the engine was shut down)."""


class EngineShutdownError(EngineDeadError):
    """The engine was shut down on purpose (the server is stopping); its requests were aborted."""


class RequestFailedError(RuntimeError):
    """One request's own processing raised inside the engine (our fault, not the client's); the engine serves
    on without it."""


class InjectedStepFault(RuntimeError):
    """Raised by an engine step chosen with ``inject_step_fault`` (fault-injection tests and soaks)."""


@dataclass
class AddCommand:
    """Queue a request (see :meth:`AsyncEngine.add_request`); ``future`` gets ``None`` or the error."""

    prompt: PromptType
    params: SamplingParams
    request_id: str
    priority: int
    cache_salt: Optional[str]
    arrival_time: float
    stream: "RequestStream"
    future: concurrent.futures.Future


@dataclass
class AbortCommand:
    """Abort requests by id (unknown or finished ids are ignored)."""

    request_ids: list[str]


@dataclass
class CallCommand:
    """Run ``fn(engine)`` between steps; ``future`` gets its result or its exception."""

    fn: Callable[[Engine], Any]
    future: concurrent.futures.Future


Command = Union[AddCommand, AbortCommand, CallCommand]


@dataclass(frozen=True)
class EngineSnapshot:
    """Engine state as of the end of the latest step or command batch (read by ``/metrics`` and admission).

    Attributes:
        num_running: Requests in the running batch.
        num_waiting: Requests waiting for admission (new or preempted).
        num_tokens_waiting: Prompt tokens not yet computed: all tokens of waiting requests plus the prompt
            remainder of running requests still in (chunked) prefill. A saturation signal for autoscalers.
        kv_cache_usage: Fraction of KV blocks in use, in ``[0, 1]``.
        num_preemptions_total: Preemptions since start.
        prefix_cache_queries: Prompt tokens looked up in the prefix cache since start.
        prefix_cache_hits: Of which found (tokens).
    """

    num_running: int = 0
    num_waiting: int = 0
    num_tokens_waiting: int = 0
    kv_cache_usage: float = 0.0
    num_preemptions_total: int = 0
    prefix_cache_queries: int = 0
    prefix_cache_hits: int = 0


_END = object()  # put into a stream's queue when its request was aborted without a final output


class RequestStream:
    """The outputs of one request, as an async iterator of cumulative :class:`RequestOutput`\\ s.

    Iteration ends after the finished output, or silently when the request is aborted. If the request's own
    processing failed, iteration raises :class:`RequestFailedError`; if the engine loop dies,
    :class:`EngineDeadError`.
    """

    def __init__(self, request_id: str, loop: asyncio.AbstractEventLoop) -> None:
        self.request_id = request_id
        self.loop = loop
        self.finished = False
        self._queue: asyncio.Queue = asyncio.Queue()

    def _put(self, item: Any) -> None:
        """Called on the event loop thread only."""
        self._queue.put_nowait(item)

    def __aiter__(self) -> "RequestStream":
        return self

    async def __anext__(self) -> RequestOutput:
        if self.finished:
            raise StopAsyncIteration
        item = await self._queue.get()
        if item is _END:
            self.finished = True
            raise StopAsyncIteration
        if isinstance(item, BaseException):
            self.finished = True
            raise item
        if item.finished:
            self.finished = True
            if item.error is not None:
                raise RequestFailedError(item.error)
        return item


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
        self._build = build
        self._built: concurrent.futures.Future = concurrent.futures.Future()
        if engine is not None:
            self._adopt(engine)
            self._built.set_result(None)
        self._on_dead = on_dead
        self._inject_step_fault = inject_step_fault
        self._cond = threading.Condition()
        self._commands: deque[Command] = deque()  # guarded by _cond
        self._applying: list[Command] = []  # taken off the queue, being applied (engine thread)
        self._num_pending_adds = 0  # add commands queued, not yet applied; guarded by _cond
        self._streams: dict[str, RequestStream] = {}  # only the engine thread touches it
        self._snapshot = EngineSnapshot()
        self._paused = False
        self._stopped = False
        self._error: Optional[BaseException] = None
        self._trace = StepTraceWriter(step_trace) if step_trace else None
        self._thread = threading.Thread(target=self._run, name="goodserve-engine", daemon=True)
        if start:
            self.start()

    def _adopt(self, engine: Engine) -> None:
        self.engine = engine
        self.tokenizer = engine.tokenizer
        self.chat_template = engine.chat_template
        self.max_model_len = engine.max_model_len
        self.model_path = engine.config.model_path

    @classmethod
    def from_engine_args(cls, args: EngineArgs, step_trace: Optional[str] = None, **kwargs: Any) -> "AsyncEngine":
        """Start the engine thread, load the model on it and return once it is ready.

        Raises:
            ValueError, FileNotFoundError: as :class:`Engine`.
            OSError: if ``step_trace`` cannot be opened.
        """
        return cls(build=lambda: Engine(args), step_trace=step_trace, **kwargs)

    @property
    def model_name(self) -> str:
        """A short name for the model: its file or directory name without extension."""
        base = os.path.basename(os.path.normpath(self.model_path))
        return os.path.splitext(base)[0] if base.endswith(".gguf") else base

    # ---------------------------------------------------------------------------------------- control
    def start(self) -> None:
        """Start the engine thread (once); with a ``build`` function, wait until the engine is built.

        Raises:
            EngineDeadError: if the engine was shut down before it was built.
            Exception: whatever building the engine raised.
        """
        with self._cond:
            stopped = self._stopped
        if self._thread.ident is None and not stopped:
            self._thread.start()
        if self._build is not None:
            if self._thread.ident is None:
                raise EngineDeadError("the engine was shut down before it was built")
            self._built.result()

    def shutdown(self, timeout: float = 10.0) -> None:
        """Stop the engine thread after its current step: unfinished requests are aborted (their KV blocks
        freed) and open streams end with :class:`EngineShutdownError`. A model still loading finishes
        loading first (``start`` then raises :class:`EngineDeadError`).

        Args:
            timeout: Seconds to wait for the thread to end (``0``: do not wait, e.g. from an event loop).
        """
        with self._cond:
            self._stopped = True
            self._cond.notify_all()
        if self._thread.ident is None and self._trace is not None:
            self._trace.close()  # the thread that would have closed it never ran
        if self._thread.is_alive() and threading.current_thread() is not self._thread:
            self._thread.join(timeout)

    def pause(self) -> None:
        """Stop stepping (commands are still applied, so requests queue up). For tests and maintenance."""
        with self._cond:
            self._paused = True

    def resume(self) -> None:
        """Undo :meth:`pause`."""
        with self._cond:
            self._paused = False
            self._cond.notify_all()

    @property
    def error(self) -> Optional[BaseException]:
        """What killed the engine loop, or ``None`` while it runs or after a normal shutdown."""
        return self._error

    def is_running(self) -> bool:
        """Whether the engine thread is still alive (it may be finishing its last step after a shutdown)."""
        return self._thread.is_alive()

    def is_healthy(self) -> bool:
        """Whether the engine loop is alive and has not failed."""
        return self._error is None and not self._stopped and self._thread.is_alive()

    @property
    def snapshot(self) -> EngineSnapshot:
        """Engine state after the latest step or command batch."""
        return self._snapshot

    def num_waiting_total(self) -> int:
        """Requests waiting in the scheduler plus adds not yet applied (for admission control)."""
        with self._cond:
            return self._snapshot.num_waiting + self._num_pending_adds

    # --------------------------------------------------------------------------------------- requests
    async def add_request(self, prompt: PromptType, params: Optional[SamplingParams] = None,
                          request_id: Optional[str] = None, priority: int = 0,
                          cache_salt: Optional[str] = None) -> RequestStream:
        """Queue a request and wait (without blocking the loop) until the engine has accepted it.

        Args:
            prompt: Text or token ids.
            params: Sampling parameters.
            request_id: Unique id; a random one when ``None``.
            priority: Lower runs first under the ``priority`` policy.
            cache_salt: Prefix-cache isolation key (see :meth:`Engine.add_request`).

        Returns:
            The request's output stream.

        Raises:
            ValueError: on invalid parameters, an empty prompt or a prompt over the context length (the
                engine's message, e.g. "... the maximum context length is N tokens ...").
            EngineDeadError: if the engine loop is not running.
        """
        request_id = request_id or f"req-{uuid.uuid4().hex}"
        stream = RequestStream(request_id, asyncio.get_running_loop())
        future: concurrent.futures.Future = concurrent.futures.Future()
        self._submit(AddCommand(prompt, params or SamplingParams(), request_id, priority, cache_salt,
                                time.monotonic(), stream, future))
        try:
            await asyncio.wrap_future(future)
        except asyncio.CancelledError:  # the caller went away while the engine was accepting it
            self.abort(request_id)
            raise
        return stream

    async def generate(self, prompt: PromptType, params: Optional[SamplingParams] = None,
                       request_id: Optional[str] = None, priority: int = 0,
                       cache_salt: Optional[str] = None) -> AsyncIterator[RequestOutput]:
        """Yield the request's cumulative outputs until it finishes; aborts it if the consumer stops early.

        Validation happens on the first ``__anext__``, before any output is yielded.

        Raises:
            ValueError: as :meth:`add_request`.
        """
        stream = await self.add_request(prompt, params, request_id, priority, cache_salt)
        try:
            async for out in stream:
                yield out
        finally:
            if not stream.finished:
                self.abort(stream.request_id)

    def abort(self, request_id: str | list[str]) -> None:
        """Abort requests from any thread; never blocks on a step. Unknown or finished ids are ignored."""
        ids = [request_id] if isinstance(request_id, str) else list(request_id)
        if ids and not self._stopped:
            self._submit(AbortCommand(ids))

    def call(self, fn: Callable[[Engine], Any], timeout: Optional[float] = 30.0) -> Any:
        """Run ``fn(engine)`` on the engine thread between steps and return its result (blocking).

        For tests and diagnostics, e.g. ``call(lambda e: e.scheduler.kv_cache_manager.check_integrity())``.
        Must not be called from the engine thread.
        """
        future: concurrent.futures.Future = concurrent.futures.Future()
        self._submit(CallCommand(fn, future))
        return future.result(timeout)

    async def call_async(self, fn: Callable[[Engine], Any]) -> Any:
        """Like :meth:`call`, awaited from the event loop."""
        future: concurrent.futures.Future = concurrent.futures.Future()
        self._submit(CallCommand(fn, future))
        return await asyncio.wrap_future(future)

    def _submit(self, command: Command) -> None:
        with self._cond:
            if self._error is not None or self._stopped:
                raise EngineDeadError(f"the engine loop is not running: {self._error or 'shut down'}")
            self._commands.append(command)
            if isinstance(command, AddCommand):
                self._num_pending_adds += 1
            self._cond.notify_all()

    # ---------------------------------------------------------------------------------- engine thread
    def _run(self) -> None:
        try:
            if self._build is not None:
                try:
                    self._adopt(self._build())
                    if self._stopped:
                        raise EngineDeadError("the engine was shut down while it was being built")
                except BaseException as e:  # noqa: BLE001 - handed to start()
                    self._built.set_exception(e)
                    raise
                self._built.set_result(None)
            self._loop()
        except BaseException as e:  # noqa: BLE001 - any failure kills the loop; report it to every stream
            if self._built.done() and self._built.exception() is e:
                logger.debug("building the engine failed: %s", e)  # re-raised by start()
            else:
                logger.exception("engine loop died")
            self._error = e
        finally:
            self._fail_everything()
        if self._error is not None and self._on_dead is not None and self._built.exception() is None:
            self._on_dead(self._error)

    def _loop(self) -> None:
        """Apply commands and step until shut down; whatever escapes here is a fault of the engine."""
        engine = self.engine
        trace_start = cycle_end = time.perf_counter()
        num_steps = 0
        while True:
            with self._cond:
                idle = False
                while not self._stopped and not self._commands and \
                        (self._paused or not engine.has_unfinished_requests()):
                    idle = True
                    self._cond.wait()
                if self._stopped:
                    break
                self._applying = list(self._commands)
                self._commands.clear()
                paused = self._paused
            # A cycle runs from the end of the previous one (lock and GIL waits included), or from the
            # wake-up after the engine slept for lack of work.
            cycle_start = time.perf_counter() if idle else cycle_end
            if self._applying:
                self._apply(self._applying)
                self._applying = []
            if not paused and engine.has_unfinished_requests():
                num_steps += 1
                if num_steps == self._inject_step_fault:
                    raise InjectedStepFault(f"fault injected into engine step {num_steps}")
                step_start = time.perf_counter()
                outputs = engine.step()
                step_s = time.perf_counter() - step_start
                self._refresh_snapshot()  # before the outputs, so a client never sees older state
                self._dispatch(outputs)
                cycle_end = time.perf_counter()
                if self._trace is not None and engine.last_schedule is not None:
                    self._write_trace(TracedStep(cycle_start - trace_start, cycle_end - cycle_start, step_s,
                                                 idle, StepShape.of(engine.last_schedule)))
            else:
                cycle_end = time.perf_counter()

    def _fail_everything(self) -> None:
        """The loop has ended: fail every command not yet answered and end every open stream (engine thread)."""
        with self._cond:
            self._stopped = True
            pending = self._applying + list(self._commands)
            self._applying = []
            self._commands.clear()
        if self._error is None:
            err: EngineDeadError = EngineShutdownError("the engine was shut down: the server is stopping")
            try:  # free every request's blocks, so a stopped engine holds none
                if self.engine is not None:
                    self.engine.abort(self.engine.scheduler.unfinished_request_ids())
            except Exception:  # noqa: BLE001 - the streams must still be ended below
                logger.exception("aborting the requests of a stopped engine failed")
        else:
            err = EngineDeadError(f"the engine loop stopped: {self._error}")
        for command in pending:
            future = getattr(command, "future", None)
            if future is not None and not future.done() and \
                    (future.running() or future.set_running_or_notify_cancel()):
                future.set_exception(err)
        for stream in list(self._streams.values()):
            self._post(stream, err)
        self._streams.clear()
        if self._trace is not None:
            self._trace.close()

    def _write_trace(self, step: TracedStep) -> None:
        """Append a trace line; a failing trace (disk full...) is dropped with a warning, serving goes on."""
        try:
            self._trace.write(step)
        except OSError as e:
            logger.warning("step trace stopped: %s", e)
            self._trace.close()
            self._trace = None

    def _apply(self, commands: list[Command]) -> None:
        """Apply queued commands in order (engine thread). A command that raises fails alone: its caller gets
        the exception (a ``ValueError`` is the client's fault, anything else ours) and the loop goes on."""
        num_adds = 0
        for command in commands:
            if isinstance(command, AddCommand):
                num_adds += 1
                self._apply_add(command)
            elif isinstance(command, AbortCommand):
                self.engine.abort(command.request_ids)
                for rid in command.request_ids:
                    stream = self._streams.pop(rid, None)
                    if stream is not None:
                        self._post(stream, _END)
            elif command.future.set_running_or_notify_cancel():
                try:
                    command.future.set_result(command.fn(self.engine))
                except Exception as e:  # noqa: BLE001 - handed to the caller
                    command.future.set_exception(e)
        self._refresh_snapshot(num_adds)

    def _apply_add(self, command: AddCommand) -> None:
        if not command.future.set_running_or_notify_cancel():
            return  # the caller gave up before the engine saw it
        try:
            self.engine.add_request(command.prompt, command.params, request_id=command.request_id,
                                    arrival_time=command.arrival_time, priority=command.priority,
                                    cache_salt=command.cache_salt)
        except Exception as e:  # noqa: BLE001 - this request alone fails (C19)
            if not isinstance(e, ValueError):
                logger.exception("adding request %s failed", command.request_id)
            command.future.set_exception(e)
            return
        self._streams[command.request_id] = command.stream
        command.future.set_result(None)

    def _dispatch(self, outputs: list[RequestOutput]) -> None:
        """Hand a step's outputs to their streams: one ``call_soon_threadsafe`` per event loop."""
        by_loop: dict[asyncio.AbstractEventLoop, list[tuple[RequestStream, Any]]] = {}
        for out in outputs:
            stream = self._streams.get(out.request_id)
            if stream is None:
                continue
            if out.finished:
                del self._streams[out.request_id]
            by_loop.setdefault(stream.loop, []).append((stream, out))
        for loop, items in by_loop.items():
            try:
                loop.call_soon_threadsafe(_deliver, items)
            except RuntimeError:  # the loop is closed: nobody is listening any more
                self.engine.abort([s.request_id for s, _ in items])

    def _post(self, stream: RequestStream, item: Any) -> None:
        try:
            stream.loop.call_soon_threadsafe(stream._put, item)
        except RuntimeError:
            pass

    def _refresh_snapshot(self, num_applied_adds: int = 0) -> None:
        sched = self.engine.scheduler
        kv = sched.kv_cache_manager
        tokens_waiting = sum(r.num_tokens - r.num_computed_tokens for r in sched.waiting)
        tokens_waiting += sum(max(0, r.num_prompt_tokens - r.num_computed_tokens) for r in sched.running)
        snap = EngineSnapshot(num_running=sched.num_running, num_waiting=sched.num_waiting,
                              num_tokens_waiting=tokens_waiting, kv_cache_usage=kv.usage,
                              num_preemptions_total=sched.num_preemptions_total,
                              prefix_cache_queries=kv.prefix_cache_queries, prefix_cache_hits=kv.prefix_cache_hits)
        with self._cond:
            self._snapshot = snap
            self._num_pending_adds -= num_applied_adds


def _deliver(items: list[tuple[RequestStream, Any]]) -> None:
    for stream, item in items:
        stream._put(item)
