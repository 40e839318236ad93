"""The scheduling-policy seam: what a policy decides, and the named points where the scheduler asks it.

The scheduler owns the mechanism (token budget, KV blocks, preemption, the running and waiting lists, every
write to a :class:`Request`); a :class:`StepPolicy` owns the judgement, and is asked only here:

* **queue order**: :meth:`StepPolicy.make_queue` builds the waiting queue, and
  :attr:`StepPolicy.running_key`, if set, keeps the running list sorted as requests are admitted;
* **arrival**: :meth:`StepPolicy.check_arrival` may refuse a request as it comes
  (:class:`SLOUnattainableError`);
* **triage**: :meth:`StepPolicy.triage` names, before a step, the requests that are now late (the scheduler
  sheds them or queues them last), the urgent ones, and the decodes that sit the step out;
* **plan**: :meth:`StepPolicy.plan` fixes the step's figures in one frozen :class:`StepPlan` (the running
  order whose tail is the preemption victim, and whatever the policy's chunk and admission rules read);
* **chunk size** and **admission**: :meth:`StepPolicy.chunk_size` and :meth:`StepPolicy.may_admit`, given the
  plan and the :class:`StepTally` of the step built so far (sglang's ``PrefillAdder`` holds one step's
  budget the same way).

Every call is a pure function of its arguments, the requests and the policy's step-time model: a policy
writes nothing, so the order of the calls inside a step is not load-bearing. ``fcfs`` and ``priority``
are here; ``slo`` is :mod:`goodserve.scheduler.slo`. A new policy is one new file with one
:class:`StepPolicy` subclass, named in :func:`create_policy`.
"""

from __future__ import annotations

import math
from abc import ABC
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Mapping, Optional, Sequence

from goodserve.request import Request
from goodserve.scheduler.queue import FCFSQueue, RequestQueue, SortedQueue


class SLOUnattainableError(Exception):
    """A request's TTFT SLO cannot be met with the work queued ahead of it (the server answers 429)."""


def chunk_pairs(n: int, num_computed: int) -> int:
    """Causal query-key pairs of ``n`` new tokens after ``num_computed`` cached ones (see ``StepShape``)."""
    return n * num_computed + n * (n + 1) // 2


class StepTally:
    """The step being built: its tokens, sampled tokens and attention pairs, and whether it holds a prompt
    chunk. The scheduler adds what it schedules; a policy only reads it."""

    def __init__(self, tokens: int = 0, sampled: int = 0, pairs: int = 0) -> None:
        self.tokens, self.sampled, self.pairs = tokens, sampled, pairs
        self.prefill_scheduled = False

    def add(self, n: int, num_computed: int, sample: bool) -> None:
        """Count ``n`` tokens after ``num_computed`` cached ones (a decode is ``n = 1``)."""
        self.tokens += n
        self.sampled += int(sample)
        self.pairs += chunk_pairs(n, num_computed)

    def add_chunk(self, n: int, num_computed: int, sample: bool) -> None:
        """Count a prompt chunk (or a recompute) scheduled in this step."""
        self.add(n, num_computed, sample)
        self.prefill_scheduled = True


@dataclass(frozen=True)
class Triage:
    """A policy's verdict on the requests short of their first token, before a step.

    Attributes:
        late: ``(request, reason)`` for each request that can no longer meet its TTFT SLO: shed under
            ``shed_load`` (the reason is its error), else queued behind the others.
        urgent: Ids of prompts whose TTFT needs more than the plain step limit.
        deferred: Ids of decodes that sit this step out for a prompt's TTFT.
    """

    late: tuple[tuple[Request, str], ...] = ()
    urgent: frozenset[str] = frozenset()
    deferred: frozenset[str] = frozenset()


NO_TRIAGE = Triage()


@dataclass(frozen=True)
class StepPlan:
    """A policy's figures for one step, fixed before any request is scheduled in it.

    Attributes:
        triage: The triage this plan was made after.
        rank: Sort key of each running request by id (``None``: keep the running list in admission order).
            The scheduler sorts the running list by it: the tail is the first preemption victim.
        decodes: The decodes the step holds before any chunk: ``(tokens, sampled, pairs)``.
    """

    triage: Triage = NO_TRIAGE
    rank: Optional[Mapping[str, Any]] = None
    decodes: tuple[int, int, int] = (0, 0, 0)

    @property
    def deferred(self) -> frozenset[str]:
        """Ids of the decodes that sit this step out."""
        return self.triage.deferred

    @property
    def max_step_s(self) -> float:
        """The longest step this plan allows, seconds (infinite: no limit); speculation stays within it."""
        return math.inf

    def tally(self) -> StepTally:
        """A fresh tally of this step, holding its decodes."""
        return StepTally(*self.decodes)


class StepPolicy(ABC):
    """A scheduling policy (see the module docstring). The defaults are first-come-first-served's: no
    refusals, no triage, every chunk as large as the budget allows, every admission the blocks allow."""

    name = "fcfs"
    #: Sort key of the running list, kept as requests are admitted (the tail is the first preemption victim);
    #: ``None``: admission order, unless a plan's ``rank`` reorders it.
    running_key: Optional[Callable[[Request], Any]] = None

    def make_queue(self) -> RequestQueue:
        """The waiting queue, in this policy's admission order."""
        return FCFSQueue()

    def check_arrival(self, request: Request, waiting: Iterable[Request], running: Sequence[Request],
                      now: float) -> None:
        """Refuse a request as it arrives (before it is queued).

        Raises:
            SLOUnattainableError: if the policy refuses it.
        """

    def triage(self, waiting: Sequence[Request], running: Sequence[Request], now: float) -> Triage:
        """The step's :class:`Triage`, before anything is scheduled."""
        return NO_TRIAGE

    def plan(self, running: Sequence[Request], now: float, triage: Triage = NO_TRIAGE) -> StepPlan:
        """The step's :class:`StepPlan`, once the triage's verdicts are applied (late requests shed or
        marked)."""
        return StepPlan(triage)

    def chunk_size(self, plan: StepPlan, tally: StepTally, request: Request, num_computed: int, n: int,
                   sample: bool) -> int:
        """The prefill chunk ``request`` gets, at most the ``n`` tokens the budget leaves it (0: none in this
        step)."""
        return n

    def may_admit(self, plan: StepPlan, request: Request, running: Sequence[Request]) -> bool:
        """Whether the head of the waiting queue may be admitted beside ``running``."""
        return True


class FCFSPolicy(StepPolicy):
    """First come, first served: arrival order; a preempted request resumes first."""


class PriorityPolicy(StepPolicy):
    """Lower ``priority`` first, then arrival; the running list is kept in the same order, so the preemption
    victim is the lowest-priority, latest request."""

    name = "priority"

    @staticmethod
    def running_key(request: Request) -> tuple[int, float]:
        return request.priority, request.arrival_time

    def make_queue(self) -> RequestQueue:
        return SortedQueue(self.running_key)


def create_policy(name: str, step_model: Any, max_num_batched_tokens: int, block_size: int,
                  shed_load: bool = False) -> StepPolicy:
    """The policy ``name`` (``SchedulerConfig.policy``), for a scheduler with these step limits and this
    online step-time model (:class:`goodserve.scheduler.step_time.StepTimeModel`).

    Raises:
        ValueError: on an unknown name.
    """
    if name == "fcfs":
        return FCFSPolicy()
    if name == "priority":
        return PriorityPolicy()
    if name == "slo":
        from goodserve.scheduler.slo import SLOPolicy

        return SLOPolicy(step_model, max_num_batched_tokens, block_size, shed_load)
    raise ValueError(f"unknown scheduling policy {name!r}; expected 'fcfs', 'priority' or 'slo'")

