"""The scheduler's side of a policy's triage (:meth:`goodserve.scheduler.policy.StepPolicy.triage`): late
requests shed under ``shed_load`` or queued behind the others, and decodes that sat a step out for a prompt's
TTFT counted, or scheduled after all if no prompt got a chunk. The policy decides; the scheduler, the only
writer of a :class:`Request`, applies.
"""

from __future__ import annotations

import dataclasses

from goodserve.config import SchedulerConfig
from goodserve.kv_cache.manager import KVCacheManager
from goodserve.request import Request, RequestStatus
from goodserve.scheduler.output import EngineCoreOutput, SchedulerOutput
from goodserve.scheduler.policy import StepPlan, StepTally, Triage
from goodserve.scheduler.queue import RequestQueue


class TriageMixin:
    """Triage hooks of the scheduler (and its ``_finish``, ``_record`` and ``_schedule_running``)."""

    scheduler_config: SchedulerConfig
    kv_cache_manager: KVCacheManager
    waiting: RequestQueue
    running: list[Request]
    plan: StepPlan
    _tally: StepTally
    _shed_outputs: list[EngineCoreOutput]
    num_shed_total: int
    num_deferred_decodes_total: int

    def _apply_triage(self, triage: Triage, now: float) -> None:
        """The policy's late requests: shed under ``shed_load`` (their outputs go out with the next
        :meth:`update_from_output`), else put behind the others (waiting ones to the back of the queue,
        running ones still prefilling to the back of the chunk order)."""
        for req, reason in triage.late:
            if self.scheduler_config.shed_load:
                self._finish(req, RequestStatus.FINISHED_SHED)
                self.num_shed_total += 1
                self._shed_outputs.append(EngineCoreOutput.of(req, [], now, error=reason))
            elif req.status == RequestStatus.RUNNING:
                req.slo_late = True
            else:
                self.waiting.remove(req)
                req.slo_late = True
                self.waiting.add(req)

    def _end_deferral(self, out: SchedulerOutput, budget: int) -> None:
        """Count the decodes that sat out this step, or, if no prompt got a chunk after all (no free blocks,
        the admission stop, ``max_num_seqs``), schedule them in this step."""
        deferred = [r for r in self.running if r.request_id in self.plan.deferred]
        if self._tally.prefill_scheduled:
            self.num_deferred_decodes_total += len(deferred)
            return
        self.plan = dataclasses.replace(self.plan, triage=dataclasses.replace(self.plan.triage, deferred=frozenset()))
        for req in deferred:
            if budget <= 0 or self.kv_cache_manager.allocate_slots(req, 1) is None:
                break
            self._record(out, req, req.num_computed_tokens, 1)
            budget -= 1
        if not out.scheduled:  # not even a decode's block: the running pass, preempting as it does
            self._schedule_running(out, self.scheduler_config.max_num_batched_tokens)
