"""The batching baselines of :class:`~goodserve.scheduler.scheduler.Scheduler` (``SchedulerConfig.mode``),
for comparison in the simulator and the benchmarks; ``chunked`` (continuous batching with chunked prefill)
is the scheduler's own flow.

* ``static``: request-level batching; a batch runs to completion before the next is admitted (pre-Orca).
* ``reserve``: the ``chunked`` flow, but admission allocates blocks for prompt + ``max_tokens`` up front,
  as systems without paging reserve the maximum length (Orca's "Max" baseline in PagedAttention §6). It
  never preempts. Prefix caching is off: a reserved block would be registered before its K/V is written.
* ``prefill-first``: unchunked, prefill-prioritising batching (vLLM v0): a waiting prompt is admitted only
  whole, and a step that admits prompts schedules no decodes. The first prompt of a step may exceed the
  token budget so that prompts longer than ``max_num_batched_tokens`` can run.
"""

from __future__ import annotations

from goodserve.config import SchedulerConfig
from goodserve.request import Request
from goodserve.scheduler.output import SchedulerOutput
from goodserve.scheduler.policy import NO_TRIAGE
from goodserve.scheduler.queue import RequestQueue


class BaselineModesMixin:
    """The baseline modes' admission rules (and the scheduler's ``_begin_step``, ``_admit`` and
    ``_schedule_running``)."""

    scheduler_config: SchedulerConfig
    waiting: RequestQueue
    running: list[Request]

    def _schedule_prefill_first(self, out: SchedulerOutput, now: float) -> None:
        """``prefill-first``: admit whole prompts; only a step that admitted none runs the decodes.

        Running requests are all decoding (their prompts ran whole), so the running pass gives each one
        token, preempting from the tail when blocks run out.
        """
        self._begin_step(now, NO_TRIAGE)
        config = self.scheduler_config
        budget = config.max_num_batched_tokens
        while budget > 0 and self.waiting and len(self.running) < config.max_num_seqs:
            # The step's first prompt may exceed the budget, or a long prompt could never run.
            cap = budget if out.scheduled else max(budget, config.max_model_len)
            n = self._admit(out, cap, now, whole=True)
            if n is None:
                break
            budget -= n
        if not out.scheduled:
            self._schedule_running(out, config.max_num_batched_tokens)

    def _admit_static_batch(self, out: SchedulerOutput, budget: int, now: float) -> None:
        """``static``: admit up to ``max_num_seqs`` requests at once, only once the last batch is done.

        Requests beyond the step's token budget join the batch with no tokens this step; the running pass
        gives them their prefill chunks in the next steps.
        """
        if self.running:
            return
        while self.waiting and len(self.running) < self.scheduler_config.max_num_seqs:
            n = self._admit(out, budget, now)
            if n is None:
                break
            budget -= n

    def _slots_to_allocate(self, req: Request, num_hit: int, n: int) -> int:
        """New slots an admission allocates beyond the prefix hit: the step's ``n`` tokens, or under
        ``reserve`` every slot up to prompt + ``max_tokens``, so the request never needs another block."""
        if self.scheduler_config.mode == "reserve":
            return max(n, req.num_prompt_tokens + req.max_tokens - num_hit)
        return n
