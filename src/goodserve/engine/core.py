"""The engine core: the scheduler and the model runner, stepping on plain messages.

Everything that crosses its edge is plain data: a :class:`Request` comes in, :class:`EngineCoreOutput`\\ s
(new tokens, finish reasons, logprobs, timestamps) and a :class:`SchedulerStats` record go out, and inside,
the scheduler talks to the runner only through :class:`SchedulerOutput` messages. This is where a process
boundary can go (vLLM v1 runs its engine core in a process of its own): tokenisation, detokenisation, stop
strings and the server stay on the other side, in :class:`goodserve.engine.engine.Engine`.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any, Iterable, Optional

import torch

from goodserve.config import EngineConfig
from goodserve.kv_events.events import InstanceLoad
from goodserve.kv_transfer.base import KVConnectorWorker
from goodserve.kv_transfer.factory import create_kv_connector
from goodserve.kv_transfer.params import KVTransferParams
from goodserve.request import Request, RequestStatus
from goodserve.runner.model_runner import ModelRunner
from goodserve.scheduler.output import EngineCoreOutput, SchedulerOutput, SchedulerStats
from goodserve.scheduler.scheduler import Scheduler
from goodserve.scheduler.step_time import StepTimeModel


@dataclass
class CoreStep:
    """What one :meth:`EngineCore.step` did.

    Attributes:
        outputs: A result for every request that sampled a token or finished (shed ones included).
        schedule: The step the model computed, or ``None`` if nothing was scheduled (only KV pulls or
            finished requests to report).
    """

    outputs: list[EngineCoreOutput]
    schedule: Optional[SchedulerOutput]


class EngineCore:
    """Scheduler + model runner.

    Args:
        config: The resolved engine config.
        weights: HF-named weights for the runner.
        structured_output: Compiles the grammars of requests with structured outputs (``None``: such
            requests fail).
        step_model: The scheduler's online step-time model (a fresh one when ``None``).
        draft: The loaded draft model of ``draft_model`` speculation (``None``: none).
    """

    def __init__(self, config: EngineConfig, weights: dict[str, torch.Tensor],
                 structured_output: Optional[Any] = None, step_model: Optional[StepTimeModel] = None,
                 draft: Optional[Any] = None) -> None:
        self.runner = ModelRunner(config, weights, structured_output=structured_output, draft=draft)
        self.kv_connector: Optional[KVConnectorWorker] = None  # the connector's worker half
        kv_scheduler = None
        if config.kv_transfer is not None:
            kv_scheduler, self.kv_connector = create_kv_connector(config.kv_transfer, config.cache.block_size,
                                                                  self.runner.kv_caches)
        self.scheduler = Scheduler(config.scheduler, config.cache, step_model, kv_connector=kv_scheduler,
                                   speculative=config.speculative)
        if self.scheduler.speculator is not None:
            self.scheduler.speculator.run_positions = self.runner.attention_run_positions()
        self.kv_events: Optional[Any] = None  # a ZmqEventPublisher: publishes the prefix cache's changes
        if config.kv_events is not None and config.kv_events.enabled:
            from goodserve.kv_events.publisher import ZmqEventPublisher  # pyzmq: the server extra's

            self.kv_events = ZmqEventPublisher(config.kv_events)
            self.kv_events.publish((), InstanceLoad.of(self.scheduler))  # batch 0: subscribers learn the life
        # (step, start, end, seconds it spent proposing drafts and of them catching up) of the step not yet observed
        self._last_step: Optional[tuple[SchedulerOutput, float, float, float, float]] = None
        self._cold = True  # no step has run yet: the first one pays for cold caches and lazily built kernels

    def add_request(self, request: Request) -> None:
        """Queue a request (see :meth:`Scheduler.add_request` for the ``ValueError``\\ s)."""
        self.scheduler.add_request(request)

    def finish_requests(self, request_ids: Iterable[str], status: RequestStatus) -> list[str]:
        """Finish requests from outside (abort, stop string, failed output processing); frees their blocks."""
        finished = self.scheduler.finish_requests(list(request_ids), status)
        self.publish_kv_events()
        return finished

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished_requests()

    def step(self) -> CoreStep:
        """Schedule, execute and update once.

        Each step's time goes to the scheduler's step-time model one step late: when the loop went straight
        on to the next step, the time from one step's start to the next one's, so the work the engine does
        between steps (output processing, the server's hand-off) counts as requests see it; after an idle
        gap, the step alone. The engine's first step is not observed: it pays once for cold caches and
        lazily built kernels (4.1 s for a 1,024-token prefill on this CPU, where the next one took 0.45 s),
        and a model that learned it would predict every prefill ten times too long.

        Returns:
            What it did: the results, and the step computed (``None`` if none).

        Raises:
            RuntimeError: if requests are pending but nothing could be scheduled (a broken invariant).
            Exception: whatever the forward pass raises (a fault of the engine).
        """
        start = time.monotonic()
        if self._last_step is not None:
            prev, prev_start, prev_end, proposing, catching_up = self._last_step
            back_to_back = start - prev_end < prev_end - prev_start
            self.scheduler.observe_step_time(prev, (start if back_to_back else prev_end) - prev_start, proposing,
                                             catching_up)
            self._last_step = None
        sched = self.scheduler.schedule(start)
        if self.kv_connector is not None:
            if sched.kv_cancels:
                self.kv_connector.cancel_loads(sched.kv_cancels)
            if sched.kv_loads:
                self.kv_connector.start_loads(sched.kv_loads)
        sampled = self.runner.execute(sched)  # also when empty: the runner drops finished requests' state
        kv_output = self.kv_connector.poll() if self.kv_connector is not None else None
        if sched.is_empty:
            transfers = self.scheduler.has_pending_kv_transfers()  # a pull that ends here is scheduled next
            # Shed requests, pulls that ended.
            outputs = self.scheduler.update_from_output(sched, sampled, time.monotonic(), kv_output)
            if self.scheduler.has_unfinished_requests() and not transfers:
                raise RuntimeError("requests are pending but the scheduler scheduled nothing")
            self.publish_kv_events()
            return CoreStep(outputs, None)
        outputs = self.scheduler.update_from_output(sched, sampled, time.monotonic(), kv_output)
        if self._cold:
            self._cold = False
        else:
            self._last_step = (sched, start, time.monotonic(), self.runner.propose_seconds,
                               self.runner.catch_up_seconds)
        self.publish_kv_events()
        return CoreStep(outputs, sched)

    def publish_kv_events(self) -> None:
        """Hand the prefix cache's changes since the last call, and the load, to the KV event publisher (if
        any; it sends them from its own thread)."""
        if self.kv_events is not None:
            events = self.kv_events
            changes = self.scheduler.kv_cache_manager.take_kv_events()
            if changes or events.load_due():
                events.publish(changes, InstanceLoad.of(self.scheduler))

    def close(self) -> None:
        """Close the KV connector and the KV event publisher, if any."""
        if self.kv_events is not None:
            self.kv_events.close()
            self.kv_events = None
        if self.kv_connector is not None:
            self.kv_connector.close()
            self.kv_connector = None

    def release_kv_hold(self, params: KVTransferParams) -> bool:
        """Producer: free the blocks a handle holds at once (see :meth:`Scheduler.release_kv_hold`)."""
        released = self.scheduler.release_kv_hold(params, time.monotonic())
        self.publish_kv_events()
        return released

    def make_stats(self) -> SchedulerStats:
        """The scheduler's state (see :class:`SchedulerStats`)."""
        return self.scheduler.make_stats()

    def reset_prefix_cache(self) -> None:
        """Forget every cached block hash (e.g. between benchmark runs); blocks in use stay allocated."""
        self.scheduler.kv_cache_manager.reset_prefix_cache()
        self.publish_kv_events()

    def check_integrity(self) -> None:
        """Check the KV pool's invariants (raises ``RuntimeError`` naming the first one broken)."""
        self.scheduler.kv_cache_manager.check_integrity()
