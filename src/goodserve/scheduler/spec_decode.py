"""Where the scheduler calls speculative decoding (:mod:`goodserve.spec.speculator`): a decode row verifies
the drafts waiting on its request; after a step that samples, the runner is asked for the next drafts; once
the step is back, what was accepted is counted and the slots of rejected drafts are freed.
"""

from __future__ import annotations

from typing import Optional, Sequence

from goodserve.kv_cache.manager import KVCacheManager
from goodserve.request import Request
from goodserve.scheduler.output import SampledToken, SchedulerOutput
from goodserve.scheduler.queue import RequestQueue
from goodserve.scheduler.runner_diffs import RunnerDiffs
from goodserve.scheduler.step_time import StepTimeModel
from goodserve.spec.config import SpeculativeConfig
from goodserve.spec.speculator import Speculator


def make_speculator(config: Optional[SpeculativeConfig], model: StepTimeModel) -> Optional[Speculator]:
    """The scheduler's speculator (``None`` without speculation)."""
    return None if config is None else Speculator(config, model)


class SpecDecodeMixin:
    """Speculation hooks of the scheduler (a no-op without a speculator)."""

    speculator: Optional[Speculator]
    kv_cache_manager: KVCacheManager
    running: list[Request]
    waiting: RequestQueue
    _runner: RunnerDiffs

    def _prompt_backlog(self, budget: int, seats: int) -> tuple[int, int]:
        """``(prompt tokens, room)``: the prompt tokens the step may compute beside its decodes (what running
        requests have left to prefill and the prompts of as many waiting requests as there are ``seats``
        left under ``max_num_seqs``, within the ``room`` of the ``budget`` the decodes leave, which their
        drafts share); what ``auto`` speculation prices the step's time against
        (:meth:`goodserve.spec.speculator.Speculator.begin_step`). A waiting request without a seat is no
        prompt the step could compute: counted, ``auto`` at a full batch priced its drafts against prompt
        tokens they displaced from no step, and verified none."""
        left = decodes = 0
        for r in self.running:
            n = r.num_tokens - r.num_computed_tokens
            if n == 1:
                decodes += 1
            else:
                left += n
        room = max(0, budget - decodes)
        for r in self.waiting:  # a long queue is read only as far as the budget and the seats reach
            if left >= room or seats <= 0:
                break
            left += r.num_tokens - r.num_computed_tokens
            seats -= 1
        return min(left, room), room

    def _drafts(self, req: Request, room: int) -> list[int]:
        """The drafts a decode row verifies this step, within ``room`` tokens of budget."""
        return self.speculator.drafts(req, room) if self.speculator is not None else []

    def _record(self, out: SchedulerOutput, req: Request, num_computed: int, n: int,
                spec_token_ids: Sequence[int] = ()) -> None:
        """Add a request's share of the step (with the drafts it verifies, and under speculation how many the
        runner should propose after a step that samples)."""
        lookahead = 0
        if self.speculator is not None and num_computed + n - len(spec_token_ids) == req.num_tokens:
            lookahead = self.speculator.lookahead(req)
        self._runner.record(out, req, self.kv_cache_manager, num_computed, n, spec_token_ids, lookahead)

    def _verified(self, req: Request, num_spec: int, token: SampledToken) -> None:
        """After a step that sampled ``req``: count what its ``num_spec`` drafts gave, keep the drafts proposed
        for its next step, and free the slots of rejected ones (if it goes on)."""
        if num_spec:
            self.speculator.record(num_spec, len(token.accepted))
        if req.is_finished:
            return
        req.spec_token_ids = token.spec_token_ids
        self.speculator.proposed(req)
        if num_spec:
            kept = self.kv_cache_manager.trim(req, req.num_tokens)
            if kept is not None:
                self._runner.trimmed(req.request_id, kept)
