"""Acceptance by a row's last verification: the rates ``auto`` prices each request's drafts at.

A request's drafts are accepted at a rate of its own, and that rate holds from one step to the next: on the
code-copy workload a row whose previous verification accepted every draft had its next first draft accepted
more than twice as often as one whose previous verification accepted none, and one request's drafts at 5%,
another's at 100% (BENCHMARKS.md, "Speculative decoding: lengths per request"). Priced at the engine-wide
rates, ``auto`` verified drafts for every row or for none: it took the rows that copy their context for rows
that do not, and under load chose none where a fixed ``k = 4`` emitted more. So a row is priced by the class
of its last verification (none, some or all of its drafts accepted), each class with its own
recency-weighted rates per position, shrunk toward the engine-wide rates (:data:`CLASS_PRIOR_ROWS`), and
``auto`` chooses a length per class (:func:`goodserve.spec.length.choose_lengths`).

A row without a verification, or whose last one is more than :data:`OUTCOME_TOKENS` tokens old, is priced at
the engine-wide rates. Its drafts are then verified whenever they would have been without classes, and that
verification sorts it: a row kept out of speculation by its class comes back to the engine-wide rates after
:data:`OUTCOME_TOKENS` tokens, so no class keeps its rows from ever being measured again.
"""

from __future__ import annotations

from goodserve.request import Request
from goodserve.spec.length import CHOICE_Z, DECAY, PROBE_Z, AcceptanceStats, wilson

#: A row without a recent verification (priced at the engine-wide rates), and the classes of a
#: verification: no draft accepted, some, every one.
FRESH, NONE, SOME, ALL = 0, 1, 2, 3
NUM_CLASSES = 4
#: Tokens after which a row's last verification no longer classes it (the row is fresh again).
OUTCOME_TOKENS = 16
#: The engine-wide rates' weight in a class's estimate, in rows (at most what they were measured over).
CLASS_PRIOR_ROWS = 8.0


def row_class(req: Request, emitted: int = 0) -> int:
    """The class ``req``'s drafts are priced by: its last verification's, or :data:`FRESH`; before the last
    ``emitted`` of its output tokens."""
    outcome = req.spec_outcome
    if outcome is None or req.num_output_tokens - emitted - outcome[1] > OUTCOME_TOKENS:
        return FRESH
    return outcome[0]


class ClassStats:
    """Acceptance per position for each class of a row's last verification, estimated as
    :class:`~goodserve.spec.length.AcceptanceStats` does for all rows, each position shrunk toward the
    engine-wide estimate with ``min(CLASS_PRIOR_ROWS, rows it was measured over)`` pseudo-rows.

    Args:
        k_max: The most drafts a row verifies.
    """

    def __init__(self, k_max: int) -> None:
        self._reached = [[0.0] * k_max for _ in range(NUM_CLASSES)]
        self._accepted = [[0.0] * k_max for _ in range(NUM_CLASSES)]

    def record(self, req: Request, num_drafts: int, num_accepted: int) -> None:
        """``req`` verified ``num_drafts`` drafts and accepted the first ``num_accepted`` (its output tokens
        already hold them and the token sampled after them): count them under the class it was verified in,
        and class it by this verification from now on."""
        if num_drafts <= 0:
            return
        cls = row_class(req, emitted=num_accepted + 1)
        if cls != FRESH:
            reached, accepted = self._reached[cls], self._accepted[cls]
            for i in range(len(reached)):
                reached[i] *= DECAY
                accepted[i] *= DECAY
            for i in range(min(num_drafts, num_accepted + 1)):
                reached[i] += 1.0
                accepted[i] += i < num_accepted
        after = ALL if num_accepted >= num_drafts else (NONE if num_accepted == 0 else SOME)
        req.spec_outcome = (after, req.num_output_tokens)

    def lower_rates(self, cls: int, overall: AcceptanceStats, z: float = CHOICE_Z) -> list[float]:
        """The lower end of Wilson's interval of each position's rate for rows of ``cls``, shrunk toward the
        engine-wide statistics ``overall`` (for :data:`FRESH`, theirs)."""
        return self.bounds(cls, overall, -z)

    def upper_rates(self, cls: int, overall: AcceptanceStats, z: float = PROBE_Z) -> list[float]:
        """The upper end (see :meth:`lower_rates`)."""
        return self.bounds(cls, overall, z)

    def bounds(self, cls: int, overall: AcceptanceStats, z: float) -> list[float]:
        """The end at ``z`` standard deviations (see :meth:`lower_rates`)."""
        if cls == FRESH:
            return overall.bounds(z)
        prior, rows = overall.rates(), overall.rows()
        out = []
        for a, r, p, n in zip(self._accepted[cls], self._reached[cls], prior, rows):
            weight = min(CLASS_PRIOR_ROWS, n)
            out.append(wilson((a + weight * p) / (r + weight), r + weight, z))
        return out

