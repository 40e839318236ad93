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
from typing import Optional, Sequence

from goodserve.request import Request
from goodserve.scheduler.output import SchedulerOutput, StepShape
from goodserve.scheduler.slo_pace import SLOPredictor
from goodserve.scheduler.step_time import StepTimeModel
from goodserve.spec.config import SpeculativeConfig
from goodserve.spec.length import (AcceptanceStats, DraftCost, TPOTBound, choose_length, chunk_beside, kept,
                                   reread_ktokens, step_seconds)
from goodserve.spec.propose_cost import ProposeCost

#: Steps ``auto`` chooses no drafts for before one step verifies drafts (``k_max`` per row and 1 per row in
#: turn), so what drafts cost is measured (a 1-in-17 probe; for a draft model, the interval doubling after each
#: probe at which drafts cannot pay even at the acceptance rates' upper bounds, until ``auto`` chooses drafts
#: itself, up to :data:`EXPLORE_MAX`); and steps it chooses drafts for before one step verifies none, so the
#: step-time model keeps measuring the steps without them (~6% of the drafts' tokens forgone, until
#: :data:`EXPLORE_MAX`).
EXPLORE_EVERY = 16
#: The most steps with drafts between two steps without: the interval doubles from :data:`EXPLORE_EVERY` each
#: time a step without drafts took what the step-time model predicted, within :data:`PROBE_TOLERANCE`
#: (a model that holds needs few such probes), and falls back to it when one did not after one that did
#: (:meth:`Speculator.observe`). Also, for a draft model, the most steps without drafts between two probes
#: with drafts: each probe at which drafts cannot pay even at the acceptance rates' upper bounds doubles that
#: interval (drafts that do not pay need few probes, and a draft model's probe proposes with passes of its own),
#: and a step of the same kind in which ``auto`` verifies drafts of its own choice resets it.
EXPLORE_MAX = 256
#: Relative error of the step-time model's prediction within which a step without drafts confirms it.
PROBE_TOLERANCE = 0.1
#: A step with drafts that took more than this many times the model's price of it (each draft a decode row)
#: stalled on something else: :class:`~goodserve.spec.length.DraftCost` does not learn it (BENCHMARKS.md,
#: "Speculative decoding: ... probes while requests arrive").
STALL = 3.0
#: Rows a draft model's probe verifies drafts in: the one with the shortest context. A draft model proposes
#: after reading what it has not seen of a row's context, which, after steps without drafts, is most of it: a
#: probe of every row read every row's whole context through the draft before one step (BENCHMARKS.md,
#: "Speculative decoding with a draft model"). Prompt lookup reads nothing and costs little:
#: its probes take every row, come every :data:`EXPLORE_EVERY` steps, and its proposals run ahead of them.
DRAFT_MODEL_PROBE_ROWS = 1
#: Tokens of a row's context a draft model has not read before a step (those of steps it did not propose after)
#: from which it catches up: with the step's own, it reads more than the 2 tokens that follow a step it proposed
#: after (the target's token, and the last draft where all were accepted; :mod:`goodserve.runner.draft_model`).
CATCH_UP_TOKENS = 2
#: Weight of each step in the recency-weighted sums of a draft model's catch-up seconds and tokens, whose ratio
#: prices a token of catch-up.
CATCH_UP_WEIGHT = 0.2
#: The fewest tokens of a step's catch-up that teach its price: a pass of a few tokens (a probe's row, read
#: again after :data:`EXPLORE_EVERY` steps) costs mostly its overhead, several times a prompt's catch-up token.
CATCH_UP_MEASURED = 64


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
        self.cost = DraftCost()  # what drafts add to a step of decodes alone
        self.cost_beside = DraftCost()  # ... and to a step with a prompt chunk
        self.propose = ProposeCost()  # a draft model's passes, timed where they run
        #: The most positions of a row one attention run holds (``None``: any number); the runner's
        #: (:meth:`goodserve.runner.model_runner.ModelRunner.attention_run_positions`).
        self.run_positions: Optional[int] = None
        self._slo = SLOPredictor(model, max_num_batched_tokens=0, block_size=1)  # only its step figures are read
        self.length = 0  # drafts per row chosen for the step being built
        self._at_zero = [0, 0]  # steps without a chunk, and with one, that verified no drafts since one did
        self._probe_every = [EXPLORE_EVERY, EXPLORE_EVERY]  # ... before a probe with drafts, of each kind
        self._probing = False  # this step is a probe with drafts: its proposals follow auto's own choice
        self._kind = 0  # this step's kind: 1 with a prompt chunk, 0 of decodes alone
        #: Proposing costs passes of a model (a draft model's): probes take DRAFT_MODEL_PROBE_ROWS rows and back off
        self._costly = config.method == "draft_model"
        self._probe_ids: Optional[set[str]] = None  # a draft model's: the rows its next probe takes
        self._steps_with = 0  # consecutive steps auto chose drafts for
        self._chosen = 0  # the length auto chose for this step, or for its decodes alone if more (before probes)
        self._probes = 0  # probes with drafts taken (their length alternates: :meth:`_probe_length`)
        self._explore_with = EXPLORE_EVERY  # steps with drafts before one without (doubles while the model holds)
        self._judging = False  # a step without drafts was chosen to check the model: judge it when it is back
        self._held = True  # the last check found the model within PROBE_TOLERANCE
        self._counted = ((0, 0), 0, 0, (EXPLORE_EVERY, EXPLORE_EVERY))  # the counters before this step's choice
        self._proposed = 0.0  # seconds the last step observed spent proposing the drafts of the next
        # A draft model's catch-up (:meth:`_worth_catching_up`): each row's tokens, and preemptions, when the draft
        # last proposed for it (:meth:`proposed`), the rows this step asks it for, the machine seconds a token of
        # this step's choice saves, the tokens the asks of this step make the draft catch up on, and the
        # recency-weighted seconds and tokens of catch-up measured
        self._seen: dict[str, tuple[int, int]] = {}
        self._asked: set[str] = set()
        self._saving = 0.0
        self._catching_up = 0
        self._caught_up = [0.0, 0.0]

    @staticmethod
    def eligible(req: Request) -> bool:
        """Whether ``req`` speculates: not under a grammar (its matcher would have to advance over drafts
        that may be rejected; constrained requests decode a token a step)."""
        return req.sampling_params.structured_outputs is None

    def begin_step(self, running: Sequence[Request], limit: float = math.inf, again: bool = False,
                   prompt_tokens: int = 0, room: Optional[int] = None, now: float = 0.0) -> None:
        """Choose the step's length: the fixed one, or under ``auto`` the one maximising the work per second of
        the eligible decode rows and the ``prompt_tokens`` the step may prefill beside them in the ``room``
        their drafts share, among those keeping the most rows within their TPOT SLOs at ``now`` (monotonic
        seconds; :func:`~goodserve.spec.length.choose_length`), keeping the step within ``limit`` seconds.
        ``again``: the same step chooses anew (after a preemption), its probes counted once."""
        if self.config.length != "auto":
            self.length = self.config.length
            return
        if again:
            at_zero, self._steps_with, self._probes, probe_every = self._counted
            self._at_zero, self._probe_every = list(at_zero), list(probe_every)
        self._counted = (tuple(self._at_zero), self._steps_with, self._probes, tuple(self._probe_every))
        self._probing = False
        decodes = [r for r in running if r.num_tokens - r.num_computed_tokens == 1]
        contexts = [r.num_computed_tokens for r in decodes if self.eligible(r)]
        costs, beside = self.cost.costs(), self.cost_beside.costs()
        if self._costly:  # with the draft's passes
            proposing, per_token = self.propose.costs(), self.model.coefficients.per_token_s
            costs, beside = (ProposeCost.priced(c, proposing, per_token) for c in (costs, beside))
        bounds = self._bounds(decodes, now)
        priced = dict(limit=limit, costs=costs, bounds=bounds, run_positions=self.run_positions)
        self.length = self._chosen = choose_length(self.model, self.stats, contexts, self.k_max, **priced,
                                                   prompt_tokens=prompt_tokens, room=room, beside=beside)
        if prompt_tokens:  # the next step may be one of these decodes alone: drafts are asked for it too
            self._chosen = max(self.length, choose_length(self.model, self.stats, contexts, self.k_max, **priced))
        # Explore both ways: the cost of a draft is measured only on steps that verify drafts, the step-time
        # model only on steps that verify none (:meth:`observe`); a machine on which auto never verified a
        # draft cannot learn that drafts are cheap (a lone decode is bandwidth-bound), one on which every
        # step verifies drafts stops measuring what the decodes alone cost. So after EXPLORE_EVERY steps at
        # 0, a step verifies drafts (k_max or 1 per row, in turn; for a draft model, the next such probe twice
        # as many steps later while drafts cannot pay at the rates' upper bounds, until auto chooses drafts
        # itself: EXPLORE_MAX), and after EXPLORE_EVERY steps with drafts, a step verifies none (no drafts asked
        # for it), at longer intervals while the model predicts those steps (:meth:`observe`); and half way
        # through each EXPLORE_EVERY steps with drafts, a step of decodes alone verifies one draft more where
        # that may pay (:meth:`_longer_may_pay`).
        # A step verifies drafts only where a row has some; steps with a prompt chunk and steps without count
        # theirs apart, since each kind measures its own DraftCost and needs its own probes.
        with_drafts = [r.num_computed_tokens for r in decodes if self.eligible(r) and r.spec_token_ids]
        verifying = self.length > 0 and bool(with_drafts)
        kind = self._kind = int(prompt_tokens > 0)
        self._at_zero[kind] = self._at_zero[kind] + 1 if not verifying and contexts else 0
        if verifying:
            self._probe_every[kind] = EXPLORE_EVERY
        self._steps_with = self._steps_with + 1 if self.length > 0 else 0
        # A probe is judged at the acceptance rates' upper bounds and at the cheaper of two prices of its drafts
        # (the model's, as decode rows, and the learned one): it is what measures them. One that does not fit
        # is put off as many steps again, so that its drafts are asked for on the step before it.
        if self._at_zero[kind] > self._probe_every[kind] and not with_drafts:
            self._at_zero[kind] = self._probe_every[kind]  # nothing to verify (no match, no room): ask again
        elif self._at_zero[kind] > self._probe_every[kind]:
            rates = self.stats.upper_rates()
            chunk = chunk_beside(prompt_tokens, room, len(contexts), 0)
            without = kept(bounds, step_seconds(self.model, contexts, 0, None, chunk), 1.0)  # rows a step at 0 keeps
            probed = with_drafts if self._costly else contexts  # a draft model's: the rows asked

            def fits(k: int) -> bool:  # within the step limit, keeping as many rows in their SLOs as no drafts
                chunk = chunk_beside(prompt_tokens, room, len(probed), k)  # its drafts take prompt tokens' room
                seconds = min(step_seconds(self.model, probed, k, None, chunk),
                              step_seconds(self.model, probed, k, costs, chunk, beside=beside,
                                           run_positions=self.run_positions))
                tokens = self.stats.expected_tokens(rates, k)
                if len(probed) < len(contexts):  # the other rows' step, and what they emit: a token each
                    seconds += step_seconds(self.model, contexts, 0, None, chunk) - \
                        step_seconds(self.model, probed, 0, None, chunk)
                    tokens = 1.0
                return seconds <= limit and kept(bounds, seconds, tokens) >= without

            probe = next((k for k in (self._probe_length(), 1) if fits(k)), 0)
            self._at_zero[kind] = 0
            if probe:
                self.length, self._probes, self._probing = probe, self._probes + 1, self._costly
                # drafts that do not pay need few probes, and a draft model's cost passes; but while they may pay
                # at the rates' upper bounds, the probes measure what decides it, and backed off, the rates of a
                # draft that paid stayed at the few rows of the first probes, whose lower bounds chose none
                if self._costly and not choose_length(self.model, self.stats, contexts, self.k_max, **priced,
                                                      prompt_tokens=prompt_tokens, room=room, beside=beside,
                                                      rates=rates):
                    self._probe_every[kind] = min(2 * self._probe_every[kind], EXPLORE_MAX)
        elif self._steps_with > self._explore_with:
            self.length, self._steps_with, self._judging = 0, 0, True
        elif self._steps_with % EXPLORE_EVERY == EXPLORE_EVERY // 2 and not prompt_tokens and \
                self._longer_may_pay(contexts, costs, limit):
            self.length += 1
        if self._costly:
            self._draft_model_step(running, decodes, contexts, costs, kind)

    def _draft_model_step(self, running: Sequence[Request], decodes: Sequence[Request], contexts: Sequence[int],
                          costs: Optional[Sequence[float]], kind: int) -> None:
        """A draft model's share of :meth:`begin_step`: what a token of the drafts asked for saves, and before a
        probe, its row: the one the draft has the fewest tokens to catch up on (then the shortest context)."""
        self._catching_up, self._asked = 0, set()
        if len(self._seen) > 2 * len(running) + 64:  # forget requests that left
            live = {r.request_id for r in running}
            self._seen = {rid: n for rid, n in self._seen.items() if rid in live}
        k, self._saving = max(self.length, self._chosen), 0.0
        if k and contexts:
            tokens = self.stats.expected_tokens(self.stats.lower_rates(), k)
            drafting = step_seconds(self.model, contexts, k, costs, run_positions=self.run_positions)
            self._saving = (step_seconds(self.model, contexts, 0, None) - drafting / tokens) / len(contexts)
        if self._at_zero[kind] == self._probe_every[kind]:  # the probe's rows
            rows = sorted((r for r in decodes if self.eligible(r) and self._left(r) > 1),
                          key=lambda r: (self._unseen(r), r.num_computed_tokens))
            self._probe_ids = {r.request_id for r in rows[:DRAFT_MODEL_PROBE_ROWS]}

    def _unseen(self, req: Request) -> int:
        """Tokens of ``req``'s context a draft model has not read: all where it never proposed for ``req``, or
        ``req`` was preempted since (the draft dropped what it held)."""
        seen, preemptions = self._seen.get(req.request_id, (0, -1))
        return req.num_tokens - seen if preemptions == req.num_preemptions else req.num_tokens

    def proposed(self, req: Request) -> None:
        """After a step: ``req`` has the drafts the runner proposed for its next step (``req.spec_token_ids``). For
        a draft model, where it was asked: with drafts, the draft has read its whole context; with none, the draft
        dropped what it held (no room for its blocks, or nothing drafted)."""
        if req.request_id not in self._asked:
            return
        if req.spec_token_ids:
            self._seen[req.request_id] = (req.num_tokens, req.num_preemptions)
        else:
            self._seen.pop(req.request_id, None)

    def _worth_catching_up(self, req: Request, probe: bool) -> bool:
        """Whether to ask a draft model for ``req``'s drafts, and if so, note it. A row the draft missed tokens of
        (a new request's prompt, steps it was not asked in) makes it read them first, once, at about a prompt
        token's cost: asked only where the machine seconds its drafts save over the tokens it has left (at the
        step's choice) exceed that, or for a probe. Unpriced, ``auto`` under load asked drafts of rows whose prompts
        the draft had not read, and spent most of a step's time catching up; priced with the drafts, a probe after
        steps without drafts cost its row's whole context, and ``auto`` never verified the drafts of a draft that
        paid (BENCHMARKS.md, "Speculative decoding with a draft model that pays")."""
        unseen = self._unseen(req)
        if unseen >= CATCH_UP_TOKENS:
            seconds, tokens = self._caught_up  # before any was measured, a prompt token's price
            per_token = seconds / tokens if tokens else self.model.coefficients.per_token_s
            if not probe and self._left(req) * self._saving <= unseen * per_token:
                return False
            self._catching_up += unseen
        self._asked.add(req.request_id)
        return True

    def _longer_may_pay(self, contexts: Sequence[int], costs: Optional[Sequence[float]], limit: float) -> bool:
        """Whether one draft more than the chosen length a row may pay, its acceptance read at the upper
        bounds (as a probe's) and the chosen length's at the lower: the step that tries it measures the next
        position's acceptance, which no step at the chosen length does, and varies the drafts a row, which
        tells what a draft costs from what a row verifying any does. Without it ``auto`` at one draft a row
        priced the second at the estimate of a few early rows and could stay at one, where a fixed k = 4
        emitted more (BENCHMARKS.md, "Speculative decoding: drafts beside a prompt chunk")."""
        k = self.length
        if k >= self.k_max:
            return False
        longer = step_seconds(self.model, contexts, k + 1, costs, run_positions=self.run_positions)
        if longer > limit:
            return False
        now = step_seconds(self.model, contexts, k, costs, run_positions=self.run_positions)
        upper, lower = self.stats.upper_rates(), self.stats.lower_rates()
        return self.stats.expected_tokens(upper, k + 1) / longer >= self.stats.expected_tokens(lower, k) / now

    def _bounds(self, decodes: Sequence[Request], now: float) -> list[TPOTBound]:
        """The :class:`~goodserve.spec.length.TPOTBound` of each of the step's ``decodes`` streaming under a TPOT
        SLO, its later steps taking what the ``slo`` policy expects of them (the recent mean step, at least a
        step of these decodes alone)."""
        streaming = [r for r in decodes if SLOPredictor.streams(r)]
        if not streaming:
            return []
        later = self._slo.figures(SLOPredictor.decodes(decodes)).later_step
        return [TPOTBound(r.first_token_time + r.slo_tpot * r.num_output_tokens - now, r.slo_tpot,
                          SLOPredictor.certain_tokens(r), later, r.max_tokens - r.num_output_tokens, self.eligible(r))
                for r in streaming]

    def _probe_length(self) -> int:
        """Drafts per row of the next probe from 0: ``k_max``, then one, in turn. What drafts add to a step
        is a cost per step and per row verifying any, one per draft and one per token of context attention runs
        beyond a row's first read again (:class:`~goodserve.spec.length.DraftCost`, one for steps of decodes
        alone and one for steps with a prompt chunk); probes of one length alone cannot tell them apart, and
        where a row's first draft costs more than each further one, ``k_max`` can pay where one does not."""
        return 1 if self._probes % 2 else self.k_max

    @staticmethod
    def _left(req: Request) -> int:
        """The most drafts worth verifying for ``req``: one fewer than the tokens it may still emit (the last
        comes as the bonus token). This also keeps a draft's position inside ``max_model_len``, since prompt
        plus ``max_tokens`` fit it (:func:`goodserve.scheduler.stop.check_fits`)."""
        return req.max_tokens - req.num_output_tokens - 1

    def drafts(self, req: Request, room: int) -> list[int]:
        """The drafts ``req`` verifies this step: at most the step's length, ``room`` tokens of budget and
        what the request may still emit."""
        room = min(room, self._left(req))
        if not self.eligible(req) or room <= 0:
            return []
        return req.spec_token_ids[:min(self.length, room)]

    def lookahead(self, req: Request) -> int:
        """Drafts the runner should propose for ``req`` after this step (at most what it may then verify): a
        fixed length's; under ``auto`` one more than this step verifies (so it can lengthen), or than its
        decodes alone would where it has a prompt chunk (the next step may have none), at most ``k_max``,
        and none while speculation does not pay but for the step before a probe (for a draft model, only the
        probe's row, in a step of the probe's kind: with a prompt chunk or without), nor for a step that checks
        the model without drafts. A draft model's probe step asks for what ``auto`` chose, not for the probe's
        length again: after a probe that did not pay, the next step verifies none, and the draft's ``k_max``
        passes for it were thrown away. Prompt lookup's cost little, and let the step after a probe that paid
        verify at once. A draft model is not asked for a row whose catch-up costs more than its drafts save
        (:meth:`_worth_catching_up`), but for a probe."""
        room = self._left(req) - 1  # after this step's token
        return min(self._lookahead(req), room) if room > 0 else 0

    def _lookahead(self, req: Request) -> int:
        if not self.eligible(req):
            return 0
        if self.config.length != "auto":
            return self.length
        # after a probe without drafts, or a step with a prompt chunk; a probe with drafts: what auto chose
        ahead = self._chosen if self._probing else max(self.length, self._chosen)
        if self.length and self._steps_with == self._explore_with:
            return 0  # the next step checks the model without drafts
        if ahead and (not self._costly or self._worth_catching_up(req, False)):
            return min(self.k_max, ahead + 1)
        # a draft model's row whose catch-up auto's choice does not repay still takes its probes: were it asked
        # for none, a server whose every row the draft had not read never measured what the drafts cost, and
        # auto's choice stayed at its price of drafts never measured (BENCHMARKS.md, "Speculative decoding with a
        # draft model under load")
        if not self._costly:  # prompt lookup: before a probe of either kind (asking costs little)
            before_probe = any(n == every for n, every in zip(self._at_zero, self._probe_every))
        else:  # a draft model: the probe's row, before a probe of this step's kind (asking costs passes)
            before_probe = self._at_zero[self._kind] == self._probe_every[self._kind] and \
                req.request_id in (self._probe_ids or ()) and self._worth_catching_up(req, True)
        return self._probe_length() if before_probe else 0  # for a probe with drafts

    def observe(self, out: SchedulerOutput, seconds: float, proposing: float = 0.0,
                catching_up: float = 0.0) -> Optional[tuple[StepShape, float]]:
        """A step took ``seconds``, ``proposing`` of them proposing drafts for the next step (``catching_up`` of
        those a draft model's reading of context it had missed): what the step-time model should learn from it,
        as ``(shape, seconds)``, or ``None``. At a fixed length, every step as it ran.
        Under ``auto`` a draft has a decode row's figures but not its cost, and a model fitted on both would
        misprice each, so: a step without drafts as it ran, but for its proposing; a step with drafts teaches
        the cost of a draft instead (:class:`~goodserve.spec.length.DraftCost`), one learned on steps of
        decodes alone and one on steps with a prompt chunk: the two take different paths
        (:func:`~goodserve.spec.length.step_seconds`); but not a step that stalled (:data:`STALL`).

        Proposing is a cost of the drafts proposed, so it is moved to the step that verifies them: a step with
        drafts teaches its own seconds plus what the step before spent proposing; a draft model's passes are timed
        and fitted apart (:class:`~goodserve.spec.propose_cost.ProposeCost`), its steps with drafts teaching what
        verifying them added alone. Learned where it was spent,
        a draft model's passes were a cost of every step that proposed: the step-time model priced a step
        without drafts at what a step with them took, drafts looked free, and ``auto`` verified drafts a draft
        model almost never got accepted, below the output rate of no drafts (BENCHMARKS.md, "Speculative
        decoding with a draft model"). But not the catching up: a draft model reads the context it missed (a new
        request's prompt, the steps it was not asked in) once per row, whatever the drafts; priced with them, a
        probe after steps without drafts cost its row's whole context, and ``auto`` never verified the drafts of
        a draft that paid (BENCHMARKS.md, "Speculative decoding with a draft model that pays").

        The first step without drafts after ``auto`` chose none to check the model is judged before the model
        learns it: predicted within :data:`PROBE_TOLERANCE`, the steps with drafts before the next such check
        double (up to :data:`EXPLORE_MAX`); missed after one that held, they fall back to
        :data:`EXPLORE_EVERY`; missed after one that missed, they double too. A model whose form cannot fit
        these steps (fitted mostly on steps with a prompt chunk: steps of decodes without drafts are only
        these checks under load) misses every check, and checking at the shortest interval then gave up
        drafts' tokens for no better fit (BENCHMARKS.md, "Speculative decoding: drafts beside a prompt
        chunk")."""
        if self.config.length != "auto":
            return StepShape.of(out), seconds
        own, proposed, self._proposed = max(0.0, seconds - proposing), self._proposed, proposing - catching_up
        if catching_up > 0 and self._catching_up >= CATCH_UP_MEASURED:
            keep = 1 - CATCH_UP_WEIGHT
            self._caught_up = [keep * self._caught_up[0] + catching_up, keep * self._caught_up[1] + self._catching_up]
        if self._costly:
            self.propose.observe(proposing - catching_up, [s.num_lookahead for s in out.scheduled])
        num_drafts = sum(len(s.spec_token_ids) for s in out.scheduled)
        if self._judging and not num_drafts:
            self._judging = False
            predicted = self.model.predict_shape(StepShape.of(out))
            held = abs(own - predicted) <= PROBE_TOLERANCE * predicted
            again = held or not self._held  # a second miss in a row: more checks have not mended the model
            self._explore_with = min(2 * self._explore_with, EXPLORE_MAX) if again else EXPLORE_EVERY
            self._held = held
        if num_drafts:
            alone = all(s.num_new_tokens == 1 + len(s.spec_token_ids) for s in out.scheduled)
            num_rows = sum(1 for s in out.scheduled if s.spec_token_ids)
            reread = sum(reread_ktokens(len(s.spec_token_ids), self.run_positions, [s.num_computed_tokens])
                         for s in out.scheduled)
            without = self.model.predict_shape(StepShape.of(out, drafts=False))
            if own <= STALL * max(without, self.model.predict_shape(StepShape.of(out))):
                cost = self.cost if alone else self.cost_beside  # a draft model's passes are timed apart
                cost.observe(without, own if self._costly else own + proposed, num_rows, num_drafts, reread)
            return None
        return StepShape.of(out), own

    def record(self, num_drafts: int, num_accepted: int) -> None:
        """One row verified ``num_drafts`` drafts and accepted the first ``num_accepted``."""
        self.stats.record(num_drafts, num_accepted)

    def stats_fields(self) -> dict:
        """The counters, as :class:`~goodserve.scheduler.output.SchedulerStats` fields."""
        s = self.stats
        return dict(num_spec_drafts_total=s.num_drafts, num_spec_draft_tokens_total=s.num_draft_tokens,
                    num_spec_accepted_tokens_total=s.num_accepted_tokens,
                    spec_accepted_per_pos=tuple(s.accepted_per_pos), spec_length=self.length)
