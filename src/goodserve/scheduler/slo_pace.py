"""The ``slo`` policy's predictions, as pure functions of the requests, the step-time model and the time.

:class:`SLOPredictor` answers what the rules of :mod:`goodserve.scheduler.slo` ask: how long the next step
may take with each running request's TPOT average still in its SLO (its *allowance*), how fast prompts
progress beside the running decodes (a :class:`Pace`), when a prompt would get its first token, which
prompts are late or urgent, and which decodes could sit steps out. It reads the model and the requests and
writes nothing; the figures a step is priced with (:class:`StepFigures`) are values passed along.
"""

from __future__ import annotations

import math
from bisect import bisect_left
from dataclasses import dataclass, field
from typing import Iterable, Optional, Sequence

from goodserve.request import Request
from goodserve.scheduler.policy import StepTally, chunk_pairs
from goodserve.scheduler.step_time import StepTimeModel

INF = float("inf")
MAX_BANKED_STEPS = 256  # steps of a pace's banked phase looked at (a full-budget one costs one prediction)
#: Later steps an urgent prompt may borrow against (rule 3): the decode step ``d`` a loan is priced at holds
#: only while the batch stays as it is (docs/slo.md: priced over a whole forced length, loans broke
#: interactive TPOTs as new requests joined and the decode steps grew).
BORROW_STEPS = 16


def tpot_of(req: Request) -> float:
    """``req``'s TPOT SLO in seconds, infinite if it has none."""
    return INF if req.slo_tpot is None else req.slo_tpot


def _last_true(lo: int, hi: int, pred) -> int:
    """The largest ``x`` in ``[lo, hi)`` with ``pred(x)``, for a ``pred`` true up to a point and false after it,
    given ``pred(hi)`` is false (``pred(lo)`` is not evaluated: ``lo`` is returned if nothing above it holds)."""
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if pred(mid):
            lo = mid
        else:
            hi = mid
    return lo


@dataclass(frozen=True)
class StepFigures:
    """What later steps are priced at, read from the model at a step's start.

    Attributes:
        margin: The model's margin (measured over predicted step times, a quantile).
        decode_step: Predicted seconds of a step of the running decodes alone, stretched by the margin
            (0 without decodes).
        later_step: What a later step of a decoding request is expected to take: that, or the recent mean
            step if longer (later steps hold other prompts' chunks too).
    """

    margin: float = 1.0
    decode_step: float = 0.0
    later_step: float = 0.0


@dataclass
class Pace:
    """How prompts progress while the running requests decode: the decodes every step holds; the steps that
    spend the running requests' banked TPOT time (``banked``: after each, the prompt tokens and seconds so
    far); then the prefill tokens each step with a chunk gives (``chunk``), each such step after as many
    decode-only steps as bank its excess over ``earned`` at ``earned - decode_s`` a step (none where
    ``earned <= decode_s``, the default)."""

    decodes: StepTally
    chunk: int
    banked: list[tuple[int, float]] = field(default_factory=list)
    earned: float = 0.0
    decode_s: float = 0.0


@dataclass(frozen=True)
class Assessment:
    """Rules 2 and 6 over the prompts short of their first token (:meth:`SLOPredictor.assess`).

    Attributes:
        late: The late requests, in the order judged.
        urgent: Ids of the urgent ones.
        deferred: Ids of the decodes that sit out.
        paces: The plain and borrowed paces and, if decodes are deferred, the pace of the decodes that stay.
    """

    late: list[Request]
    urgent: frozenset[str]
    deferred: frozenset[str]
    paces: tuple[Pace, ...]


class SLOPredictor:
    """The predictions of the ``slo`` policy for one scheduler (see :mod:`goodserve.scheduler.slo`).

    Args:
        model: The online step-time model.
        max_num_batched_tokens: The scheduler's token budget per step.
        block_size: Tokens per KV block (the smallest prefill chunk a step without decodes gets).
    """

    def __init__(self, model: StepTimeModel, max_num_batched_tokens: int, block_size: int) -> None:
        self.model = model
        self.max_num_batched_tokens = max_num_batched_tokens
        self.block_size = block_size

    # ----------------------------------------------------------------------------------- step figures
    def prefill_time(self, num_tokens: int) -> float:
        """Seconds of a step that only prefills ``num_tokens`` prompt tokens from scratch."""
        return self.model.predict(num_tokens, 1, chunk_pairs(num_tokens, 0))

    @staticmethod
    def decodes(running: Iterable[Request]) -> StepTally:
        """The running requests' decodes, one token each: what every step holds."""
        tally = StepTally()
        for r in running:
            if r.num_tokens - r.num_computed_tokens == 1:
                tally.add(1, r.num_computed_tokens, True)
        return tally

    def figures(self, decodes: StepTally) -> StepFigures:
        """The step's :class:`StepFigures` beside ``decodes``."""
        margin = self.model.margin
        decode_step = margin * self.model.predict(decodes.tokens, decodes.sampled, decodes.pairs) \
            if decodes.tokens else 0.0
        return StepFigures(margin, decode_step, max(decode_step, self.model.recent_step_s))

    def protectable(self, limit: float) -> float:
        """``limit``, or infinity if not even a one-token step is predicted to meet it."""
        return limit if limit == INF or self.model.predict(1, 1, 1) <= limit else INF

    def limits(self, running: Iterable[Request], fig: StepFigures, now: float) -> tuple[float, float]:
        """Rule 3: the smallest TPOT allowance of the running requests at ``now`` (infinite if none has one),
        and the same with each allowance at least its borrowed one (the borrowed limit)."""
        streaming = [r for r in running if self.streams(r)]
        allowances = [self.allowance(r, now, fig) for r in streaming]
        # No decodes running (the streaming requests are recomputing after a preemption): nothing to borrow.
        borrowed = [max(a, self.allowance(r, now, fig, later=fig.decode_step, horizon=BORROW_STEPS))
                    for r, a in zip(streaming, allowances)] if fig.decode_step > 0 else allowances
        # A request whose TPOT is lost whatever this step does cannot be saved by a shorter step.
        return (min((a for a in allowances if a > -INF), default=INF),
                min((a for a in borrowed if a > -INF), default=INF))

    # ---------------------------------------------------------------------------------- allowances
    @staticmethod
    def certain_tokens(req: Request) -> int:
        """Output tokens ``req`` is certain to produce from its next one on (at least 1): the rest of
        ``max_tokens`` when its length is forced (``ignore_eos``, no stop strings or stop ids, no grammar),
        else what ``min_tokens`` still requires."""
        p = req.sampling_params
        k = req.num_output_tokens
        if p.ignore_eos and not p.stop and not p.stop_token_ids and p.structured_outputs is None \
                and req.max_tokens is not None:
            return max(1, req.max_tokens - k)
        return max(1, p.min_tokens - k)

    @staticmethod
    def streams(req: Request) -> bool:
        """Whether ``req`` streams tokens under a TPOT SLO (its first token is out)."""
        return req.num_output_tokens > 0 and req.slo_tpot is not None and req.first_token_time is not None

    @staticmethod
    def _allowance_at(req: Request, now: float, target: float, later: float, h: int) -> float:
        """``a(h) = F + target·k - now + (h - 1)·(target - later)`` (see :meth:`allowance`)."""
        return req.first_token_time + target * req.num_output_tokens - now + (h - 1) * (target - later)

    def aimed_allowance(self, req: Request, now: float, fig: StepFigures) -> float:
        """``req``'s allowance aimed at its TPOT SLO over the margin (the first target of :meth:`allowance`),
        whether or not a decode step fits it."""
        return self._allowance_at(req, now, req.slo_tpot / fig.margin, fig.later_step, self.certain_tokens(req))

    def allowance(self, req: Request, now: float, fig: StepFigures, later: Optional[float] = None,
                  horizon: Optional[int] = None) -> float:
        """Seconds the next step may take with ``req``'s TPOT SLO still met (rule 3).

        With ``k`` tokens streamed since its first at ``F`` and each later step taking ``L``, a request that
        ends ``j`` tokens from now has ``TPOT = (now + T + (j - 1)·L - F) / (k + j - 1)``, within a target
        ``s`` for every step time ``T`` up to ``a(j) = F + s·k - now + (j - 1)·(s - L)``. ``L`` is
        ``fig.later_step``. The request surely lasts ``h`` more tokens (:meth:`certain_tokens`), so ``a(h)``
        is its allowance. The target is ``slo_tpot`` over the model's margin (under load every step spends
        what it is allowed, so the TPOT lands on its target, and step times scatter around their
        predictions), or, once even a decode step ``d`` is over that allowance, ``slo_tpot`` itself. If ``d``
        is over that too (the request is behind), the allowance is that of the earliest end
        ``j <= max_tokens - k`` which decode-only steps reach in time, ``F + slo_tpot·k - now + (j - 1)·(slo_tpot
        - d)``, or ``-inf`` if there is none (its TPOT is lost whatever this step does).

        ``later`` replaces ``L``: with ``d``, the step borrows against later steps that only decode (the
        borrowed limit an urgent prompt may use, rule 3), and ``horizon`` caps ``h - 1``, the later steps the
        loan is repaid over."""
        k, s, d = req.num_output_tokens, req.slo_tpot, fig.decode_step
        later = fig.later_step if later is None else later
        h = self.certain_tokens(req)
        if horizon is not None:
            h = min(h, horizon + 1)
        for target in (s / fig.margin, s):
            a = self._allowance_at(req, now, target, later, h)
            if a >= d:
                return a
        if s <= d:
            return -INF
        first = self._allowance_at(req, now, s, later, 1)
        j = max(1, 1 + math.ceil((d - first) / (s - d)))
        return first + (j - 1) * (s - d) if req.max_tokens is None or j <= req.max_tokens - k else -INF

    def slack(self, req: Request, now: float, fig: StepFigures) -> float:
        """Seconds a running request can spare (rule 5): its :meth:`allowance` once it streams tokens; while
        it still prefills, its TTFT deadline minus now minus its predicted remaining prefill (infinite once
        late); infinite without SLOs."""
        if req.num_output_tokens > 0:
            if req.slo_tpot is None or req.first_token_time is None:
                return INF
            return self.allowance(req, now, fig)
        if req.slo_ttft is None or req.slo_late:
            return INF
        remaining = req.num_tokens - req.num_computed_tokens
        return req.arrival_time + req.slo_ttft - now - self.prefill_time(remaining)

    # --------------------------------------------------------------------------------------- chunks
    def max_chunk(self, acc: StepTally, num_computed: int, cap: int, sample: bool, limit: float) -> int:
        """The largest ``n <= cap`` whose chunk keeps ``predict(acc + chunk) <= limit`` (0 if none).

        The prediction grows with ``n``, so a binary search finds it exactly.
        """
        if cap <= 0:
            return 0
        if limit == INF:
            return cap

        def fits(n: int) -> bool:
            return self.model.predict(acc.tokens + n, acc.sampled + int(sample),
                                      acc.pairs + chunk_pairs(n, num_computed)) <= limit

        return cap if fits(cap) else _last_true(0, cap, fits)

    def efficient_chunk(self, decodes: StepTally) -> int:
        """The fewest prompt tokens worth a step of ``decodes`` turning into a step with a prompt chunk: those
        whose cost per token adds up to the model's fixed cost of such a step (its ``prefill_overhead_s``
        and ``prefill_per_sampled_s`` terms, :mod:`goodserve.scheduler.step_time`). 0 when the model has
        none."""
        c = self.model.coefficients
        fixed = c.prefill_overhead_s + c.prefill_per_sampled_s * (decodes.sampled + 1)
        if fixed <= 0 or c.per_token_s <= 0:
            return 0
        return math.ceil(fixed / c.per_token_s)

    # ---------------------------------------------------------------------------------------- paces
    def _pace_inputs(self, running: Sequence[Request]) -> tuple[StepTally, float, Optional[StepFigures]]:
        """The decodes of ``running``, their tightest TPOT SLO a step can meet, and :meth:`pace_figures`."""
        acc = self.decodes(running)
        limit = self.protectable(min(map(tpot_of, running), default=INF))
        return acc, limit, (self.figures(acc) if acc.tokens and limit != INF else None)

    def pace_figures(self, running: Sequence[Request]) -> Optional[StepFigures]:
        """The figures the paces beside ``running`` are priced with; ``None`` if no running decode has a
        TPOT SLO a step can meet (prompts then get the whole budget every step, and no decode is deferred)."""
        return self._pace_inputs(running)[2]

    def prefill_pace(self, running: Sequence[Request], now: float, borrow: bool = False) -> Pace:
        """The plain pace, or with ``borrow`` the borrowed one (see :meth:`prefill_paces`)."""
        return self.prefill_paces(running, now)[int(borrow)]

    def prefill_paces(self, running: Sequence[Request], now: float) -> tuple[Pace, Pace]:
        """How prompts progress beside the running decodes ``D`` (every step that prefills holds them too).

        A step gives prefill what the token budget leaves, ``n* = max_num_batched_tokens - D``, cut as rule 3
        cuts it: while the running requests have banked TPOT time, a step may take their smallest allowance
        ``a`` (over the margin), and each step of ``t`` seconds leaves ``a - t + S`` for the next (``S``, the
        tightest TPOT SLO: the time each token earns); once the chunk that fits is no larger than the one that
        fits ``S``, every later step with a chunk gives that chunk, at least a block, or the efficient chunk
        (:meth:`efficient_chunk`) if larger, each after the decode-only steps that bank its excess over ``S``
        at ``S - d`` a step (``d``, a decode step stretched by the margin). The borrowed pace starts from
        the borrowed limit and each step leaves ``a - t + d`` (``d``, a decode step alone).

        Returns:
            ``(plain, borrowed)``, both from one set of step figures."""
        acc, limit, fig = self._pace_inputs(running)
        n = max(1, self.max_num_batched_tokens - acc.tokens)
        if fig is None:
            return Pace(acc, n), Pace(acc, n)
        steady = max(min(n, self.block_size), self.max_chunk(acc, 0, n, True, limit))
        bank, borrow = self.limits(running, fig, now)
        # Plain: rule 3 holds back a chunk smaller than the efficient one, and decode-only steps (stretched by
        # the margin, as rule 3 prices them) bank time for it at S - d each.
        decode_s = fig.decode_step
        plain = max(steady, min(n, self.efficient_chunk(acc))) if decode_s < limit else steady
        # Borrowed: later steps priced as decodes alone, so a step of t seconds leaves t - d less for the next.
        return (self._banked_pace(acc, n, plain, bank, limit, fig.margin, decode_s),
                self._banked_pace(acc, n, steady, borrow, decode_s, fig.margin))

    def _banked_pace(self, acc: StepTally, n: int, steady: int, bank: float, earned: float, margin: float,
                     decode_s: Optional[float] = None) -> Pace:
        """A pace whose banked phase starts from ``bank`` seconds, each step of ``t`` adding ``earned - t``;
        with ``decode_s``, each step of its steady phase comes after the decode-only steps of that length
        that bank its excess over ``earned``."""
        banked: list[tuple[int, float]] = []
        tokens, seconds = 0, 0.0
        for _ in range(MAX_BANKED_STEPS):
            chunk = self.max_chunk(acc, 0, n, True, bank / margin)
            if chunk <= steady:
                break
            t = self._pace_step(acc, chunk)
            tokens, seconds = tokens + chunk, seconds + t
            banked.append((tokens, seconds))
            bank += earned - t
        return Pace(acc, steady, banked) if decode_s is None else Pace(acc, steady, banked, earned, decode_s)

    def _pace_step(self, decodes: StepTally, k: int) -> float:
        """Predicted seconds of a step of ``decodes`` and a chunk of ``k`` prompt tokens from scratch."""
        return self.model.predict(decodes.tokens + k, decodes.sampled + 1, decodes.pairs + chunk_pairs(k, 0))

    def first_token_time(self, work_tokens: int, pace: Pace, now: float) -> float:
        """When ``work_tokens`` tokens of prefill (those ahead plus one's own) yield a first token: the pace's
        banked steps, then full steps of its chunk beside its decodes, then one step with the rest (each last
        step priced by its own tokens)."""
        i = bisect_left(pace.banked, (work_tokens, -INF))
        done, seconds = pace.banked[i - 1] if i > 0 else (0, 0.0)
        if i < len(pace.banked):
            return now + seconds + self._pace_step(pace.decodes, work_tokens - done)
        full, rest = divmod(work_tokens - done, pace.chunk)
        if rest == 0 and full > 0:
            full, rest = full - 1, pace.chunk
        return now + seconds + full * self._cycle(pace, pace.chunk) + self._cycle(pace, rest)

    def _cycle(self, pace: Pace, k: int) -> float:
        """Predicted seconds of a step of ``pace``'s decodes and ``k`` prompt tokens, after the decode-only
        steps that bank its excess over ``pace.earned``."""
        t = self._pace_step(pace.decodes, k)
        if t <= pace.earned or pace.earned <= pace.decode_s:
            return t
        return t + math.ceil((t - pace.earned) / (pace.earned - pace.decode_s)) * pace.decode_s

    # -------------------------------------------------------------------------------------- triage
    def is_late(self, req: Request, work_tokens: int, pace: Pace, now: float) -> bool:
        """Whether a request without a first token misses its TTFT SLO with ``work_tokens`` ahead and its own."""
        if req.slo_ttft is None or req.num_output_tokens > 0:
            return False
        return self.first_token_time(work_tokens, pace, now) > req.arrival_time + req.slo_ttft

    @staticmethod
    def prefill_remaining(running: Iterable[Request]) -> int:
        """Prompt tokens the running requests still have to prefill."""
        return sum(r.num_tokens - r.num_computed_tokens for r in running
                   if r.num_tokens - r.num_computed_tokens > 1)

    @staticmethod
    def pending(waiting: Iterable[Request], running: Sequence[Request]) -> list[Request]:
        """The requests short of their first token that the triage judges, in order: the running ones still
        prefilling, then the waiting ones; late ones excluded."""
        return [r for r in list(running) + list(waiting)
                if not r.slo_late and not (r in running and r.num_tokens - r.num_computed_tokens <= 1)]

    def assess(self, pending: Sequence[Request], running: Sequence[Request], now: float) -> Assessment:
        """Rules 2 and 6 over ``pending``, in order: each one's first token is predicted behind the prompts
        ahead of it that are not late. One late at both paces is late; one in time at the borrowed pace but
        not at the plain one with its time to first token stretched by the model's margin is urgent.

        Rule 6: if some are late, or late at the borrowed pace stretched by the margin (*short*), the decodes
        with a looser TPOT SLO than the tightest of the short ones that can sit out every step up to a short
        one's deadline (:meth:`spare`) are left out, and the prompts are judged again with a third pace,
        that of the decodes that stay (borrowed). Each short one's deadline is tried, earliest first, and the
        choice that leaves the fewest late is kept, if that is fewer than without.
        """
        paces = self.prefill_paces(running, now)
        late, urgent, short = self._judge(pending, paces, now)
        deferred: set[str] = set()
        spare = self.spare(running, now, min(map(tpot_of, short)), self.pace_figures(running)) if short else {}
        if spare:
            last: set[str] = set()  # later deadlines leave fewer requests able to sit out: a repeat is the last
            for deadline in sorted({r.arrival_time + r.slo_ttft for r in short}):
                ids = {rid for rid, seconds in spare.items() if seconds >= deadline - now}
                if not ids or ids == last:
                    continue
                last = ids
                third = paces + (self.prefill_paces([r for r in running if r.request_id not in ids], now)[1],)
                late2, urgent2, _ = self._judge(pending, third, now)
                if len(late2) < len(late):
                    late, urgent, deferred, best = late2, urgent2, ids, third
                    if not late:
                        break
            if deferred:
                paces = best
        return Assessment(late, frozenset(urgent), frozenset(deferred), paces)

    def _judge(self, pending: Sequence[Request], paces: tuple[Pace, ...], now: float
               ) -> tuple[list[Request], set[str], list[Request]]:
        """Rule 2 over ``pending`` in order (see :meth:`assess`); a request is late only if late at every
        pace of ``paces`` (plain, borrowed, and a third if given).

        Returns:
            The late requests, the ids of the urgent ones, and the short ones: late, or late at the borrowed
            pace stretched by the margin.
        """
        pace, borrowed = paces[:2]
        work = 0
        late, short = [], []
        urgent: set[str] = set()
        margin = self.model.margin
        for req in pending:
            tokens = req.num_tokens - req.num_computed_tokens
            if req.slo_ttft is not None and req.num_output_tokens == 0:
                deadline = req.arrival_time + req.slo_ttft
                plain = self.first_token_time(work + tokens, pace, now)
                lent = self.first_token_time(work + tokens, borrowed, now)
                if now + margin * (lent - now) > deadline:
                    short.append(req)
                if plain > deadline and all(self.is_late(req, work + tokens, p, now) for p in paces[1:]):
                    late.append(req)
                    continue
                if now + margin * (plain - now) > deadline:
                    urgent.add(req.request_id)
            work += tokens
        return late, urgent, short

    def spare(self, running: Sequence[Request], now: float, looser_than: float,
              fig: Optional[StepFigures]) -> dict[str, float]:
        """Rule 6: for each decoding request with a TPOT SLO looser than ``looser_than`` (seconds; the tightest
        of the prompts it would sit out for), the seconds of steps it can sit out and still afford a decode
        step after them: its allowance aimed at its SLO over the margin (rule 3) minus a decode step, if
        positive. An allowance falls by the length of each step a request sits out. ``fig``: the figures of
        :meth:`pace_figures` (``None``: no decodes to protect, none is spared)."""
        if fig is None or fig.decode_step <= 0:
            return {}
        out = {}
        for r in running:
            if self.streams(r) and r.num_tokens - r.num_computed_tokens == 1 and r.slo_tpot > looser_than:
                seconds = self.aimed_allowance(r, now, fig) - fig.decode_step
                if seconds > 0:
                    out[r.request_id] = seconds
        return out
