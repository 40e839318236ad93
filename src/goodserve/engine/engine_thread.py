"""The engine thread of :class:`~goodserve.engine.async_engine.AsyncEngine`: the only code that touches the
:class:`Engine`.

It sleeps until a command arrives or requests are pending, applies queued commands (adds, aborts, calls) in
order, steps the engine, and hands each step's outputs to the requests' streams on their event loops. One
request whose command raises fails alone; if anything else raises, the loop dies: every command and stream
in flight gets an :class:`EngineDeadError` at once and ``on_dead`` is called, so the server can exit for
its supervisor to restart it. A requested shutdown aborts what is left (freeing its KV blocks) and ends the
streams with :class:`EngineShutdownError`.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import threading
import time
from collections import deque
from typing import Any, Callable, Optional

from goodserve.engine.async_types import (AbortCommand, AddCommand, Command, EngineDeadError, EngineShutdownError,
                                          InjectedStepFault, RequestStream, STREAM_END)
from goodserve.engine.engine import Engine
from goodserve.engine.step_trace import StepTraceWriter, TracedStep
from goodserve.outputs import RequestOutput
from goodserve.scheduler.output import SchedulerStats, StepShape
from goodserve.scheduler.policy import SLOUnattainableError

logger = logging.getLogger(__name__)

#: Seconds between polls of the KV connector while nothing but KV transfers is pending (disaggregated serving).
KV_POLL_INTERVAL = 0.001


class EngineThread:
    """Owns the engine and its thread.

    Args:
        engine: A built engine, or ``None`` with ``build``.
        build: Builds the engine on the engine thread (then ``on_built`` receives it).
        on_built: Called on the engine thread with the engine once it is built.
        step_trace: Write a line per step to this file (see :mod:`goodserve.engine.step_trace`).
        on_dead: Called once, on the engine thread, with the exception if the loop dies.
        inject_step_fault: Make engine step number ``N`` (1-based) raise :class:`InjectedStepFault`.

    Raises:
        OSError: if ``step_trace`` cannot be opened.
    """

    def __init__(self, engine: Optional[Engine], build: Optional[Callable[[], Engine]],
                 on_built: Callable[[Engine], None], step_trace: Optional[str] = None,
                 on_dead: Optional[Callable[[BaseException], None]] = None,
                 inject_step_fault: Optional[int] = None) -> None:
        self.engine = engine
        self._build, self._on_built = build, on_built
        self._built: concurrent.futures.Future = concurrent.futures.Future()
        if engine is not None:
            self._built.set_result(None)
        self._on_dead = on_dead
        self._inject_step_fault = inject_step_fault
        self._cond = threading.Condition()
        self._commands: deque[Command] = deque()  # guarded by _cond
        self._applying: list[Command] = []  # taken off the queue, being applied (engine thread)
        self._num_pending_adds = 0  # add commands queued, not yet applied; guarded by _cond
        self._streams: dict[str, RequestStream] = {}  # only the engine thread touches it
        self._stats = SchedulerStats.idle()
        self._paused = False
        self._stopped = False
        self._error: Optional[BaseException] = None
        self._trace = StepTraceWriter(step_trace) if step_trace else None
        self._thread = threading.Thread(target=self._run, name="goodserve-engine", daemon=True)

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

    def is_stopped(self) -> bool:
        """Whether the loop was shut down or died (commands are refused)."""
        return self._stopped or self._error is not None

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
    def stats(self) -> SchedulerStats:
        """The scheduler's state after the latest step or command batch (read by ``/metrics`` and admission)."""
        return self._stats

    def num_waiting_total(self) -> int:
        """Requests waiting in the scheduler plus adds not yet applied (for admission control)."""
        with self._cond:
            return self._stats.num_waiting + self._num_pending_adds

    # --------------------------------------------------------------------------------------- requests

    def submit(self, command: Command) -> None:
        """Queue a command for the engine thread.

        Raises:
            EngineDeadError: if the loop is not running.
        """
        with self._cond:
            if self._error is not None:
                raise EngineDeadError(f"the engine loop is not running: {self._error}")
            if self._stopped:
                raise EngineShutdownError("the engine was shut down: the server is stopping")
            self._commands.append(command)
            if isinstance(command, AddCommand):
                self._num_pending_adds += 1
            self._cond.notify_all()

    # ---------------------------------------------------------------------------------- engine thread

    def _run(self) -> None:
        try:
            if self._build is not None:
                try:
                    self.engine = self._build()
                    self._on_built(self.engine)
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
            with self._cond:
                self._error, self._stopped = e, True
        finally:
            try:
                self._fail_everything()
                if self.engine is not None:
                    self.engine.close()
            finally:
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
                    if not self._paused and engine.has_pending_kv_transfers():
                        self._cond.wait(KV_POLL_INTERVAL)  # then step once: the step polls the connector
                        break
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
            if not paused and (engine.has_unfinished_requests() or engine.has_pending_kv_transfers()):
                num_steps += 1
                if num_steps == self._inject_step_fault:
                    raise InjectedStepFault(f"fault injected into engine step {num_steps}")
                step_start = time.perf_counter()
                step = engine.run_step()
                step_s = time.perf_counter() - step_start
                self._refresh_stats()  # before the outputs, so a client never sees older state
                self._dispatch(step.outputs)
                if step.schedule is None and not step.outputs:  # only KV pulls in flight: do not spin
                    with self._cond:
                        if not self._commands and not self._stopped:
                            self._cond.wait(KV_POLL_INTERVAL)
                cycle_end = time.perf_counter()
                if self._trace is not None and step.schedule is not None:
                    self._write_trace(TracedStep(cycle_start - trace_start, cycle_end - cycle_start, step_s,
                                                 idle, StepShape.of(step.schedule)))
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
                    self.engine.abort_all()
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
                        self._post(stream, STREAM_END)
            elif command.future.set_running_or_notify_cancel():
                try:
                    command.future.set_result(command.fn(self.engine))
                except Exception as e:  # noqa: BLE001 - handed to the caller
                    command.future.set_exception(e)
        self._refresh_stats(num_adds)

    def _apply_add(self, command: AddCommand) -> None:
        if not command.future.set_running_or_notify_cancel():
            return  # the caller gave up before the engine saw it
        try:
            self.engine.add_request(command.prompt, command.params, request_id=command.request_id,
                                    arrival_time=command.arrival_time, options=command.options,
                                    prompt_token_ids=command.prompt_token_ids)
        except Exception as e:  # noqa: BLE001 - this request alone fails (C19)
            if not isinstance(e, (ValueError, SLOUnattainableError)):
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

    @staticmethod
    def _post(stream: RequestStream, item: Any) -> None:
        """Queue ``item`` into a stream on its event loop (a closed loop means nobody listens any more)."""
        try:
            stream.loop.call_soon_threadsafe(stream.put, item)
        except RuntimeError:
            pass

    def _refresh_stats(self, num_applied_adds: int = 0) -> None:
        stats = self.engine.make_stats()
        with self._cond:
            self._stats = stats
            self._num_pending_adds -= num_applied_adds


def _deliver(items: list[tuple[RequestStream, Any]]) -> None:
    for stream, item in items:
        stream.put(item)
