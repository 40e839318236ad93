"""The simulator's events, each named after what happens in the serving system at that instant.

An event only knows its time and what it is about; :meth:`Event.apply` hands it to the matching method
of the :class:`~goodserve.sim.simulator.Simulator`, which changes the state and queues later events.
Events of the same instant are applied in the order they were queued (the queue breaks ties by a
sequence number), and steps start only once every event of that instant has been applied.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from goodserve.scheduler.output import SchedulerOutput

if TYPE_CHECKING:  # pragma: no cover
    from goodserve.sim.simulator import Instance, Simulator


@dataclass
class Event:
    """Something that happens at ``time`` (seconds since the simulation started)."""

    time: float

    def apply(self, sim: "Simulator") -> None:
        raise NotImplementedError


@dataclass
class RequestArrival(Event):
    """A client sends request number ``index`` of the workload; the router picks an instance."""

    index: int

    def apply(self, sim: "Simulator") -> None:
        sim.on_request_arrival(self)


@dataclass
class StepEnd(Event):
    """``instance`` finishes computing ``output``: sampled tokens appear, finished requests leave."""

    instance: "Instance"
    output: SchedulerOutput
    start: float  # when the step started (seconds)

    def apply(self, sim: "Simulator") -> None:
        sim.on_step_end(self)


@dataclass
class KVTransferDone(Event):
    """A prefilled request's KV cache has crossed the link to decode instance ``instance``."""

    request_id: str
    instance: "Instance"
    nbytes: int = 0
    seconds: float = 0.0

    def apply(self, sim: "Simulator") -> None:
        sim.on_kv_transfer_done(self)
