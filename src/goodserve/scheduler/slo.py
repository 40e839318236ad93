"""The ``slo`` scheduling policy: decisions that maximise goodput, the requests finished inside their SLOs.

First-come-first-served past the knee serves everyone late: each admitted request stretches every step and
so everyone's TPOT, and a request that has already lost its TTFT is served at the expense of one that could
still make it. This policy decides with an online step-time model (:mod:`goodserve.scheduler.step_time`)
and each request's own SLOs (``Request.slo_ttft``, ``Request.slo_tpot``, seconds):

1. **Order** (earliest deadline first by slack, Liu & Layland 1973; SLO-aware ordering as in Andes and
   SLOs-Serve): waiting requests are ordered by their latest start, the TTFT deadline minus the predicted
   time of their own prefill. Requests without a TTFT SLO follow, in arrival order; a preempted request that
   already streamed tokens goes first, as under ``fcfs``.
2. **Triage**: each step predicts when every request short of its first token would get it, the running
   ones still prefilling first (in chunk order), then the waiting ones in queue order, each behind the
   prompts ahead of it that are not late, at the prefill pace (below). One that cannot meet its TTFT SLO
   at either pace, plain or borrowed, is put behind all the others (it is *late*), or, with ``shed_load``,
   refused: on arrival with :class:`SLOUnattainableError` (HTTP 429); queued or still prefilling, it ends with
   ``finish_reason="shed"``. One in time at the borrowed pace but late at the plain one, its predicted time
   to first token stretched by the model's margin, is *urgent* (a prompt given just enough lands on its
   deadline, and step times scatter).
3. **Step time limit from the TPOT averages** (Sarathi-Serve §4.3 derives a fixed token budget from the TBT
   SLO; here it follows each request's own average): TPOT is an average, so a step may use time a request
   banked or will bank. Each streaming request's :meth:`SLOPolicy.allowance` is the longest next step that
   keeps its TPOT within its SLO at every end it may still have (:meth:`SLOPolicy.certain_tokens`), with
   later steps priced at the recent mean step (at least a decode step), aiming at the SLO over the model's
   margin while that is in reach (under load the TPOT lands on its target); the smallest allowance is the
   step's limit. Decodes are scheduled first and each prefill chunk is cut to the largest size whose
   predicted step time, stretched by the model's margin (:attr:`StepTimeModel.margin`, a quantile of
   measured / predicted time over runs of steps: step times scatter and drift on a shared CPU), stays within it; a step without decodes gives
   its first chunk at least a block, so a step is never empty. A step of decodes whose first chunk would
   be cut below :meth:`SLOPolicy.efficient_chunk` (the tokens whose cost adds up to the model's fixed cost
   of a step with a prompt chunk) stays a decode-only step: the engine runs those down a faster path, and
   the decodes bank time for a larger chunk in a later step, so the prompt's tokens pay that fixed cost
   fewer times (on this CPU, a one-call decode step against a layer-by-layer step ~35 ms longer; cut to
   fit every step, prompts there crawled beside a few decodes and were shed). An urgent prompt's chunk is cut to the
   *borrowed* limit instead: the smallest over the streaming requests of the larger of each one's allowance
   and its allowance with only the next :data:`BORROW_STEPS` later steps counted, priced as decodes alone
   (``L = d``). The step spends what those steps will save by not prefilling; the allowances of the next
   steps, recomputed from what the steps took, hold them to what is left, so the debt never exceeds what 16
   decode-only steps repay. Borrowing needs a known length (forced, or ``min_tokens``): a request that may
   stop at any token has nothing later to lend. No prompt gets more than that
   for its TTFT's sake: a request already streaming has cost its prefill, and the triage sheds the prompt
   that cannot be served in time instead. (A first version held every step to the tightest TPOT SLO: on a
   CPU where a decode batch alone fills most of it, prompts crawled a block per step and lost both their
   TTFT and, spread over many steps, the decodes' TPOT; a floor that gave a prompt the chunk its TTFT
   needed past the limit then broke the TPOT of the decodes at every load past the knee.)
4. **Admission stop**: a waiting request is admitted only while a decode step over all running requests
   plus it is predicted to stay within the tightest TPOT SLO (its own included): in steady state every
   step is a decode step, and a TPOT average above the step time cannot hold. The first running request is
   always admitted. A TPOT SLO that even a one-token step cannot meet (the model predicts ``overhead + per
   token + per sampled`` above it) cannot be protected and is ignored here, rather than serving one request
   at a time for nothing.
5. **Preemption victim**: the running list is ordered by slack, so the request preempted under memory
   pressure (the tail) is the one with the most slack: a streaming request's allowance; for one still
   prefilling, its TTFT deadline minus now minus its predicted remaining prefill (infinite once late);
   infinite without SLOs.
6. **Deferred decodes**: when the triage finds prompts late, or late at the borrowed pace stretched by the
   margin, the decoding requests with a looser TPOT SLO than the tightest of theirs that can sit out every
   step up to one of their deadlines and still afford a decode step (:meth:`SLOPolicy.spare`; a request's
   allowance falls by the length of each step it sits out) are left out of this step
   (:attr:`SLOPolicy.deferred`) if the pace of the decodes that stay leaves fewer prompts late (each
   deadline is tried, earliest first). Every step holds every decode, so a request with a loose TPOT SLO
   otherwise makes each step as long for a tight class as for itself, and the tight class's prompts are
   shed. The same judgement refuses arrivals (:meth:`SLOPolicy.check_arrival`). If no prompt gets a chunk
   after all (no free blocks, rule 4, ``max_num_seqs``), the deferred decodes run in the same step.

**Prefill pace.** With the running decodes ``D`` (one token each) in every step, a step's prefill share is
what the token budget leaves, ``n* = max_num_batched_tokens - D``, cut as rule 3 cuts it: while the running
requests have banked TPOT time, a step may take their smallest allowance (over the margin), and a step of
``t`` seconds leaves ``t - S`` less for the next (``S``, the tightest running TPOT SLO, is what each token
earns); once that chunk is no larger than the one whose step fits ``S``, every later step with a chunk gives the latter
(or the efficient chunk, if larger, after the decode-only steps that bank its excess over ``S`` at ``S - d``
each, ``d`` a step of the decodes alone).
``W`` tokens of prefill (the unfinished prompts ahead, and one's own) give a first token after the steps whose
chunks add up to less than ``W`` and one more with the rest, priced by its own tokens (charging the last step
a whole token budget made a short prompt on a slow machine look as costly as a full one, and shed it; pricing
every step at ``S`` when the decodes had seconds banked shed prompts at half the knee that the steps
rule 3 then allowed would have served in time). This errs on the side of serving: decodes also finish and
leave, and a request refused that could have made it is a loss the policy never recovers, while one admitted
that misses costs only the work spent on it. The *borrowed pace* starts from the borrowed limit (rule 3), and
a step of ``t`` seconds leaves ``t - d`` less for the next (``d``, a step of the decodes alone).
"""

from __future__ import annotations

import math
from bisect import bisect_left
from dataclasses import dataclass, field
from typing import Iterable, Optional

from goodserve.request import Request
from goodserve.scheduler.step_time import StepTimeModel

INF = float("inf")
MAX_BANKED_STEPS = 256  # steps of a pace's banked phase looked at (a full-budget one costs one prediction)
#: Later steps an urgent prompt may borrow against (rule 3): the decode step ``d`` a loan is priced at holds
#: only while the batch stays as it is. Priced over a request's whole forced length (128 tokens), loans broke
#: interactive TPOTs on a slow run, as new requests joined and the decode steps grew.
BORROW_STEPS = 16


class SLOUnattainableError(Exception):
    """A request's TTFT SLO cannot be met with the work queued ahead of it (the server answers 429)."""


def _tpot(req: Request) -> float:
    """``req``'s TPOT SLO in seconds, infinite if it has none."""
    return INF if req.slo_tpot is None else req.slo_tpot


def chunk_pairs(n: int, num_computed: int) -> int:
    """Causal query-key pairs of ``n`` new tokens after ``num_computed`` cached ones (see ``StepShape``)."""
    return n * num_computed + n * (n + 1) // 2


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


class StepAccumulator:
    """The figures of the step being built: tokens, sampled tokens and attention pairs."""

    def __init__(self) -> None:
        self.tokens = self.sampled = self.pairs = 0

    def add(self, n: int, num_computed: int, sample: bool) -> None:
        self.tokens += n
        self.sampled += int(sample)
        self.pairs += chunk_pairs(n, num_computed)


@dataclass
class Pace:
    """How prompts progress while the running requests decode: the decodes every step holds; the steps that
    spend the running requests' banked TPOT time (``banked``: after each, the prompt tokens and seconds so
    far); then the prefill tokens each step with a chunk gives (``chunk``), each such step after as many
    decode-only steps as bank its excess over ``earned`` at ``earned - decode_s`` a step (none where
    ``earned <= decode_s``, the default)."""

    decodes: StepAccumulator
    chunk: int
    banked: list[tuple[int, float]] = field(default_factory=list)
    earned: float = 0.0
    decode_s: float = 0.0


class SLOPolicy:
    """The predictions and rules of the ``slo`` policy for one scheduler (see the module docstring).

    Args:
        model: The online step-time model.
        max_num_batched_tokens: The scheduler's token budget per step.
        block_size: Tokens per KV block (the smallest prefill chunk a step without decodes gets).
        shed_load: Refuse requests that cannot meet their TTFT SLO instead of serving them late.
    """

    def __init__(self, model: StepTimeModel, max_num_batched_tokens: int, block_size: int,
                 shed_load: bool = False) -> None:
        self.model = model
        self.max_num_batched_tokens = max_num_batched_tokens
        self.block_size = block_size
        self.shed_load = shed_load
        self.num_shed = 0
        self.num_deferred = 0  # decodes that sat out a step (rule 6), counted by the scheduler
        # Set by begin_step for the step being built.
        self.tpot_limit = INF  # the step's time limit: the smallest TPOT allowance of the running requests
        self.borrow_limit = INF  # the same with later steps priced as decodes alone (for urgent prompts)
        self.urgent: set[str] = set()  # prompts whose TTFT needs the borrowed limit (set by triage)
        self.deferred: set[str] = set()  # decodes that sit out the step for a prompt's TTFT (rule 6, triage)
        self.tpot_min = INF  # the tightest TPOT SLO of the running requests (admission)
        self.margin = 1.0  # the step-time model's margin for this step
        self._decode_step = 0.0  # predicted seconds of a step of the running decodes alone, with the margin
        self._later_step = 0.0  # what a later step is expected to take: that, or the recent mean if longer
        self.acc = StepAccumulator()
        self._prefill_in_step = False
        self._now = 0.0

    # ----------------------------------------------------------------------------------- predictions
    def prefill_time(self, num_tokens: int) -> float:
        """Seconds of a step that only prefills ``num_tokens`` prompt tokens from scratch."""
        return self.model.predict(num_tokens, 1, chunk_pairs(num_tokens, 0))

    def queue_key(self, req: Request) -> tuple:
        """Waiting-queue order: started requests first, then by latest start, then no SLO, then late ones."""
        if req.num_output_tokens > 0:
            return (0, -INF, req.arrival_time)
        if req.slo_late:
            return (3, 0.0, req.arrival_time)
        if req.slo_ttft is None:
            return (2, 0.0, req.arrival_time)
        return (1, req.arrival_time + req.slo_ttft - self.prefill_time(req.num_tokens), req.arrival_time)

    def slack(self, req: Request, now: float) -> float:
        """Seconds a running request can spare (see rule 5): its :meth:`allowance` once it streams tokens;
        while it still prefills, its TTFT deadline minus now minus its predicted remaining prefill; infinite
        without SLOs."""
        if req.num_output_tokens > 0:
            if req.slo_tpot is None or req.first_token_time is None:
                return INF
            return self.allowance(req, now)
        if req.slo_ttft is None or req.slo_late:
            return INF
        remaining = req.num_tokens - req.num_computed_tokens
        return req.arrival_time + req.slo_ttft - now - self.prefill_time(remaining)

    @staticmethod
    def _decode_figures(requests: Iterable[Request]) -> tuple[int, int]:
        """Tokens and attention pairs of one decode token for each request (at its current length)."""
        n = pairs = 0
        for r in requests:
            n += 1
            pairs += r.num_tokens
        return n, pairs

    def max_chunk(self, acc: StepAccumulator, num_computed: int, cap: int, sample: bool, limit: float) -> int:
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

    # ----------------------------------------------------------------------------------- step rules
    def begin_step(self, running: list[Request], now: float) -> None:
        """Set the step's time limit from the TPOT allowances of the running requests (rule 3), order
        ``running`` by slack (tail = most slack, the preemption victim), and count the decodes into the step
        being built."""
        self._now = now
        self._prefill_in_step = False
        kept = [r for r in running if r.request_id not in self.deferred] if self.deferred else running
        self.acc = self._decodes(kept)
        self.tpot_limit = self._set_step_figures(kept, self.acc, now)
        self.tpot_min = self._protectable(min(map(_tpot, running), default=INF))
        running.sort(key=lambda r: (self.slack(r, now), r.arrival_time))

    @staticmethod
    def _decodes(running: Iterable[Request]) -> StepAccumulator:
        """The running requests' decodes, one token each: what every step holds."""
        acc = StepAccumulator()
        for r in running:
            if r.num_tokens - r.num_computed_tokens == 1:
                acc.add(1, r.num_computed_tokens, True)
        return acc

    def _set_step_figures(self, running: Iterable[Request], decodes: StepAccumulator, now: float) -> float:
        """Set the margin, the decode step, the later step and :attr:`borrow_limit` from the model and
        ``decodes``, and return the smallest TPOT allowance of the running requests at ``now`` (rule 3;
        infinite if none has one)."""
        self.margin = self.model.margin
        # A step of the decodes alone: what every later step of a decoding request costs at least.
        self._decode_step = self.margin * self.model.predict(decodes.tokens, decodes.sampled, decodes.pairs) \
            if decodes.tokens else 0.0
        # Later steps hold other prompts' chunks too, as recent ones did.
        self._later_step = max(self._decode_step, self.model.recent_step_s)
        streaming = [r for r in running if self._streams(r)]
        allowances = [self.allowance(r, now) for r in streaming]
        # No decodes running (the streaming requests are recomputing after a preemption): nothing to borrow.
        borrowed = [max(a, self.allowance(r, now, later=self._decode_step, horizon=BORROW_STEPS))
                    for r, a in zip(streaming, allowances)] if self._decode_step > 0 else allowances
        # A request whose TPOT is lost whatever this step does cannot be saved by a shorter step.
        self.borrow_limit = min((a for a in borrowed if a > -INF), default=INF)
        return min((a for a in allowances if a > -INF), default=INF)

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
    def _streams(req: Request) -> bool:
        """Whether ``req`` streams tokens under a TPOT SLO (its first token is out)."""
        return req.num_output_tokens > 0 and req.slo_tpot is not None and req.first_token_time is not None

    @staticmethod
    def _allowance_at(req: Request, now: float, target: float, later: float, h: int) -> float:
        """``a(h) = F + target·k - now + (h - 1)·(target - later)`` (see :meth:`allowance`)."""
        return req.first_token_time + target * req.num_output_tokens - now + (h - 1) * (target - later)

    def _aimed_allowance(self, req: Request, now: float) -> float:
        """``req``'s allowance aimed at its TPOT SLO over the margin (the first target of :meth:`allowance`),
        whether or not a decode step fits it."""
        return self._allowance_at(req, now, req.slo_tpot / self.margin, self._later_step,
                                  self.certain_tokens(req))

    def allowance(self, req: Request, now: float, later: Optional[float] = None,
                  horizon: Optional[int] = None) -> float:
        """Seconds the next step may take with ``req``'s TPOT SLO still met (rule 3).

        With ``k`` tokens streamed since its first at ``F`` and each later step taking ``L``, a request that
        ends ``j`` tokens from now has ``TPOT = (now + T + (j - 1)·L - F) / (k + j - 1)``, within a target
        ``s`` for every step time ``T`` up to ``a(j) = F + s·k - now + (j - 1)·(s - L)``. ``L`` is the larger
        of a step of the running decodes alone and the recent mean step (later steps hold other prompts'
        chunks too). The request surely lasts ``h`` more tokens (:meth:`certain_tokens`), so ``a(h)`` is its
        allowance. The target is ``slo_tpot`` over the model's margin (under load every step spends what it
        is allowed, so the TPOT lands on its target, and step times scatter around their predictions), or,
        once even a decode step ``d`` is over that allowance, ``slo_tpot`` itself. If ``d`` is over that too
        (the request is behind), the allowance is that of the earliest end ``j <= max_tokens - k`` which
        decode-only steps reach in time, ``F + slo_tpot·k - now + (j - 1)·(slo_tpot - d)``, or ``-inf`` if
        there is none (its TPOT is lost whatever this step does).

        ``later`` replaces ``L``: with ``d``, the step borrows against later steps that only decode (the
        borrowed limit an urgent prompt may use, rule 3), and ``horizon`` caps ``h - 1``, the later steps the
        loan is repaid over."""
        k, s, d = req.num_output_tokens, req.slo_tpot, self._decode_step
        later = self._later_step if later is None else later
        h = self.certain_tokens(req)
        if horizon is not None:
            h = min(h, horizon + 1)
        for target in (s / self.margin, s):
            a = self._allowance_at(req, now, target, later, h)
            if a >= d:
                return a
        if s <= d:
            return -INF
        first = self._allowance_at(req, now, s, later, 1)
        j = max(1, 1 + math.ceil((d - first) / (s - d)))
        return first + (j - 1) * (s - d) if req.max_tokens is None or j <= req.max_tokens - k else -INF

    def chunk_size(self, req: Request, num_computed: int, n: int, sample: bool) -> int:
        """Cut ``req``'s prefill chunk of ``n`` tokens to the step's time limit (rule 3); in a step without
        decodes the first prefill chunk gets at least ``min(n, block_size)``, so a step is never empty. The
        first chunk beside decodes is 0 if cut below both ``n`` and :meth:`efficient_chunk`, while decode-only
        steps bank time, unless ``req`` is urgent (its pace, the borrowed one, is a chunk every step) or
        recomputing tokens it already streamed (rule 3)."""
        urgent = req.request_id in self.urgent
        cut = self.max_chunk(self.acc, num_computed, n, sample and n > 0,
                             (self.borrow_limit if urgent else self.tpot_limit) / self.margin)
        if not self._prefill_in_step:
            if not self.acc.tokens:
                cut = max(cut, min(n, self.block_size))
            elif cut < min(n, self.efficient_chunk(self.acc)) and not urgent and req.num_output_tokens == 0 \
                    and self._banks():
                return 0
        return cut

    def _banks(self) -> bool:
        """Whether a step of the decodes alone, stretched by the margin (:meth:`begin_step` priced it), is
        under the tightest TPOT SLO of the running requests, so that decode-only steps bank time for a larger
        chunk (otherwise holding a chunk back would only hold the prompt until the decodes end)."""
        return self._decode_step < self.tpot_min

    def efficient_chunk(self, decodes: StepAccumulator) -> int:
        """The fewest prompt tokens worth a step of ``decodes`` turning into a step with a prompt chunk: those
        whose cost per token adds up to the model's fixed cost of such a step (its ``prefill_overhead_s``
        and ``prefill_per_sampled_s`` terms, :mod:`goodserve.scheduler.step_time`). 0 when the model has
        none."""
        c = self.model.coefficients
        fixed = c.prefill_overhead_s + c.prefill_per_sampled_s * (decodes.sampled + 1)
        if fixed <= 0 or c.per_token_s <= 0:
            return 0
        return math.ceil(fixed / c.per_token_s)

    @property
    def prefill_scheduled(self) -> bool:
        """Whether the step being built holds a prefill chunk."""
        return self._prefill_in_step

    def count(self, num_computed: int, n: int, sample: bool) -> None:
        """Record a chunk scheduled in this step (decodes were counted by :meth:`begin_step`)."""
        self.acc.add(n, num_computed, sample)
        self._prefill_in_step = True

    def _protectable(self, limit: float) -> float:
        """``limit``, or infinity if not even a one-token step is predicted to meet it."""
        return limit if limit == INF or self.model.predict(1, 1, 1) <= limit else INF

    def may_admit(self, req: Request, running: list[Request]) -> bool:
        """Rule 4: one more decode keeps the predicted decode step within the tightest TPOT SLO."""
        if not running:
            return True
        limit = min(self.tpot_min, self._protectable(_tpot(req)))
        if limit == INF:
            return True
        n, pairs = self._decode_figures(running)
        return self.model.predict(n + 1, n + 1, pairs + req.num_tokens) <= limit

    def prefill_pace(self, running: list[Request], now: float, borrow: bool = False) -> Pace:
        """The plain pace, or with ``borrow`` the borrowed one (see :meth:`prefill_paces`)."""
        return self.prefill_paces(running, now)[int(borrow)]

    def prefill_paces(self, running: list[Request], now: float) -> tuple[Pace, Pace]:
        """How prompts progress beside the running decodes ``D`` (every step that prefills holds them too).

        A step gives prefill what the token budget leaves, ``n* = max_num_batched_tokens - D``, cut as rule 3
        cuts it: while the running requests have banked TPOT time, a step may take their smallest allowance
        ``a`` (over the margin), and each step of ``t`` seconds leaves ``a - t + S`` for the next (``S``, the
        tightest TPOT SLO: the time each token earns); once the chunk that fits is no larger than the one that
        fits ``S``, every later step with a chunk gives that chunk, at least a block, or the efficient chunk
        (:meth:`efficient_chunk`) if larger, each after the decode-only steps that bank its excess over ``S``
        at ``S - d`` a step (``d``, a decode step stretched by the margin). The borrowed pace starts from
        ``a`` = :attr:`borrow_limit` and each step leaves ``a - t + d`` (``d``, a decode step alone).

        Returns:
            ``(plain, borrowed)``, both from one set of step figures."""
        acc = self._decodes(running)
        n = max(1, self.max_num_batched_tokens - acc.tokens)
        limit = self._protectable(min(map(_tpot, running), default=INF))
        if not acc.tokens or limit == INF:
            self._decode_step = 0.0  # nothing for rule 6 to defer
            return Pace(acc, n), Pace(acc, n)
        steady = max(min(n, self.block_size), self.max_chunk(acc, 0, n, True, limit))
        bank = self._set_step_figures(running, acc, now)
        # Plain: rule 3 holds back a chunk smaller than the efficient one, and decode-only steps (stretched by
        # the margin, as rule 3 prices them) bank time for it at S - d each.
        decode_s = self._decode_step
        plain = max(steady, min(n, self.efficient_chunk(acc))) if decode_s < limit else steady
        # Borrowed: later steps priced as decodes alone, so a step of t seconds leaves t - d less for the next.
        return (self._banked_pace(acc, n, plain, bank, limit, decode_s),
                self._banked_pace(acc, n, steady, self.borrow_limit, self._decode_step))

    def _banked_pace(self, acc: StepAccumulator, n: int, steady: int, bank: float, earned: float,
                     decode_s: Optional[float] = None) -> Pace:
        """A pace whose banked phase starts from ``bank`` seconds, each step of ``t`` adding ``earned - t``;
        with ``decode_s``, each step of its steady phase comes after the decode-only steps of that length
        that bank its excess over ``earned``."""
        banked: list[tuple[int, float]] = []
        tokens, seconds = 0, 0.0
        for _ in range(MAX_BANKED_STEPS):
            chunk = self.max_chunk(acc, 0, n, True, bank / self.margin)
            if chunk <= steady:
                break
            t = self._pace_step(acc, chunk)
            tokens, seconds = tokens + chunk, seconds + t
            banked.append((tokens, seconds))
            bank += earned - t
        return Pace(acc, steady, banked) if decode_s is None else Pace(acc, steady, banked, earned, decode_s)

    def _pace_step(self, decodes: StepAccumulator, k: int) -> float:
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

    def is_late(self, req: Request, work_tokens: int, pace: Pace, now: float) -> bool:
        """Whether a request without a first token misses its TTFT SLO with ``work_tokens`` ahead and its own."""
        if req.slo_ttft is None or req.num_output_tokens > 0:
            return False
        return self.first_token_time(work_tokens, pace, now) > req.arrival_time + req.slo_ttft

    @staticmethod
    def prefill_remaining(running: list[Request]) -> int:
        """Prompt tokens the running requests still have to prefill."""
        return sum(r.num_tokens - r.num_computed_tokens for r in running
                   if r.num_tokens - r.num_computed_tokens > 1)

    def triage(self, waiting: list[Request], running: list[Request], now: float) -> list[Request]:
        """Rule 2 over the running requests still prefilling towards their first token (in the order their
        chunks are given), then the waiting ones in queue order (see :meth:`assess`); sets :attr:`urgent` and
        :attr:`deferred` for the step.

        Returns:
            The requests that became late in this call (the scheduler sheds them under ``shed_load``, else
            puts them behind the others).
        """
        late, self.urgent, self.deferred, _ = self.assess(self._pending(waiting, running), running, now)
        return late

    @staticmethod
    def _pending(waiting: Iterable[Request], running: list[Request]) -> list[Request]:
        """The requests short of their first token that the triage judges, in order: the running ones still
        prefilling, then the waiting ones; late ones excluded."""
        return [r for r in list(running) + list(waiting)
                if not r.slo_late and not (r in running and r.num_tokens - r.num_computed_tokens <= 1)]

    def assess(self, pending: list[Request], running: list[Request], now: float
               ) -> tuple[list[Request], set[str], set[str], tuple[Pace, ...]]:
        """Rules 2 and 6 over ``pending``, in order: each one's first token is predicted behind the prompts
        ahead of it that are not late. One late at both paces is late; one in time at the borrowed pace but
        not at the plain one with its time to first token stretched by the model's margin is urgent.

        Rule 6: if some are late, or late at the borrowed pace stretched by the margin (*short*), the decodes
        with a looser TPOT SLO than the tightest of the short ones that can sit out every step up to a short
        one's deadline (:meth:`spare`) are left out, and the prompts are judged again with a third pace,
        that of the decodes that stay (borrowed). Each short one's deadline is tried, earliest first, and the
        choice that leaves the fewest late is kept, if that is fewer than without.

        Returns:
            ``(late, urgent ids, deferred ids, paces)``: ``paces`` are the plain and borrowed ones and, if
            decodes are deferred, the third.
        """
        paces = self.prefill_paces(running, now)
        late, urgent, short = self._judge(pending, paces, now)
        deferred: set[str] = set()
        spare = self.spare(running, now, min(map(_tpot, short))) if short else {}
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
        return late, urgent, deferred, paces

    def _judge(self, pending: list[Request], paces: tuple[Pace, ...], now: float
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

    def spare(self, running: list[Request], now: float, looser_than: float) -> dict[str, float]:
        """Rule 6: for each decoding request with a TPOT SLO looser than ``looser_than`` (seconds; the tightest
        of the prompts it would sit out for), the seconds of steps it can sit out and still afford a decode
        step after them: its allowance aimed at its SLO over the margin (rule 3) minus a decode step, if
        positive. An allowance falls by the length of each step a request sits out. Uses the figures
        :meth:`prefill_paces` or :meth:`begin_step` set last (none if they found no decodes to protect)."""
        if self._decode_step <= 0:
            return {}
        out = {}
        for r in running:
            if self._streams(r) and r.num_tokens - r.num_computed_tokens == 1 and r.slo_tpot > looser_than:
                seconds = self._aimed_allowance(r, now) - self._decode_step
                if seconds > 0:
                    out[r.request_id] = seconds
        return out

    def check_arrival(self, req: Request, waiting: Iterable[Request], running: list[Request], now: float) -> None:
        """Under ``shed_load``, refuse a new request that cannot meet its TTFT SLO behind the work queued
        ahead of it: the triage (:meth:`assess`) with it placed in the queue by its key.

        Raises:
            SLOUnattainableError: naming the predicted and the allowed time to first token.
        """
        if not self.shed_load or req.slo_ttft is None:
            return
        key = self.queue_key(req)
        ahead: list[Request] = []
        behind: list[Request] = []
        for r in waiting:
            if not r.slo_late:
                (ahead if self.queue_key(r) <= key else behind).append(r)
        pending = self._pending(ahead, running) + [req] + behind
        late, _, _, paces = self.assess(pending, running, now)
        if req in late:
            self.num_shed += 1
            work = self.prefill_remaining(running) + req.num_tokens + \
                sum(r.num_tokens - r.num_computed_tokens for r in ahead)
            predicted = min(self.first_token_time(work, pace, now) for pace in paces) - req.arrival_time
            raise SLOUnattainableError(
                f"the server cannot meet this request's TTFT SLO of {req.slo_ttft * 1000:.0f} ms: with the "
                f"{work} prompt tokens queued ahead of it and its own, its first token is predicted after "
                f"{predicted * 1000:.0f} ms. Retry later, or with a looser slo_ttft_ms.")

    def shed(self, req: Request, now: float) -> str:
        """Count a queued request as shed and say why (the scheduler finishes it)."""
        self.num_shed += 1
        return (f"shed: its TTFT SLO of {req.slo_ttft * 1000:.0f} ms can no longer be met "
                f"({(now - req.arrival_time) * 1000:.0f} ms after arrival, with the work queued ahead of it)")
