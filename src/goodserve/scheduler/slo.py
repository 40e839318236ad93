"""The ``slo`` scheduling policy: decisions that maximise goodput, the requests finished inside their SLOs.

First-come-first-served past the knee serves everyone late: each admitted request stretches every step and
so everyone's TPOT, and a request that has already lost its TTFT is served at the expense of one that could
still make it. This policy decides from an online step-time model (:mod:`goodserve.scheduler.step_time`)
and each request's own SLOs (``Request.slo_ttft``, ``Request.slo_tpot``, seconds), by six rules
(docs/slo.md gives each with its reasons and measurements; the predictions are
:class:`~goodserve.scheduler.slo_pace.SLOPredictor`'s):

1. **Order** (earliest deadline first by slack, Liu & Layland 1973; as in Andes and SLOs-Serve): waiting
   requests by their latest start, the TTFT deadline minus the predicted time of their own prefill; then
   those without a TTFT SLO in arrival order, then late ones; a preempted request that streamed goes first.
2. **Triage**: a request short of its first token that cannot meet its TTFT SLO at the plain or the
   borrowed prefill pace, behind the prompts ahead of it, is *late*: queued behind all others or, under
   ``shed_load``, refused (on arrival with :class:`SLOUnattainableError`, HTTP 429; queued or prefilling,
   ``finish_reason="shed"``). One in time only at the borrowed pace, with the margin, is *urgent*.
3. **Step time limit from the TPOT averages** (Sarathi-Serve §4.3 derives a fixed budget from the TBT SLO;
   here it follows each request's own average): the step's limit is the smallest TPOT allowance of the
   streaming requests; decodes first, each prefill chunk cut to the largest size whose predicted step,
   stretched by the model's margin, fits it (the borrowed limit for an urgent prompt). A first chunk beside
   decodes cut below the *efficient chunk* waits while decode-only steps bank time for a larger one. A
   step without decodes gives its first chunk at least a block, so a step is never empty.
4. **Admission stop**: a request is admitted only while a decode step over the running requests plus it is
   predicted within the tightest TPOT SLO a step can meet (the first running request always is).
5. **Preemption victim**: the running list is ordered by slack (the plan's ``rank``); the tail, the request
   with the most slack, is preempted.
6. **Deferred decodes**: when prompts are late or short, decodes with a looser TPOT SLO that can sit out
   every step up to a prompt's deadline sit out the step, if that leaves fewer prompts late; if no prompt
   gets a chunk after all, they run in the same step.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable, Sequence

from goodserve.request import Request
from goodserve.scheduler.policy import NO_TRIAGE, SLOUnattainableError, StepPlan, StepPolicy, StepTally, Triage
from goodserve.scheduler.queue import RequestQueue, SortedQueue
from goodserve.scheduler.slo_pace import INF, SLOPredictor, StepFigures, tpot_of
from goodserve.scheduler.step_time import StepTimeModel

@dataclass(frozen=True)
class SLOPlan(StepPlan):
    """The ``slo`` policy's figures for one step.

    Attributes:
        figures: What later steps are priced at (margin, decode step, later step).
        tpot_limit: The step's time limit, seconds: the smallest TPOT allowance of the running requests that
            take part in the step (rule 3).
        borrow_limit: The same with later steps priced as decodes alone (for urgent prompts).
        tpot_min: The tightest TPOT SLO of the running requests that a step can meet (rule 4; infinite if none).
    """

    figures: StepFigures = StepFigures()
    tpot_limit: float = INF
    borrow_limit: float = INF
    tpot_min: float = INF

    @property
    def max_step_s(self) -> float:
        """Rule 3's limit over the model's margin (what a chunk is cut to)."""
        return self.tpot_limit / self.figures.margin


class SLOPolicy(StepPolicy):
    """The ``slo`` policy for one scheduler (see the module docstring).

    Args:
        model: The online step-time model.
        max_num_batched_tokens: The scheduler's token budget per step.
        block_size: Tokens per KV block (the smallest prefill chunk a step without decodes gets).
        shed_load: Refuse requests that cannot meet their TTFT SLO instead of serving them late.
    """

    name = "slo"

    def __init__(self, model: StepTimeModel, max_num_batched_tokens: int, block_size: int,
                 shed_load: bool = False) -> None:
        self.predict = SLOPredictor(model, max_num_batched_tokens, block_size)
        self.block_size = block_size
        self.shed_load = shed_load

    # ---------------------------------------------------------------------------------- queue order
    def queue_key(self, req: Request) -> tuple:
        """Waiting-queue order: started requests first, then by latest start, then no SLO, then late ones."""
        if req.num_output_tokens > 0:
            return (0, -INF, req.arrival_time)
        if req.slo_late:
            return (3, 0.0, req.arrival_time)
        if req.slo_ttft is None:
            return (2, 0.0, req.arrival_time)
        return (1, req.arrival_time + req.slo_ttft - self.predict.prefill_time(req.num_tokens), req.arrival_time)

    def make_queue(self) -> RequestQueue:
        return SortedQueue(self.queue_key)

    # ------------------------------------------------------------------------------ arrival, triage
    def check_arrival(self, request: Request, waiting: Iterable[Request], running: Sequence[Request],
                      now: float) -> None:
        """Under ``shed_load``, refuse a new request that cannot meet its TTFT SLO behind the work queued
        ahead of it: the triage with it placed in the queue by its key.

        Raises:
            SLOUnattainableError: naming the predicted and the allowed time to first token.
        """
        if not self.shed_load or request.slo_ttft is None:
            return
        key = self.queue_key(request)
        ahead: list[Request] = []
        behind: list[Request] = []
        for r in waiting:
            if not r.slo_late:
                (ahead if self.queue_key(r) <= key else behind).append(r)
        p = self.predict
        verdict = p.assess(p.pending(ahead, running) + [request] + behind, running, now)
        if request in verdict.late:
            work = p.prefill_remaining(running) + request.num_tokens + \
                sum(r.num_tokens - r.num_computed_tokens for r in ahead)
            predicted = min(p.first_token_time(work, pace, now) for pace in verdict.paces) - request.arrival_time
            raise SLOUnattainableError(
                f"the server cannot meet this request's TTFT SLO of {request.slo_ttft * 1000:.0f} ms: with the "
                f"{work} prompt tokens queued ahead of it and its own, its first token is predicted after "
                f"{predicted * 1000:.0f} ms. Retry later, or with a looser slo_ttft_ms.")

    def triage(self, waiting: Sequence[Request], running: Sequence[Request], now: float) -> Triage:
        """Rules 2 and 6 over the running requests still prefilling towards their first token (in the order
        their chunks are given), then the waiting ones in queue order."""
        verdict = self.predict.assess(self.predict.pending(waiting, running), running, now)
        late = tuple((r, f"shed: its TTFT SLO of {r.slo_ttft * 1000:.0f} ms can no longer be met "
                         f"({(now - r.arrival_time) * 1000:.0f} ms after arrival, with the work queued ahead of it)")
                     for r in verdict.late)
        return Triage(late, verdict.urgent, verdict.deferred)

    # ----------------------------------------------------------------------------------------- plan
    def plan(self, running: Sequence[Request], now: float, triage: Triage = NO_TRIAGE) -> SLOPlan:
        """Rule 3's limits from the running requests that take part in the step (not the deferred ones), rule
        4's tightest TPOT over all of them, and rule 5's order by slack."""
        p = self.predict
        kept = [r for r in running if r.request_id not in triage.deferred] if triage.deferred else running
        decodes = p.decodes(kept)
        fig = p.figures(decodes)
        tpot_limit, borrow_limit = p.limits(kept, fig, now)
        rank = {r.request_id: (p.slack(r, now, fig), r.arrival_time) for r in running}
        return SLOPlan(triage, rank, (decodes.tokens, decodes.sampled, decodes.pairs), fig, tpot_limit,
                       borrow_limit, p.protectable(min(map(tpot_of, running), default=INF)))

    def chunk_size(self, plan: SLOPlan, tally: StepTally, request: Request, num_computed: int, n: int,
                   sample: bool) -> int:
        """Rule 3: cut ``request``'s chunk of ``n`` tokens to the step's time limit; in a step without decodes
        the first chunk gets at least ``min(n, block_size)``. The first chunk beside decodes is 0 if cut below
        both ``n`` and the efficient chunk while decode-only steps bank time (the decode step, with the
        margin, under the tightest TPOT SLO), unless ``request`` is urgent (its pace, the borrowed one, is a
        chunk every step) or recomputing tokens it already streamed."""
        urgent = request.request_id in plan.triage.urgent
        limit = (plan.borrow_limit if urgent else plan.tpot_limit) / plan.figures.margin
        cut = self.predict.max_chunk(tally, num_computed, n, sample and n > 0, limit)
        if not tally.prefill_scheduled:
            if not tally.tokens:
                cut = max(cut, min(n, self.block_size))
            elif cut < min(n, self.predict.efficient_chunk(tally)) and not urgent \
                    and request.num_output_tokens == 0 and plan.figures.decode_step < plan.tpot_min:
                return 0
        return cut

    def may_admit(self, plan: SLOPlan, request: Request, running: Sequence[Request]) -> bool:
        """Rule 4: one more decode keeps the predicted decode step within the tightest TPOT SLO."""
        if not running:
            return True
        limit = min(plan.tpot_min, self.predict.protectable(tpot_of(request)))
        if limit == INF:
            return True
        n = len(running)
        pairs = sum(r.num_tokens for r in running)
        return self.predict.model.predict(n + 1, n + 1, pairs + request.num_tokens) <= limit
