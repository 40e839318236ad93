"""A draft model's passes, timed where they run and priced apart from what verifying its drafts costs (issue 33)."""

from __future__ import annotations

import pytest

from factories import create_requests
from goodserve.scheduler.output import ScheduledRequest, SchedulerOutput
from goodserve.scheduler.step_time import StepCoefficients, StepTimeModel
from goodserve.spec.config import SpeculativeConfig
from goodserve.spec.length import step_seconds
from goodserve.spec.propose_cost import ProposeCost
from goodserve.spec.speculator import Speculator


def test_the_passes_and_the_drafts_are_told_apart_where_the_proposals_vary():
    """Proposals timed at exactly 5 ms a pass and 1 ms a draft asked, in three shapes (one row asked 8, ten rows 4,
    three rows 1): the fit gives both back, within what its ridge moves them (here 7.5% off the pass, 5% off a draft:
    the ridge is 5% of the passes' sum of squares)."""
    cost = ProposeCost()
    assert cost.costs() is None
    for lookaheads in ([8], [4] * 10, [1] * 3, [0, 0]):  # the last asked nothing: not a proposal
        cost.observe(0.005 * max(lookaheads) + 0.001 * sum(lookaheads), lookaheads)
    assert cost.num_steps == 3
    per_pass, per_draft = cost.costs()
    assert per_pass == pytest.approx(0.005, rel=0.1) and per_draft == pytest.approx(0.001, rel=0.1)


def test_one_row_proposals_are_priced_on_the_drafts():
    """One row asked each time (as a probe): a pass is a draft, and the fit cannot tell them apart. The ridge puts
    the 6 ms on the draft, so many rows' drafts look dear until proposals for several rows are measured; put on
    the pass, 57 rows' 4 drafts would cost 24 ms where the draft's passes over them take several times that."""
    cost = ProposeCost()
    for k in (8, 1, 8, 1):
        cost.observe(0.006 * k, [k])
    per_pass, per_draft = cost.costs()
    assert per_draft == pytest.approx(0.006, rel=0.01) and per_pass < 0.0001


def test_the_draft_models_passes_are_priced_on_top_of_verifying():
    """``priced`` adds the passes to the verifying costs: the per-draft figures summed, the per-pass one fifth,
    which :func:`step_seconds` charges ``k`` times a step; verifying not yet measured is priced at a prompt token
    a draft; nothing measured stays ``None`` (the step-time model's price of drafts as decode rows)."""
    assert ProposeCost.priced(None, None, 0.001) is None
    assert ProposeCost.priced((0.01, 0.002, 0.003, 0.1), None, 0.001) == (0.01, 0.002, 0.003, 0.1)
    assert ProposeCost.priced(None, (0.005, 0.002), 0.001) == (0.0, 0.0, 0.003, 0.0, 0.005)
    assert ProposeCost.priced((0.01, 0.002, 0.003, 0.1), (0.005, 0.002), 0.001) == (0.01, 0.002, 0.005, 0.1, 0.005)
    model = StepTimeModel(StepCoefficients(0.01, 0.001, 0.0, 0.0), adapt=False)
    verifying = step_seconds(model, [100] * 10, 4, (0.01, 0.002, 0.005, 0.0))
    assert step_seconds(model, [100] * 10, 4, (0.01, 0.002, 0.005, 0.0, 0.005)) == pytest.approx(verifying + 0.02)


def test_auto_with_a_draft_model_prices_the_passes_it_measured():
    """Model: 10 ms a step, 1 ms a token. At 20 rows every draft is accepted, and priced as a decode row (1 ms)
    ``auto`` chooses 4. Then a step in which one row was asked for 4 drafts spent 0.2 s proposing them, 0.1 s of it
    catching up: 25 ms a draft asked. Its verifying is not learned from that (the draft cost keeps no step), and
    priced with the passes at 20 rows ``auto`` chooses none."""
    model = StepTimeModel(StepCoefficients(0.01, 0.001, 0.0, 0.0), adapt=False)
    spec = Speculator(SpeculativeConfig("draft_model", 4, model="draft"), model)
    for _ in range(500):
        spec.record(4, 4)
    reqs = create_requests(20, prompt_len=100, max_tokens=100)
    for r in reqs:
        r.num_computed_tokens = r.num_tokens - 1
    spec.begin_step(reqs)
    assert spec.length == 4
    step = SchedulerOutput(scheduled=[ScheduledRequest(r.request_id, r.num_computed_tokens, 1, sample=True,
                                                       num_lookahead=4 if i == 0 else 0)
                                      for i, r in enumerate(reqs)])
    spec.observe(step, 0.25, proposing=0.2, catching_up=0.1)
    assert spec.propose.costs()[1] == pytest.approx(0.025, rel=0.01) and spec.cost.costs() is None
    spec.begin_step(reqs)
    assert spec.length == 0
