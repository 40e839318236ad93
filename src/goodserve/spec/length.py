"""How many draft tokens a step verifies: acceptance statistics, and the length chosen for goodput.

A decode step is bandwidth-bound (the weights are read once whatever the rows), so verifying ``k`` drafts
costs little more than one token while the batch is small, and each accepted draft is a token for free.
As the batch grows the step turns compute-bound and every draft token lengthens the step for everyone:
past some load any fixed ``k`` costs more than it returns (SmartSpec, Liu et al. 2024, "Optimizing
Speculative Decoding for Serving LLMs Using Goodput", §3). So ``auto`` chooses ``k`` each step from the
online step-time model and the measured acceptance rates: the ``k`` maximising expected tokens per second,
``B · E[tokens | k] / T(B, k)``, 0 included.
"""

from __future__ import annotations

import math
from typing import Sequence

from goodserve.scheduler.policy import chunk_pairs
from goodserve.scheduler.step_time import StepTimeModel

#: Weight of the past in the acceptance estimate, per verified row (a half-life of ~350 rows).
DECAY = 0.998
#: Prior of each position's acceptance rate, as pseudo-counts ``(accepted, verified)``: 0.5 until measured.
PRIOR = (1.0, 2.0)


class AcceptanceStats:
    """Drafts verified and accepted, per position (vLLM's ``spec_decode`` counters), and a recency-weighted
    estimate of each position's conditional acceptance rate ``α_i = P(draft i accepted | drafts before it
    accepted)``.

    Args:
        k_max: The most drafts a row verifies.
    """

    def __init__(self, k_max: int) -> None:
        self.k_max = k_max
        self.num_drafts = 0  # rows that verified at least one draft
        self.num_draft_tokens = 0
        self.num_accepted_tokens = 0
        self.accepted_per_pos = [0] * k_max  # rows whose draft i was accepted
        self._reached = [0.0] * k_max  # decayed: rows that verified draft i with drafts < i accepted
        self._accepted = [0.0] * k_max  # decayed: ... and accepted it

    def record(self, num_drafts: int, num_accepted: int) -> None:
        """One row verified ``num_drafts`` drafts and accepted the first ``num_accepted``."""
        if num_drafts <= 0:
            return
        self.num_drafts += 1
        self.num_draft_tokens += num_drafts
        self.num_accepted_tokens += num_accepted
        for i in range(self.k_max):
            self._reached[i] *= DECAY
            self._accepted[i] *= DECAY
        for i in range(min(num_drafts, num_accepted + 1)):  # positions reached: the accepted ones and the miss
            self._reached[i] += 1.0
            if i < num_accepted:
                self._accepted[i] += 1.0
                self.accepted_per_pos[i] += 1

    def rates(self) -> list[float]:
        """``α_i`` for ``i = 1..k_max`` (index 0 is the first draft)."""
        a0, n0 = PRIOR
        return [(a + a0) / (r + n0) for a, r in zip(self._accepted, self._reached)]

    @staticmethod
    def expected_tokens(rates: Sequence[float], k: int) -> float:
        """Expected tokens a row emits verifying ``k`` drafts: ``1 + Σ_{j<=k} Π_{i<=j} α_i`` (the bonus token
        always comes)."""
        total, run = 1.0, 1.0
        for alpha in rates[:k]:
            run *= alpha
            total += run
        return total


def choose_length(model: StepTimeModel, stats: AcceptanceStats, contexts: Sequence[int], k_max: int,
                  limit: float = math.inf) -> int:
    """The number of drafts per decode row that maximises expected tokens per second this step.

    Args:
        model: The online step-time model (a step of ``B`` rows verifying ``k`` drafts each computes and samples
            ``B (k + 1)`` positions and attends ``Σ chunk_pairs(k + 1, c)`` pairs).
        stats: The measured acceptance rates.
        contexts: Each decode row's computed tokens ``c``.
        k_max: The most drafts per row.
        limit: The longest step allowed (seconds; e.g. a TPOT budget): longer choices are not taken.

    Returns:
        ``k`` in ``[0, k_max]``; 0 without decode rows.
    """
    rows = len(contexts)
    if rows == 0 or k_max <= 0:
        return 0
    rates = stats.rates()
    best_k, best = 0, -1.0
    for k in range(k_max + 1):
        pairs = sum(chunk_pairs(k + 1, c) for c in contexts)
        seconds = model.predict(rows * (k + 1), rows * (k + 1), pairs)
        if k > 0 and seconds > limit:
            break
        rate = rows * stats.expected_tokens(rates, k) / max(seconds, 1e-9)
        if rate > best:
            best_k, best = k, rate
    return best_k
