"""How many draft tokens a step verifies: acceptance statistics, and the length chosen for goodput.

A decode step is bandwidth-bound (the weights are read once whatever the rows), so verifying ``k`` drafts
costs little more than one token while the batch is small, and each accepted draft is a token for free.
As the batch grows the step turns compute-bound and every draft token lengthens the step for everyone:
past some load any fixed ``k`` costs more than it returns (SmartSpec, Liu et al. 2024, "Optimizing
Speculative Decoding for Serving LLMs Using Goodput", §3). So ``auto`` chooses ``k`` each step from the
online step-time model and the measured acceptance rates: of the ``k`` (0 included) keeping the most rows within
their TPOT SLOs, the one maximising expected tokens per second, ``B · E[tokens | k] / T(B, k)``, each token valued
at its cost beside a prompt chunk (:func:`choose_length`).
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass
from typing import Optional, Sequence

import numpy as np

from goodserve.scheduler.policy import chunk_pairs
from goodserve.scheduler.step_time import StepTimeModel

#: Weight of the past in the acceptance estimate, per verified row (a half-life of ~350 rows).
DECAY = 0.998
#: Prior of the first position's acceptance rate, as pseudo-counts ``(accepted, verified)``: 0.5 until
#: measured. Each later position's prior is the estimate of the position before it, with the same weight
#: (:meth:`AcceptanceStats.rates`).
PRIOR = (1.0, 2.0)
#: Standard deviations of the acceptance rates' upper bound a probe is judged by
#: (:meth:`AcceptanceStats.upper_rates`).
PROBE_Z = 2.0
#: Standard deviations of the lower bound a length is chosen by (:func:`choose_length`; BENCHMARKS.md,
#: "Speculative decoding on the AVX-512 host", the lower-bound runs).
CHOICE_Z = 1.0


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
        """``α_i`` for ``i = 1..k_max`` (index 0 is the first draft).

        Each position's estimate is shrunk toward the one before it (a prior of ``PRIOR[1]`` pseudo-rows at
        ``α_{i-1}``; the first toward 0.5): a position no row has verified yet is priced like the last one
        measured. With a fixed prior instead, ``auto`` never lengthens: a draft at an unmeasured position
        is priced at 0.5, so it is not verified, so it stays unmeasured (docs/speculation.md).
        """
        prior, weight = PRIOR[0] / PRIOR[1], PRIOR[1]
        out = []
        for a, r in zip(self._accepted, self._reached):
            prior = (a + weight * prior) / (r + weight)
            out.append(prior)
        return out

    def upper_rates(self, z: float = PROBE_Z) -> list[float]:
        """An upper confidence bound of each ``α_i``: the Wilson score interval's upper end (Wilson 1927) at
        ``z`` standard deviations, around :meth:`rates` over its ``verified + PRIOR[1]`` rows. A probe is
        judged by it (:meth:`goodserve.spec.speculator.Speculator.begin_step`): acceptance is measured only
        by verifying drafts, so a rate estimated from a few rows must not keep the drafts that would correct
        it from being verified (BENCHMARKS.md, "Speculative decoding on the AMD host"), while a rate measured
        over many rows bounds close to itself."""
        return self._wilson(z)

    def lower_rates(self, z: float = CHOICE_Z) -> list[float]:
        """The Wilson score interval's lower end of each ``α_i`` at ``z`` standard deviations (see
        :meth:`upper_rates`): what :func:`choose_length` prices drafts by."""
        return self._wilson(-z)

    def _wilson(self, z: float) -> list[float]:
        out = []
        for p, r in zip(self.rates(), self._reached):
            n = r + PRIOR[1]
            centre = p + z * z / (2 * n)
            spread = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n))
            out.append(min(1.0, max(0.0, (centre + spread) / (1 + z * z / n))))
        return out

    @staticmethod
    def expected_tokens(rates: Sequence[float], k: int) -> float:
        """Expected tokens a row emits verifying ``k`` drafts: ``1 + Σ_{j<=k} Π_{i<=j} α_i`` (the bonus token
        always comes)."""
        total, run = 1.0, 1.0
        for alpha in rates[:k]:
            run *= alpha
            total += run
        return total


#: Weight of the past in :class:`DraftCost`, per step that verified drafts (a half-life of ~35 steps).
COST_DECAY = 0.98
#: Ridge of :meth:`DraftCost.costs` on (fixed, per row, per draft, per token read again), each a fraction of its
#: feature's sum of squares: what the steps do not tell apart is put on the drafts and runs (see there).
COST_RIDGE = np.array([0.05, 0.05, 1e-6, 1e-6])


def extra_runs(k: int, run_positions: Optional[int]) -> int:
    """Attention runs beyond the first that a row of ``1 + k`` positions takes, where a run holds at most
    ``run_positions`` of a row's positions (``None``: any number)."""
    return 0 if run_positions is None else -(-(k + 1) // run_positions) - 1


def reread_ktokens(k: int, run_positions: Optional[int], contexts: Sequence[int]) -> float:
    """Thousands of context tokens that rows of ``contexts`` tokens each, verifying ``k`` drafts, attend again
    in their runs beyond the first (:func:`extra_runs`)."""
    return extra_runs(k, run_positions) * sum(contexts) / 1000


class DraftCost:
    """What verifying drafts adds to a step, learned from the steps that verified drafts: seconds once per
    step that verifies any, per row that verifies any, per draft, and per thousand tokens of context that
    attention runs beyond a row's first attend again.

    The last: where the attention kernel takes a row's positions in runs of a few (the AMX kernel, 16 query
    rows a tile: ``16 // (heads per KV head)`` positions a run, :func:`extra_runs`), each further run
    attends the row's whole context again, at a cost that grows with the context: the draft that opens a run
    can cost what the drafts before it did together (BENCHMARKS.md, "Speculative decoding: drafts beside a
    prompt chunk").

    A draft position has the figures of a decode row (a token computed and sampled, attending over its
    context) but not its cost: it rides in a row that is scheduled, attended and sampled anyway. But a row
    with drafts is computed as a chunk, not as a lone decode token (another kernel path), at a cost of its
    own, and a step of a few decodes runs on a faster path than one with drafts (the one-call decode step):
    verifying at all can cost a step a fixed time, the first draft of a row more than each further one
    (docs/speculation.md has the figures). So under ``auto`` the step-time model is fitted on the steps
    without drafts, and this model holds the rest:
    ``measured − predicted without drafts = fixed + per_row · rows verifying + per_draft · drafts +
    per_reread · thousands of tokens read again``, by least squares over the steps with drafts,
    recency-weighted (:data:`COST_DECAY`), the four coefficients non-negative
    (:meth:`goodserve.spec.speculator.Speculator.observe`). Without the fixed term, the change of path at one
    row priced each draft at several times what it cost at ten rows, and ``auto`` verified none there. The
    speculator keeps one for steps of decodes alone and one for steps with a prompt chunk, which run on other
    paths (:func:`step_seconds`).
    """

    def __init__(self) -> None:
        self._xtx = np.zeros((4, 4))  # decayed: Σ x xᵀ over x = (1, rows verifying, drafts, context read again)
        self._xty = np.zeros(4)  # decayed: Σ x · excess seconds
        self.num_steps = 0
        self._costs: Optional[tuple[float, float, float, float]] = None  # the fit, until the next step

    def observe(self, predicted_without: float, seconds: float, num_rows: int, num_drafts: int,
                reread_ktokens: float = 0.0) -> None:
        """A step in which ``num_rows`` rows verified ``num_drafts`` drafts, their attention runs beyond the first
        attending ``reread_ktokens`` thousand tokens of context again (:func:`reread_ktokens`), took
        ``seconds``; without them it was predicted to take ``predicted_without``."""
        if num_drafts <= 0:
            return
        x = np.array([1.0, num_rows, num_drafts, reread_ktokens])
        self._xtx = COST_DECAY * self._xtx + np.outer(x, x)
        self._xty = COST_DECAY * self._xty + x * (seconds - predicted_without)
        self.num_steps += 1
        self._costs = None

    def costs(self) -> Optional[tuple[float, float, float, float]]:
        """``(seconds per step verifying, per row verifying, per draft, per thousand tokens read again)``, ``None``
        before any step verified a draft. Where the steps seen do not tell them apart (one batch, every row verifying
        the same number of drafts), a ridge (:data:`COST_RIDGE`) puts the excess on the drafts: a choice of fewer
        drafts a row then measures a per-row or fixed cost that there is, while an excess put on the rows or the step
        would keep ``auto`` at the one length it was measured at (fewer drafts looking no cheaper; split evenly,
        ``auto`` under load stayed at 8 drafts a row where a fixed k = 4 emitted more: BENCHMARKS.md, "Speculative
        decoding: drafts beside a prompt chunk"). A run no step has taken costs nothing until one does (no data, no
        cost: a longer choice then measures it). The ridge grows with the data (a fraction of each feature's sum of
        squares), so it also moves a fit the steps do tell apart, by more the closer they come to one shape
        (``tests/test_speculation.py`` bounds it on three steps)."""
        if not self.num_steps:
            return None
        if self._costs is None:  # asked for several times a step, changed only by observe
            self._costs = nonnegative_solve(self._xtx + np.diag(COST_RIDGE * np.diag(self._xtx)), self._xty)
        return self._costs


def nonnegative_solve(a: np.ndarray, b: np.ndarray) -> tuple[float, ...]:
    """The ``θ >= 0`` minimising ``θᵀ a θ - 2 θᵀ b`` (least squares from its normal equations, ``a`` positive
    definite): the unconstrained minimum on each support, the best of those that are non-negative (the
    minimum lies on one: Lawson & Hanson 1974, ch. 23; the supports of ``n`` coefficients are ``2^n - 1``)."""
    n = len(b)
    best, best_value = np.zeros(n), 0.0
    for support in itertools.product((False, True), repeat=n):
        idx = [i for i in range(n) if support[i]]
        if not idx:
            continue
        try:
            part = np.linalg.solve(a[np.ix_(idx, idx)], b[idx])
        except np.linalg.LinAlgError:  # singular on this support: the others decide
            continue
        if (part < 0).any():
            continue
        theta = np.zeros(n)
        theta[idx] = part
        value = theta @ a @ theta - 2 * theta @ b
        if value < best_value:
            best, best_value = theta, value
    return tuple(float(v) for v in best)


def step_seconds(model: StepTimeModel, contexts: Sequence[int], k: int, costs: Optional[Sequence[float]],
                 prompt_tokens: int = 0, beside: Optional[Sequence[float]] = None,
                 run_positions: Optional[int] = None) -> float:
    """Predicted seconds of a step of decode rows (``contexts``: each one's computed tokens) verifying ``k``
    drafts each, beside ``prompt_tokens`` of prompt chunks: the model's step without the drafts plus what
    :class:`DraftCost` adds for ``B`` rows verifying ``B k`` drafts, learned on steps of the same kind: of
    decodes alone (``costs``), or with a prompt chunk (``beside``): ``(fixed, per row, per draft, per
    thousand tokens of context read again)`` (:meth:`DraftCost.costs`), the runs of ``run_positions`` positions
    (:func:`reread_ktokens`), and for a draft model a fifth, per pass of the draft (``k`` a step:
    :meth:`goodserve.spec.propose_cost.ProposeCost.priced`). Before any draft was measured, the model's step of
    ``B (k + 1)`` positions (and the chunks).

    Measured drafts are not capped at a decode row's cost: where plain decodes run on a faster path than rows
    with drafts (the one-call decode step), a draft costs more than a decode row. Capped, ``auto`` priced
    rows with drafts below what they took and verified drafts under load, where they lengthened every step
    (BENCHMARKS.md, "Speculative decoding on the AVX-512 host"). The two kinds of step are learned apart
    because neither prices the other: ``costs`` hold the change from the one-call decode step to the chunk
    path, which a step with a chunk does not make (priced so, ``auto`` verified no draft beside a chunk on the
    AMD host), and the model prices a draft as a decode row's attention and sampling, where in a row's run of
    positions it reads the row's context once (priced so, ``auto`` verified no draft beside a chunk on the
    AMX host; BENCHMARKS.md, "Speculative decoding: drafts beside a prompt chunk"). Until a step with a chunk
    has measured them, a draft beside a chunk is priced at the cheaper of the model's price and ``costs``
    without their fixed term, so that such a step verifies drafts and measures them."""
    reread = reread_ktokens(k, run_positions, contexts)
    if prompt_tokens <= 0:
        return _priced(model, contexts, k, costs, 0, reread)
    if beside is not None:
        return _priced(model, contexts, k, beside, prompt_tokens, reread)
    guess = _priced(model, contexts, k, None, prompt_tokens, reread)
    if costs is None:
        return guess
    return min(guess, _priced(model, contexts, k, (0.0, *costs[1:]), prompt_tokens, reread))


def _priced(model: StepTimeModel, contexts: Sequence[int], k: int, costs: Optional[Sequence[float]],
            prompt_tokens: int, reread: float) -> float:
    """The model's step of the decodes and chunks plus ``costs`` for the drafts; without ``costs``, the model's
    step with each draft as one more decode position (see :func:`step_seconds`)."""
    rows = len(contexts)
    per_row = k + 1 if costs is None else 1
    pairs = sum(chunk_pairs(per_row, c) for c in contexts) + chunk_pairs(prompt_tokens, 0)
    base = model.predict(rows * per_row + prompt_tokens, rows * per_row, pairs)
    if costs is None or k == 0:
        return base
    fixed, per_row, per_draft, per_reread = costs[:4]
    per_pass = costs[4] if len(costs) > 4 else 0.0  # a draft model's passes (ProposeCost.priced)
    return base + fixed + rows * per_row + rows * k * per_draft + reread * per_reread + k * per_pass


def decode_token_value(model: StepTimeModel, contexts: Sequence[int]) -> float:
    """What a decode token is worth, in the seconds it costs on the step-time model beyond a step's fixed
    overhead: the mean cost of a plain decode row of ``contexts`` (computed, sampled, attended). A step's time
    beyond the work it does is overhead that speculation amortises (the weights read once whatever the
    rows)."""
    idle = model.predict(0, 0, 0)
    return max((step_seconds(model, contexts, 0, None) - idle) / max(1, len(contexts)), 1e-9)


def prompt_value(model: StepTimeModel, prompt_tokens: int) -> float:
    """What ``prompt_tokens`` of prompt chunks are worth: the seconds they add to an empty step on the
    step-time model (with the prefill terms)."""
    if prompt_tokens <= 0:
        return 0.0
    return max(step_seconds(model, [], 0, None, prompt_tokens) - model.predict(0, 0, 0), 0.0)


def chunk_beside(prompt_tokens: int, room: Optional[int], rows: int, k: int) -> int:
    """The prompt tokens a step computes beside ``rows`` decode rows verifying ``k`` drafts each, where drafts
    and prompt chunks share the ``room`` the decodes leave of the token budget (``None``: no limit)."""
    return prompt_tokens if room is None else max(0, min(prompt_tokens, room - rows * k))


@dataclass(frozen=True)
class TPOTBound:
    """A decode row's TPOT SLO as a bound on the seconds of the step being built, by the tokens it emits.

    With ``k`` tokens streamed since its first at ``F``, a row that emits ``t`` tokens this step, and ``t`` in
    each later step of ``L`` seconds until it ends ``R >= t`` tokens from now, ends at ``TPOT = (now + T +
    (R - t) / t · L - F) / (k + R - 1)``: within its SLO ``s`` for every step time ``T`` up to
    ``F + s (k + R - 1) - now - (R - t) L / t = a + s (t - 1) + (R - t) (s - L / t)``, with ``a = F + s k - now``.
    Where its length is not certain, the bound must hold at every ``R`` it may reach: it is linear in ``R``,
    so at the fewest tokens it is certain to emit (or ``t``, if more) while ``L / t <= s`` (later steps gain it
    time) and at the most it may emit while ``L / t > s`` (each later step loses it some).

    Later steps emit what this one does: a row that keeps its SLO only by verifying drafts keeps it only if
    later steps verify them too, and ``auto`` chooses them there by the same rule; so they take what those
    drafts add to a step too, ``L + D`` (:meth:`seconds`). Held to ``L`` alone, a row a burst had put behind
    its SLO looked kept by drafts however dear: with a draft model under load, ``auto`` chose drafts priced at
    many times a step without them (BENCHMARKS.md, "Speculative decoding with a draft model under load"). At
    ``t = 1`` and a certain
    length this is the ``slo`` policy's allowance over ``R`` tokens
    (:meth:`goodserve.scheduler.slo_pace.SLOPredictor.allowance`, without its margin); held to later steps of
    one token each, a row slowed by a burst of long prompt steps (``L > s``) was lost at every ``k``, and
    ``auto`` verified no drafts where a fixed k = 4 kept such rows in their SLO (BENCHMARKS.md, "Speculative
    decoding: TPOT bounds over the rest of a request").

    Attributes:
        banked: ``a = F + s k - now``, seconds (what the next step may take if the row ends with it).
        slo: ``s``, seconds a token.
        left: The output tokens the row is certain to emit from its next one on (at least 1;
            :meth:`~goodserve.scheduler.slo_pace.SLOPredictor.certain_tokens`). Where ``t`` is more, the
            row is taken to end with this step (``R = t``).
        later: ``L``, seconds a later step takes without drafts.
        most: The most output tokens it may emit from its next one on (``None``: no limit).
        speculates: Whether the row verifies drafts (``t = 1`` whatever the step's length otherwise).
    """

    banked: float
    slo: float
    left: int = 1
    later: float = 0.0
    most: Optional[int] = None
    speculates: bool = True

    def seconds(self, tokens: float, drafts: float = 0.0) -> float:
        """The longest step that keeps the row within its SLO if it emits ``tokens`` tokens (expected; at most
        ``most``: its drafts stop there, :meth:`goodserve.spec.speculator.Speculator.drafts`), each later step
        taking ``drafts`` seconds more than ``later`` (what the drafts that emit them add to a step)."""
        t = tokens if self.speculates else 1.0
        later = self.later + drafts if self.speculates else self.later
        if self.most is not None:
            t = max(1.0, min(t, float(self.most)))
        gain = self.slo - later / t  # what each later token gains the row (seconds; negative: loses)
        ends = self.left if gain >= 0 else self.most  # the length at which the bound binds
        if ends is None:
            return -math.inf
        return self.banked + self.slo * (t - 1) + max(ends - t, 0.0) * gain


def kept(bounds: Sequence[TPOTBound], seconds: float, tokens: float, drafts: float = 0.0) -> int:
    """How many rows of ``bounds`` a step of ``seconds`` expected to emit ``tokens`` tokens a row keeps within
    their TPOT SLOs, later steps taking ``drafts`` seconds more (:meth:`TPOTBound.seconds`)."""
    return sum(seconds <= b.seconds(tokens, drafts) for b in bounds)


def choose_length(model: StepTimeModel, stats: AcceptanceStats, contexts: Sequence[int], k_max: int,
                  limit: float = math.inf, costs: Optional[Sequence[float]] = None,
                  prompt_tokens: int = 0, room: Optional[int] = None,
                  bounds: Sequence[TPOTBound] = (), beside: Optional[Sequence[float]] = None,
                  run_positions: Optional[int] = None, rates: Optional[Sequence[float]] = None) -> int:
    """The number of drafts per decode row that keeps the most rows within their TPOT SLOs and, of those,
    maximises the step's work per second.

    The work of a step is its tokens, each valued at what it costs on the step-time model: ``rate = (B ·
    E[tokens | k] · d + p(C_k)) / T(B, k, C_k)``, with ``d`` the seconds of a plain decode row
    (:func:`decode_token_value`) and ``p`` those of the ``C_k`` prompt tokens the step computes beside the
    decodes (:func:`prompt_value`). Drafts and prompt chunks share the token budget the decodes leave
    (``room``), so ``C_k = min(C, room - B k)``: a draft verified while prompts wait takes a prompt token's
    place. Without a prompt chunk this is SmartSpec's tokens per second (Liu et al. 2024, §3): drafts pay
    while the step's fixed cost dominates, and ``k`` falls to 0 as the batch turns the step compute-bound.
    Beside a prompt chunk the step is mostly work already, so a draft is verified only if it is expected to
    earn more decode time than it adds or displaces: while prompts wait, drafts that cost a decode row's time
    do not pay (that time is taken from the queue, and TTFT grows), drafts cheaper than a decode row can
    still pay. Prompt tokens are not counted as one token each: a chunk computes many cheaply, and so counted
    they would price every draft out of any step with a prompt chunk.

    ``bounds``: for each decode row streaming under a TPOT SLO, the longest step that keeps its TPOT average
    in its SLO by the tokens the step emits (:class:`TPOTBound`). The choice is taken among the ``k`` with
    ``T(B, k, C_k)`` within the bounds of the most rows at ``E[tokens | k]``, each later step taking what ``k``
    drafts a row add to a step of the decodes alone: a step slowed by a prompt chunk
    past a row's bound speculates to keep its TPOT (each accepted draft is a token the row does not wait a
    later step for), while a row ahead of its SLO lends the step the time it banked. Where no ``k`` keeps
    any row, the rate alone decides.

    Args:
        model: The online step-time model (a step of ``B`` rows verifying ``k`` drafts each computes and samples
            ``B (k + 1)`` positions and attends ``Σ chunk_pairs(k + 1, c)`` pairs).
        stats: The measured acceptance rates, read at their lower bounds (:meth:`AcceptanceStats.lower_rates`:
            the ``k`` whose estimated rate is highest is the one whose estimate erred up most, and the later
            positions are measured on the fewest rows).
        contexts: Each decode row's computed tokens ``c``.
        k_max: The most drafts per row.
        limit: The longest step allowed (seconds; the scheduling policy's): longer choices are not taken.
        costs: What verifying adds to a step of decodes alone, per step, row, draft and thousand tokens of
            context read again by a row's further attention runs (:meth:`DraftCost.costs` of such steps); a step
            is priced by :func:`step_seconds`.
        beside: The same, learned on steps with a prompt chunk.
        run_positions: The most positions of a row one attention run holds (``None``: any number).
        prompt_tokens: Prompt tokens ``C`` the step may compute beside the decodes (the scheduler's backlog
            within the token budget).
        room: Tokens of the step's budget the decodes leave, shared by drafts and prompt chunks (``None``: no
            limit).
        bounds: The TPOT bound of each row under a TPOT SLO (none: no constraint).
        rates: The acceptance rate at each position to price drafts at (default: ``stats``' lower bounds).

    Returns:
        ``k`` in ``[0, k_max]``; 0 without decode rows.
    """
    rows = len(contexts)
    if rows == 0 or k_max <= 0:
        return 0
    rates = stats.lower_rates() if rates is None else rates
    per_decode = decode_token_value(model, contexts)
    alone = step_seconds(model, contexts, 0, costs) if bounds else 0.0  # a later step, of these decodes alone
    best, score = 0, (-1, -1.0)  # the k with the most rows kept, then the highest rate
    for k in range(k_max + 1):
        chunk = chunk_beside(prompt_tokens, room, rows, k)
        seconds = step_seconds(model, contexts, k, costs, chunk, beside, run_positions)
        if k > 0 and seconds > limit:
            break
        tokens = stats.expected_tokens(rates, k)
        rate = (rows * tokens * per_decode + prompt_value(model, chunk)) / max(seconds, 1e-9)
        drafts = step_seconds(model, contexts, k, costs, run_positions=run_positions) - alone if k and bounds else 0.0
        this = (kept(bounds, seconds, tokens, drafts), rate)
        if this > score:
            best, score = k, this
    return best
