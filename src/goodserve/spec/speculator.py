"""The scheduler's side of speculative decoding: how many draft tokens each decode row verifies in a step,
how many the runner proposes after it, and what was accepted.

Drafts are proposed on the runner's side after a step (:mod:`goodserve.runner.speculative`), come back with
the sampled token, and wait on the :class:`~goodserve.request.Request` for the next step; there the
scheduler gives a decode row ``1 + k`` tokens (its last token and ``k`` drafts), which the runner verifies
in one pass of the model, like a prefill chunk. Rejected drafts' slots are freed by the scheduler once the
step is back.
"""

from __future__ import annotations

import math
from typing import Sequence

from goodserve.request import Request
from goodserve.scheduler.step_time import StepTimeModel
from goodserve.spec.config import SpeculativeConfig
from goodserve.spec.length import AcceptanceStats, choose_length

#: Steps ``auto`` chooses no drafts for before one step verifies a draft per row, so the step-time model sees
#: what a longer step costs (a 1-in-17 probe: at most ~6% more tokens under load).
EXPLORE_EVERY = 16


class Speculator:
    """Speculation length and statistics for one scheduler.

    Args:
        config: The engine's speculative config.
        model: The scheduler's online step-time model (``auto`` length prices steps with it).
    """

    def __init__(self, config: SpeculativeConfig, model: StepTimeModel) -> None:
        self.config = config
        self.model = model
        self.k_max = config.num_speculative_tokens
        self.stats = AcceptanceStats(self.k_max)
        self.length = 0  # drafts per row chosen for the step being built
        self._steps_at_zero = 0  # consecutive steps auto chose no drafts for

    @staticmethod
    def eligible(req: Request) -> bool:
        """Whether ``req`` speculates: not under a grammar (its matcher would have to advance over drafts
        that may be rejected; constrained requests decode a token a step)."""
        return req.sampling_params.structured_outputs is None

    def begin_step(self, running: Sequence[Request], limit: float = math.inf) -> None:
        """Choose the step's length: the fixed one, or under ``auto`` the one maximising expected tokens per
        second over the eligible decode rows (:func:`~goodserve.spec.length.choose_length`), keeping the
        step within ``limit`` seconds."""
        if self.config.length != "auto":
            self.length = self.config.length
            return
        contexts = [r.num_computed_tokens for r in running
                    if r.num_tokens - r.num_computed_tokens == 1 and self.eligible(r)]
        self.length = choose_length(self.model, self.stats, contexts, self.k_max, limit)
        # Explore: the step-time model learns what a longer step costs only from steps it saw, and a machine
        # on which auto never verified a draft cannot learn that drafts are cheap (a lone decode is
        # bandwidth-bound). So after EXPLORE_EVERY steps at 0, a step verifies one draft per row (drafts are
        # asked for the step before).
        self._steps_at_zero = self._steps_at_zero + 1 if self.length == 0 and contexts else 0
        if self._steps_at_zero > EXPLORE_EVERY:
            self.length, self._steps_at_zero = 1, 0

    def drafts(self, req: Request, room: int) -> list[int]:
        """The drafts ``req`` verifies this step: at most the step's length and ``room`` tokens of budget."""
        if not self.eligible(req) or room <= 0:
            return []
        return req.spec_token_ids[:min(self.length, room)]

    def lookahead(self, req: Request) -> int:
        """Drafts the runner should propose for ``req`` after this step: one more than this step verifies
        (so ``auto`` can lengthen), at most ``k_max``; none while speculation does not pay, but for the step
        before an exploring one."""
        if not self.eligible(req):
            return 0
        if self.length == 0:
            return 1 if self.config.length == "auto" and self._steps_at_zero == EXPLORE_EVERY else 0
        return min(self.k_max, self.length + (self.config.length == "auto"))

    def record(self, num_drafts: int, num_accepted: int) -> None:
        """One row verified ``num_drafts`` drafts and accepted the first ``num_accepted``."""
        self.stats.record(num_drafts, num_accepted)

    def stats_fields(self) -> dict:
        """The counters, as :class:`~goodserve.scheduler.output.SchedulerStats` fields."""
        s = self.stats
        return dict(num_spec_drafts_total=s.num_drafts, num_spec_draft_tokens_total=s.num_draft_tokens,
                    num_spec_accepted_tokens_total=s.num_accepted_tokens,
                    spec_accepted_per_pos=tuple(s.accepted_per_pos), spec_length=self.length)
