"""What a draft model's passes cost, measured where they run rather than inferred from a step's time.

A draft model proposes ``k`` drafts a row in ``k`` passes of its own over the rows asked: ``seconds = per_pass · k +
per_draft · Σ drafts``. The runner times those passes (apart from its catch-up on context it had not read), so
the fit needs no step-time model. Learned as part of what a step with drafts took beyond its prediction
(:class:`~goodserve.spec.length.DraftCost`), the passes of a probe's one row in a large batch were smaller than
the prediction's error: their cost was fitted as nothing, ``auto`` chose the most drafts for every row, and the
draft's catch-up on them stalled a step for seconds (BENCHMARKS.md, "Speculative decoding with a draft model
under load").
"""

from __future__ import annotations

from typing import Optional, Sequence

import numpy as np

from goodserve.spec.length import COST_DECAY, nonnegative_solve

#: Ridge on (per pass, per draft), a fraction of each feature's sum of squares. Where the proposals seen do not
#: tell them apart (one row asked: a draft a pass), it puts what they share on the drafts: priced so, many rows'
#: drafts look dearer than they are, and ``auto`` stays off them until proposals for several rows are measured,
#: where on the passes they would look nearly free.
PROPOSE_RIDGE = np.array([0.05, 1e-6])


class ProposeCost:
    """Seconds of a draft model's proposals by the passes (the most drafts asked of a row) and the drafts asked,
    by least squares, recency-weighted (:data:`~goodserve.spec.length.COST_DECAY`), both coefficients
    non-negative."""

    def __init__(self) -> None:
        self._xtx = np.zeros((2, 2))  # decayed: Σ x xᵀ over x = (passes, drafts)
        self._xty = np.zeros(2)  # decayed: Σ x · seconds
        self.num_steps = 0

    def observe(self, seconds: float, lookaheads: Sequence[int]) -> None:
        """The draft proposed for rows asked ``lookaheads`` drafts each (after one step) in ``seconds`` (without
        its catch-up)."""
        asked = [n for n in lookaheads if n > 0]
        if not asked:
            return
        x = np.array([float(max(asked)), float(sum(asked))])
        self._xtx = COST_DECAY * self._xtx + np.outer(x, x)
        self._xty = COST_DECAY * self._xty + x * max(seconds, 0.0)
        self.num_steps += 1

    def costs(self) -> Optional[tuple[float, float]]:
        """``(seconds per pass, seconds per draft)``, ``None`` before any proposal was measured."""
        if not self.num_steps:
            return None
        return nonnegative_solve(self._xtx + np.diag(PROPOSE_RIDGE * np.diag(self._xtx)), self._xty)

    @staticmethod
    def priced(verifying: Optional[Sequence[float]], proposing: Optional[tuple[float, float]],
               per_token_s: float) -> Optional[tuple[float, ...]]:
        """The cost tuple of :func:`~goodserve.spec.length.step_seconds` for drafts that cost ``verifying`` in the
        target's step (:meth:`~goodserve.spec.length.DraftCost.costs`: fixed, per row, per draft, per thousand
        tokens read again) and ``proposing`` in the draft's passes: ``(fixed, per row, per draft + proposing's
        per draft, per thousand read again, per pass)``. Verifying not yet measured is priced at ``per_token_s`` a
        draft, a prompt token's price on the step-time model."""
        if proposing is None:
            return None if verifying is None else tuple(verifying)
        fixed, per_row, per_draft, per_reread = verifying if verifying is not None else (0.0, 0.0, per_token_s, 0.0)
        return fixed, per_row, per_draft + proposing[1], per_reread, proposing[0]
