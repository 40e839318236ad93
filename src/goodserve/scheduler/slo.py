"""The ``slo`` scheduling policy: decisions that maximise goodput, the requests finished inside their SLOs.

First-come-first-served past the knee serves everyone late: each admitted request stretches every step and
so everyone's TPOT, and a request that has already lost its TTFT is served at the expense of one that could
still make it. This policy decides with an online step-time model (:mod:`goodserve.scheduler.step_time`)
and each request's own SLOs (``Request.slo_ttft``, ``Request.slo_tpot``, seconds):

1. **Order** (earliest deadline first by slack, Liu & Layland 1973; SLO-aware ordering as in Andes and
   SLOs-Serve): waiting requests are ordered by their latest start, the TTFT deadline minus the predicted
   time of their own prefill. Requests without a TTFT SLO follow, in arrival order; a preempted request that
   already streamed tokens goes first, as under ``fcfs``.
2. **Triage**: each step predicts when every waiting request would get its first token if served in that
   order at the prefill pace (below). One that can no longer meet its TTFT SLO is put behind all the others
   (it is *late*), or, with ``shed_load``, refused at once: on arrival the request is refused with
   :class:`SLOUnattainableError` (HTTP 429), and a queued one ends with ``finish_reason="shed"``.
3. **Token budget from the TPOT SLO** (Sarathi-Serve §4.3 derives a fixed budget from the TBT SLO; here it is
   decided per step): decodes are scheduled first, and each prefill chunk is cut to the largest size whose
   predicted step time stays within the tightest TPOT SLO of the running requests, but never below what the
   prompt needs per step to still meet its own TTFT SLO (a prompt starved to a block per step misses its TTFT
   for sure; a few steps over the limit cost a TPOT average little). Every step, not just
   the average, is held to it: the margin absorbs the model's prediction error (letting a step use the time
   a request banked by running faster than its SLO measured better in simulation and worse on a real CPU,
   whose step times scatter; BENCHMARKS.md). The first prefill chunk of a step gets at least one block, so
   prompts always progress and a step is never empty.
4. **Admission stop**: a waiting request is admitted only while a decode step over all running requests
   plus it is predicted to stay within the tightest TPOT SLO (its own included): in steady state every
   step is a decode step, and a TPOT average above the step time cannot hold. The first running request is
   always admitted.

A TPOT SLO that even a one-token step cannot meet (the model predicts ``overhead + per token + per sampled``
above it) cannot be protected: rules 3 and 4 then ignore it, and the step is as large as the token budget
allows (maximum throughput), rather than serving one request at a time for nothing.

5. **Preemption victim**: the running list is ordered by slack, so the request preempted under memory
   pressure (the tail) is the one with the most slack. Slack: for a request that has streamed ``k`` tokens,
   ``first_token_time + slo_tpot · k - now`` (when its next token is due for its TPOT to hold); for one
   still prefilling, its TTFT deadline minus now minus its predicted remaining prefill; infinite without SLOs.

**Prefill pace.** With the running decodes ``D`` (one token each) in every step, a step's prefill share is
what the token budget leaves, ``n* = max_num_batched_tokens - D``, and a step then takes
``T* = predict(D + chunk of n*)``. ``W`` tokens of prefill (the unfinished prompts ahead in the queue, and
one's own) give a first token after ``floor(W / n*)`` such steps and one more with the rest,
``predict(D + chunk of W mod n*)`` (charging the last step a whole ``T*`` made a short prompt on a slow
machine look as costly as a full token budget, and shed it). This errs on the side of serving: rule 3
may cut chunks below ``n*``, but decodes also finish and leave, and a request refused that could have made
it is a loss the policy never recovers, while one admitted that misses costs only the work spent on it.
"""

from __future__ import annotations

from typing import Iterable

from goodserve.request import Request
from goodserve.scheduler.step_time import StepTimeModel

INF = float("inf")


class SLOUnattainableError(Exception):
    """A request's TTFT SLO cannot be met with the work queued ahead of it (the server answers 429)."""


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
        # Set by begin_step for the step being built.
        self.tpot_limit = INF  # the tightest TPOT SLO of the running requests: the step's time limit
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
        """Seconds a running request can spare (see rule 5)."""
        if req.num_output_tokens > 0:
            if req.slo_tpot is None or req.first_token_time is None:
                return INF
            return req.first_token_time + req.slo_tpot * req.num_output_tokens - now
        if req.slo_ttft is None:
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
        """Order ``running`` by slack (tail = most slack, the preemption victim), take the tightest TPOT SLO
        as the step's time limit, and count the decodes into the step being built."""
        running.sort(key=lambda r: (self.slack(r, now), r.arrival_time))
        self.tpot_limit = self._protectable(min((r.slo_tpot for r in running if r.slo_tpot is not None),
                                                default=INF))
        self.acc = StepAccumulator()
        self._prefill_in_step = False
        self._now = now
        for r in running:
            if r.num_tokens - r.num_computed_tokens == 1:
                self.acc.add(1, r.num_computed_tokens, True)

    def chunk_size(self, req: Request, num_computed: int, n: int, sample: bool) -> int:
        """Cut ``req``'s prefill chunk of ``n`` tokens to the step's time limit (rule 3).

        Two floors: the step's first prefill chunk gets at least ``min(n, block_size)``; and a prompt that
        can still meet its TTFT SLO gets at least the smallest chunk that, repeated in steps like this one,
        finishes its prompt by its deadline (:meth:`ttft_chunk`). The time limit protects a TPOT *average*,
        which a few steps over it move little, while prefill cut below that chunk misses the TTFT for sure:
        on a slow machine a decode batch alone can use the whole limit and leave prefill a block per step."""
        cut = self.max_chunk(self.acc, num_computed, n, sample and n > 0, self.tpot_limit)
        if not self._prefill_in_step:
            cut = max(cut, min(n, self.block_size))
        if cut < n and self.tpot_limit < INF:
            cut = max(cut, self.ttft_chunk(req, num_computed, n))
        return cut

    def ttft_chunk(self, req: Request, num_computed: int, n: int) -> int:
        """The smallest chunk ``c <= n`` such that ``ceil(remaining / c)`` steps like the one being built,
        each with ``c`` of ``req``'s prompt tokens, end by its TTFT deadline; 0 if it has no TTFT SLO, has
        streamed tokens already, or cannot make it even with ``n`` per step."""
        if req.slo_ttft is None or req.num_output_tokens > 0:
            return 0
        time_left = req.arrival_time + req.slo_ttft - self._now
        remaining = req.num_tokens - num_computed

        def in_time(c: int) -> bool:
            step = self.model.predict(self.acc.tokens + c, self.acc.sampled + 1,
                                      self.acc.pairs + chunk_pairs(c, num_computed))
            return -(-remaining // c) * step <= time_left

        if time_left <= 0 or not in_time(n):
            return 0
        return _last_true(0, n, lambda c: not in_time(c)) + 1

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
        limit = min(self.tpot_limit, self._protectable(req.slo_tpot if req.slo_tpot is not None else INF))
        if limit == INF:
            return True
        n, pairs = self._decode_figures(running)
        return self.model.predict(n + 1, n + 1, pairs + req.num_tokens) <= limit

    def prefill_pace(self, running: list[Request]) -> StepAccumulator:
        """The running decodes, one token each: every step that prefills next to them holds them too."""
        acc = StepAccumulator()
        for r in running:
            if r.num_output_tokens > 0:
                acc.add(1, r.num_tokens - 1, True)
        return acc

    def first_token_time(self, work_tokens: int, decodes: StepAccumulator, now: float) -> float:
        """When ``work_tokens`` tokens of prefill (those ahead plus one's own) yield a first token: full steps
        of ``n* = max_num_batched_tokens - D`` prefill tokens beside the ``D`` decodes, then one step with
        the rest."""
        n = max(1, self.max_num_batched_tokens - decodes.tokens)
        full, rest = divmod(work_tokens, n)
        if rest == 0 and full > 0:
            full, rest = full - 1, n

        def step(k: int) -> float:
            return self.model.predict(decodes.tokens + k, decodes.sampled + 1, decodes.pairs + chunk_pairs(k, 0))

        return now + full * step(n) + step(rest)

    def is_late(self, req: Request, work_tokens: int, pace: StepAccumulator, now: float) -> bool:
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
        """Rule 2 over the waiting requests in queue order.

        Returns:
            The requests that became late in this call (the scheduler moves them behind the others, or sheds
            them under ``shed_load``).
        """
        pace = self.prefill_pace(running)
        work = self.prefill_remaining(running)
        late = []
        for req in waiting:
            if req.slo_late:
                continue
            tokens = req.num_tokens - req.num_computed_tokens
            if self.is_late(req, work + tokens, pace, now):
                late.append(req)
            else:
                work += tokens
        return late

    def check_arrival(self, req: Request, waiting: Iterable[Request], running: list[Request], now: float) -> None:
        """Under ``shed_load``, refuse a new request that cannot meet its TTFT SLO behind the work queued
        ahead of it.

        Raises:
            SLOUnattainableError: naming the predicted and the allowed time to first token.
        """
        if not self.shed_load or req.slo_ttft is None:
            return
        key = self.queue_key(req)
        work = self.prefill_remaining(running) + req.num_tokens
        work += sum(r.num_tokens - r.num_computed_tokens for r in waiting
                    if not r.slo_late and self.queue_key(r) <= key)
        pace = self.prefill_pace(running)
        if self.is_late(req, work, pace, now):
            self.num_shed += 1
            predicted = self.first_token_time(work, pace, now) - req.arrival_time
            raise SLOUnattainableError(
                f"the server cannot meet this request's TTFT SLO of {req.slo_ttft * 1000:.0f} ms: with the "
                f"{work} prompt tokens queued ahead of it and its own, its first token is predicted after "
                f"{predicted * 1000:.0f} ms. Retry later, or with a looser slo_ttft_ms.")

    def shed(self, req: Request, now: float) -> str:
        """Count a queued request as shed and say why (the scheduler finishes it)."""
        self.num_shed += 1
        return (f"shed: its TTFT SLO of {req.slo_ttft * 1000:.0f} ms can no longer be met "
                f"({(now - req.arrival_time) * 1000:.0f} ms after arrival, with the work queued ahead of it)")
