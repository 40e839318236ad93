"""Speculative decoding (issue 33): n-gram proposals, verification in the normal step, the length chosen for
goodput. With speculation a request's tokens are exactly those it gets without (greedy, and seeded sampling
too, since each position is sampled with the noise sequential decoding would use), unseeded sampling keeps
the target's distribution (chi-square against the exact distribution of a tiny-vocabulary model), and the
slots of rejected drafts are freed (exact block counts, ``check_integrity()`` after every step)."""

from __future__ import annotations

import dataclasses
import itertools
import math

import numpy as np
import pytest
import torch

from factories import create_requests
from goodserve import LLM, SamplingParams
from goodserve.config import CacheConfig, SchedulerConfig
from goodserve.models.invariant_attention import InvariantAttentionBackend
from goodserve.sampling_params import StructuredOutputsParams
from goodserve.scheduler.output import SampledToken, ScheduledRequest, SchedulerOutput, StepShape
from goodserve.scheduler.scheduler import Scheduler
from goodserve.scheduler.step_time import StepCoefficients, StepTimeModel
from goodserve.spec.config import SpeculativeConfig
from goodserve.spec.length import (COST_RIDGE, AcceptanceStats, DraftCost, TPOTBound, choose_length,
                                   extra_runs, nonnegative_solve, reread_ktokens, step_seconds)
from goodserve.spec.ngram import NgramProposer
from goodserve.spec.speculator import EXPLORE_EVERY, Speculator
from tiny_models import make_tiny_hf_model

NGRAM = '{"method": "ngram", "num_speculative_tokens": 4}'


# ------------------------------------------------------------------------------------------ proposals
def test_ngram_proposes_what_followed_the_latest_earlier_occurrence_of_the_suffix():
    p = NgramProposer(1, 3)
    assert p.propose([1, 2, 3, 4, 1, 2, 3], 3) == [4, 1, 2]  # suffix [1, 2, 3] at 0
    assert p.propose([9, 1, 2, 9, 1, 2, 3, 9, 1, 2], 2) == [3, 9]  # the latest of two occurrences
    assert p.propose([5, 1, 7, 7, 1], 2) == [7, 7]  # no 3- or 2-token match: the 1-token one
    assert p.propose([7, 7, 7, 7, 7], 3) == [7, 7]  # the latest followed by 3 tokens does not exist: earliest
    assert p.propose([5, 6, 7, 8, 9], 2) == [] and p.propose([1, 2, 1], 0) == []
    assert NgramProposer(2, 3).propose([4, 1, 5, 1], 2) == []  # a 1-token match is below min_n


@pytest.mark.parametrize("text, length, error", [
    ('{"method": "medusa", "num_speculative_tokens": 2}', None, "method must be one of"),
    ('{"method": "ngram"}', None, "needs 'method' and 'num_speculative_tokens'"),
    ('{"method": "ngram", "num_speculative_tokens": 2, "k": 1}', None, "unknown key"),
    ('{"method": "ngram", "num_speculative_tokens": 2}', "3", "integer in \\[0, num_speculative_tokens=2\\]"),
    ('{"method": "ngram", "num_speculative_tokens": 2}', "long", "'auto' or an integer"),
    ('{"method": "draft_model", "num_speculative_tokens": 2}', None, "needs a 'model'"),
    ('[1]', None, "JSON object"), ('{"method": ', None, "not valid JSON"),
    (None, "3", "needs --speculative-config"),
])
def test_speculative_config_refuses_what_it_cannot_run(text, length, error):
    with pytest.raises(ValueError, match=error):
        SpeculativeConfig.from_cli(text, length)


# ------------------------------------------------------------------------------------------ length
def test_acceptance_rates_are_conditional_per_position():
    stats = AcceptanceStats(3)
    assert stats.rates() == [0.5, 0.5, 0.5]  # the prior
    stats.record(3, 3)
    stats.record(3, 1)
    stats.record(2, 0)
    assert (stats.num_drafts, stats.num_draft_tokens, stats.num_accepted_tokens) == (3, 8, 4)
    assert stats.accepted_per_pos == [2, 1, 1]
    # Reached: position 1 by all three rows, position 2 by the two that accepted draft 1, position 3 by one;
    # each record first decays the counts by d.
    # Each position is shrunk toward the position before it with two pseudo-rows.
    d = 0.998
    a1 = (d * d + d + 1) / (d * d + d + 3)
    a2 = (d * d + 2 * a1) / (d * d + d + 2)
    a3 = (d * d + 2 * a2) / (d * d + 2)
    assert stats.rates() == pytest.approx([a1, a2, a3])
    fresh = AcceptanceStats(3)
    for _ in range(100):
        fresh.record(1, 1)  # only the first position measured: the others are priced like it
    assert fresh.rates()[2] == fresh.rates()[1] == fresh.rates()[0] > 0.95
    assert AcceptanceStats.expected_tokens([0.5, 0.5], 2) == 1.75 and AcceptanceStats.expected_tokens([], 0) == 1


def _stats_at(alpha: float) -> AcceptanceStats:
    """Acceptance statistics of ~500 rows at ``alpha`` at every position. :func:`choose_length` prices drafts
    at the rates' lower bound, 0.780-0.781 for 0.8; the figures in the docstrings below are at 0.8 where the
    choice is the same at both."""
    stats = AcceptanceStats(4)
    for _ in range(2000):
        stats.record(4, 4)
    stats._accepted = [alpha * r for r in stats._reached]
    return stats


def test_auto_length_speculates_while_steps_are_cheap_and_stops_under_load():
    """A step costs ``10 ms + 1 ms`` per token, and each draft is accepted with probability 0.8. At batch 1,
    4 drafts (a 15-ms step) emit ``1 + .8 + .64 + .512 + .41 = 3.36`` tokens: 0.224 tokens/ms against 0.091
    without, and more than 3 drafts give (0.211), so ``k = 4``. With 64 rows a plain step takes 74 ms (0.865
    tokens/ms) and one draft each 138 ms for 1.8 tokens a row (0.835): ``k = 0``. Within a 13.5-ms budget at
    batch 1, 3 drafts (14 ms) are out and 2 (13 ms, 0.188) beat 1 (12 ms, 0.150)."""
    model = StepTimeModel(StepCoefficients(0.010, 0.001, 0.0, 0.0), adapt=False)
    stats = _stats_at(0.8)
    assert stats.rates() == pytest.approx([0.8] * 4, abs=2e-3)  # the prior weighs ~2 of ~500 rows
    assert choose_length(model, stats, [100], 4) == 4
    assert choose_length(model, stats, [100] * 64, 4) == 0
    assert choose_length(model, stats, [100], 4, limit=0.0135) == 2
    assert choose_length(model, stats, [], 4) == 0
    # Drafts priced at 0.5 ms each (not the model's 1 ms a row): with 64 rows, k drafts make a 74 + 32 k ms
    # step emitting 64 E[k] tokens: 0.865, 1.087, 1.132, 1.111, 1.065 tokens/ms for k = 0..4. With 0.5 ms
    # more for each row that verifies any (32 ms a step), 0.835, 0.919, 0.935, 0.919 for k = 1..4: 3. With
    # 4 ms a row, no k beats 0.865.
    assert choose_length(model, stats, [100] * 64, 4, costs=(0.0, 0.0, 0.0005, 0.0)) == 2
    assert choose_length(model, stats, [100] * 64, 4, costs=(0.0, 0.0005, 0.0005, 0.0)) == 3
    assert choose_length(model, stats, [100] * 64, 4, costs=(0.0, 0.004, 0.0005, 0.0)) == 0


def test_auto_length_prices_drafts_at_their_measured_cost_even_above_a_decode_row():
    """Issue 33: where plain decodes run on a faster path than rows with drafts (the one-call decode step), a
    draft costs more than a decode row, and auto must price it so. Model: 10 ms + 1 ms a decode row; measured:
    4 ms a row verifying drafts and 3 ms a draft; acceptance 0.8. At batch 8, one draft a row makes a
    18 + 32 + 24 = 74-ms step for 14.4 tokens (0.195 tokens/ms) against 8 in 18 ms (0.444): k = 0. (Capped at
    the model's price of 16 decode rows, 26 ms, it looked like 0.554 and auto speculated.) At batch 1, 4 drafts
    (27 ms, 3.36 tokens: 0.1245) still beat none (0.0909) and 3 (24 ms, 0.1230)."""
    model = StepTimeModel(StepCoefficients(0.010, 0.001, 0.0, 0.0), adapt=False)
    stats = _stats_at(0.8)
    assert choose_length(model, stats, [100] * 8, 4, costs=(0.0, 0.004, 0.003, 0.0)) == 0
    assert choose_length(model, stats, [100], 4, costs=(0.0, 0.004, 0.003, 0.0)) == 4


def test_auto_length_falls_to_zero_while_prompts_wait():
    """Issue 33, past the knee: beside a prompt chunk a draft must earn more decode time than it adds. Model:
    10 ms + 1 ms a token (a decode token and a prompt token each worth 1 ms); acceptance 0.8. Alone, one
    row verifies 4 drafts (3.36 tokens in 15 ms). Beside 512 waiting prompt tokens, 4 drafts make 515.4 ms
    of work in 527 ms (0.978) against 513 in 523 (0.981): k = 0. Beside 2 prompt tokens (a prompt's tail)
    drafts still pay: 5.36 ms of work in 17 ms against 3 in 13."""
    model = StepTimeModel(StepCoefficients(0.010, 0.001, 0.0, 0.0), adapt=False)
    stats = _stats_at(0.8)
    assert choose_length(model, stats, [100], 4) == 4
    assert choose_length(model, stats, [100], 4, prompt_tokens=512) == 0
    assert choose_length(model, stats, [100], 4, prompt_tokens=2) == 4


def test_auto_asks_for_drafts_beside_a_prompt_chunk_for_the_step_after_it():
    """A step beside 512 prompt tokens verifies no drafts (the test above's figures), but the next step may be
    one of the decodes alone, where 4 pay: the runner is asked for 4 drafts, so that step has them to verify
    (asked for none, it would verify none whatever it chose)."""
    model = StepTimeModel(StepCoefficients(0.010, 0.001, 0.0, 0.0), adapt=False)
    spec = Speculator(SpeculativeConfig("ngram", 4), model)
    spec.stats = _stats_at(0.8)
    (r,) = create_requests(1, prompt_len=100, max_tokens=50)
    r.num_computed_tokens = 100
    r.append_output_token(7)
    spec.begin_step([r], prompt_tokens=512)
    assert spec.length == 0 and spec.lookahead(r) == 4
    spec.begin_step([r])
    assert spec.length == 4 and spec.lookahead(r) == 4


def test_auto_length_prices_drafts_beside_a_prompt_chunk_on_the_step_time_model():
    """Issue 33: what verifying costs on steps of decodes alone (here 4 ms a row verifying and 3 ms a draft:
    the change from the one-call decode step to the chunk path) is no cost beside a prompt chunk, where the
    step runs layer by layer whatever its drafts; there a draft is one more token and sampled row, priced by
    the model. Model: 10 ms + 1 ms a token; acceptance 0.8; 8 rows. Alone, at those costs, no draft pays (the
    test above). Beside a 2-token prompt tail, k drafts a row make a 20 + 8 k ms step for 8 E[k] + 2 ms of
    work: 0.5, 0.586, 0.598, 0.582, 0.556 for k = 0..4, so k = 2 whatever the measured costs (priced at them,
    0). Beside 512 prompt tokens, drafts that cost a decode row do not pay: 0."""
    model = StepTimeModel(StepCoefficients(0.010, 0.001, 0.0, 0.0), adapt=False)
    stats = _stats_at(0.8)
    measured = (0.0, 0.004, 0.003, 0.0)
    assert choose_length(model, stats, [100] * 8, 4, costs=measured) == 0
    assert choose_length(model, stats, [100] * 8, 4, costs=measured, prompt_tokens=2) == 2
    assert choose_length(model, stats, [100] * 8, 4, prompt_tokens=2) == 2
    assert choose_length(model, stats, [100] * 8, 4, costs=measured, prompt_tokens=512) == 0


def test_auto_length_prices_drafts_beside_a_prompt_chunk_at_their_cost_there():
    """Issue 33: where a row's positions share one read of its context, a draft beside a prompt chunk costs far
    less than the model's decode row (on the AMX host the model fitted ~2.1 ms a decode row, a draft cost
    ~0.7 ms), and priced as a decode row ``auto`` verified no draft beside any chunk while a fixed k = 4 did.
    Model: 10 ms + 1 ms a token; acceptance 0.8; 8 rows beside 512 prompt tokens. Priced on the model, drafts
    do not pay there (the test above). Measured on steps with a chunk at 0.2 ms a draft, a draft worth 0.8 ms of
    decode time pays: 4 drafts a row make 512 + 8 · 3.36 ms of work in 536.4 ms (1.0046) against 520 in 530
    (0.9811). Measured at 1 ms a draft, none pay, though the steps of decodes alone price a draft at 0.2 ms.
    Before a step with a chunk has measured them, a draft is priced at the cheaper of the model's price and
    those of the steps of decodes alone without their fixed term: 0.2 ms a draft (not the fixed 50 ms)
    verifies 4, and with 4 ms a row more, the model's price (none)."""
    model = StepTimeModel(StepCoefficients(0.010, 0.001, 0.0, 0.0), adapt=False)
    stats = _stats_at(0.8)
    contexts = [100] * 8
    assert choose_length(model, stats, contexts, 4, prompt_tokens=512) == 0
    assert choose_length(model, stats, contexts, 4, prompt_tokens=512, beside=(0.0, 0.0, 0.0002, 0.0)) == 4
    assert choose_length(model, stats, contexts, 4, costs=(0.0, 0.0, 0.0002, 0.0), prompt_tokens=512,
                         beside=(0.0, 0.0, 0.001, 0.0)) == 0
    assert choose_length(model, stats, contexts, 4, costs=(0.050, 0.0, 0.0002, 0.0), prompt_tokens=512) == 4
    assert choose_length(model, stats, contexts, 4, costs=(0.050, 0.004, 0.0002, 0.0), prompt_tokens=512) == 0
    assert step_seconds(model, contexts, 4, (0.050, 0.0, 0.0002, 0.0), 512) == pytest.approx(0.530 + 32 * 0.0002)
    assert step_seconds(model, contexts, 4, None, 512) == pytest.approx(0.530 + 0.032)


def test_auto_length_prices_each_further_attention_run():
    """Issue 33: where the attention kernel takes a row's positions in runs (the AMX kernel: 5 positions a run
    for 3 query heads a KV head), each run beyond the first attends the row's context again, and a fixed
    k = 4 beat auto's choice of 5-8 drafts: at 16 rows over 700 tokens a step took 68 ms at 4 drafts a row,
    97 at 5. Model: 10 ms + 1 ms a token; 16 rows; acceptance 0.9 (priced at 0.886); 0.4 ms a draft. Without
    runs 5 drafts pay best (4.518 tokens a row in 58 ms, against 3.974 in 51.6 at 4); at 1.6 ms a further run
    of 5 positions over 100 tokens of context (16 µs a token read again), 4 (83.6 ms at 5). The speculator
    learns that cost from the steps, and counts the context a step's further runs read by the runner's run
    length."""
    model = StepTimeModel(StepCoefficients(0.010, 0.001, 0.0, 0.0), adapt=False)
    stats = AcceptanceStats(8)
    for _ in range(2000):
        stats.record(8, 8)
    stats._accepted = [0.9 * r for r in stats._reached]
    costs = (0.0, 0.0, 0.0004, 0.016)  # the last per thousand tokens read again
    assert [extra_runs(k, 5) for k in (0, 4, 5, 9, 10)] == [0, 0, 1, 1, 2] and extra_runs(30, None) == 0
    assert choose_length(model, stats, [100] * 16, 8, costs=costs) == 5
    assert choose_length(model, stats, [100] * 16, 8, costs=costs, run_positions=5) == 4
    assert step_seconds(model, [100] * 16, 5, costs, run_positions=5) == pytest.approx(0.026 + 16 * (0.002 + 0.0016))
    cost = DraftCost()
    for rows, k, context in ((16, 4, 100), (16, 5, 100), (8, 8, 400), (16, 1, 100), (4, 9, 1000), (16, 8, 200)):
        reread = reread_ktokens(k, 5, [context] * rows)
        assert reread == rows * extra_runs(k, 5) * context / 1000
        cost.observe(0.050, 0.050 + rows * k * 0.0004 + reread * 0.016, rows, rows * k, reread)
    assert cost.costs() == pytest.approx((0.0, 0.0, 0.0004, 0.016), abs=2e-5)
    spec = Speculator(SpeculativeConfig.from_cli('{"method": "ngram", "num_speculative_tokens": 8}', None), model)
    spec.run_positions = 5
    out = SchedulerOutput(scheduled=[ScheduledRequest("a", 10, 7, sample=True, spec_token_ids=[5] * 6),
                                     ScheduledRequest("b", 20, 3, sample=True, spec_token_ids=[6, 7])])
    assert spec.observe(out, 0.030) is None  # predicted without drafts: 12 ms; a's 10 tokens read again
    assert spec.cost._xtx[3, 3] == pytest.approx(1e-4) and spec.cost._xty[3] == pytest.approx(0.01 * 0.018)


def test_the_amx_attention_holds_16_query_rows_of_a_row_a_run():
    """What the speculator prices further runs by: on the AMX kernel a run holds ``16 // (query heads per KV
    head)`` positions of a row (5 for SmolLM2-135M's 9 heads over 3); no runs where the kernel does not
    run (another dtype, a group over 16, no AMX)."""
    backend = InvariantAttentionBackend(use_native=False)
    assert backend.run_positions(9, 3, 64, torch.bfloat16) is None
    backend.amx = True  # as on a host with AMX and the native kernels built
    assert backend.run_positions(9, 3, 64, torch.bfloat16) == 5
    assert backend.run_positions(32, 8, 128, torch.bfloat16) == 4
    assert backend.run_positions(9, 3, 64, torch.float32) is None
    assert backend.run_positions(48, 2, 64, torch.bfloat16) is None


def test_auto_length_keeps_the_rows_tpot_slos():
    """Issue 33: ``auto`` maximises work per second within each row's TPOT bound: for a row that may end with
    the step, what it banked ``a`` plus its 200-ms SLO for each token the step emits beyond one. Model: 10 ms
    + 1 ms a token; acceptance 0.8; one row beside 512 prompt tokens. Without drafts the step takes 523 ms.
    ``a = 0.2`` (a fresh row, nothing banked: ``T / E[k] <= 200 ms``): k = 2 needs 525 <= 200 + 288 (out),
    k = 3 526 <= 590 and k = 4 527 <= 672; of these k = 3 has the higher rate (0.97899 against 0.97792).
    ``a = 0.3``: k = 2 fits too (525 <= 588), and its rate is higher (0.97989). ``a = 1`` (a row ahead of its
    SLO lends the step its bank): every k fits and k = 0 has the best rate (0.98088). ``a = 0``: no k fits,
    the rate decides: 0. The tightest row decides; without a chunk, 4 drafts fit (15 ms)."""
    model = StepTimeModel(StepCoefficients(0.010, 0.001, 0.0, 0.0), adapt=False)
    stats = _stats_at(0.8)
    assert choose_length(model, stats, [100], 4, prompt_tokens=512, bounds=[TPOTBound(0.2, 0.2)]) == 3
    assert choose_length(model, stats, [100], 4, prompt_tokens=512, bounds=[TPOTBound(0.3, 0.2)]) == 2
    assert choose_length(model, stats, [100], 4, prompt_tokens=512, bounds=[TPOTBound(1.0, 0.2)]) == 0
    assert choose_length(model, stats, [100], 4, prompt_tokens=512, bounds=[TPOTBound(0.0, 0.2)]) == 0
    both = [TPOTBound(1.0, 0.2), TPOTBound(0.3, 0.2)]
    assert choose_length(model, stats, [100], 4, prompt_tokens=512, bounds=both) == 2
    assert choose_length(model, stats, [100], 4, bounds=[TPOTBound(0.2, 0.2)]) == 4


def test_auto_length_keeps_a_row_behind_long_prompt_steps_by_drafts_in_later_steps_too():
    """Issue 33: a fresh row certain to emit 50 more tokens, later steps taking 523 ms like this one (a burst of
    long prompt chunks; model and acceptance as above). At a token a step it ends at a TPOT of ~523 ms, over
    its 200-ms SLO whatever this step does; emitting ``E[k]`` tokens in this step and each later one, it ends
    within it from k = 3 on (``0.2 + 49 · 0.2 - (50 - E) · 0.523 / E``: 1.40 s at k = 3 against -0.42 at
    k = 2), so ``auto`` verifies 3 drafts, the better rate of 3 and 4. Held to later steps of one token, the
    row was lost at every k and the rate chose none, as it still does for a row lost at every k (-100 s
    banked), which does not stop the other row from being kept. A row that may end any time but may also emit
    50 more tokens is held to both ends: from k = 3 on each later step gains it time (``L / E < s``), so the
    binding end is now (1.87 tokens beyond the first: 0.573 s); at k = 2 later steps lose it time, and at 50
    tokens it ends over its SLO; without a most, it is lost wherever later steps lose it time. A row with one
    token left emits one whatever k (its drafts stop there): drafts do not keep it."""
    model = StepTimeModel(StepCoefficients(0.010, 0.001, 0.0, 0.0), adapt=False)
    stats = _stats_at(0.8)
    behind = TPOTBound(0.2, 0.2, left=50, later=0.523, most=50)
    assert choose_length(model, stats, [100], 4, prompt_tokens=512, bounds=[behind]) == 3
    assert choose_length(model, stats, [100], 4, prompt_tokens=512, bounds=[TPOTBound(-100.0, 0.2)]) == 0
    assert choose_length(model, stats, [100], 4, prompt_tokens=512, bounds=[TPOTBound(-100.0, 0.2), behind]) == 3
    assert behind.seconds(1.0) == pytest.approx(0.2 + 49 * (0.2 - 0.523))  # the slo policy's allowance
    unsure = TPOTBound(0.2, 0.2, left=1, later=0.523, most=50)
    assert choose_length(model, stats, [100], 4, prompt_tokens=512, bounds=[unsure]) == 3
    assert unsure.seconds(3.0) == pytest.approx(0.2 + 2 * 0.2)
    assert unsure.seconds(2.0) == pytest.approx(0.2 + 0.2 + 48 * (0.2 - 0.523 / 2))
    assert TPOTBound(0.2, 0.2, later=0.523).seconds(2.0) == -math.inf
    assert TPOTBound(-0.1, 0.2, later=0.3, most=1).seconds(3.36) == pytest.approx(-0.1)  # its last token: no drafts


def test_auto_length_holds_later_steps_to_what_their_drafts_cost():
    """The row of the test above, behind long prompt steps, in a step of decodes alone (11 ms), its drafts priced
    at 0.1 s each. Held to later steps of 523 ms, 3 drafts (311 ms, 2.87 tokens) kept it: 1.40 s allowed. But
    later steps that emit as many tokens verify as many drafts: at 823 ms each lose it time, and at 50 tokens
    it ends over its SLO; it is lost at every k, and the rate chooses none. Before, ``auto`` with a draft model
    under load chose drafts priced at many times a step without them (BENCHMARKS.md, "Speculative decoding with
    a draft model under load"). Drafts of 10 ms keep it still (3)."""
    model = StepTimeModel(StepCoefficients(0.010, 0.001, 0.0, 0.0), adapt=False)
    stats = _stats_at(0.8)
    behind = TPOTBound(0.2, 0.2, left=50, later=0.523, most=50)
    tokens = stats.expected_tokens(stats.lower_rates(), 3)
    assert behind.seconds(tokens) == pytest.approx(0.2 + 0.2 * (tokens - 1) + (50 - tokens) * (0.2 - 0.523 / tokens))
    later = (0.2 - 0.823 / tokens) * (50 - tokens)  # each later step 0.3 s dearer: it loses the row time
    assert behind.seconds(tokens, 0.3) == pytest.approx(0.2 + 0.2 * (tokens - 1) + later)
    assert behind.seconds(tokens, 0.3) < 0
    assert choose_length(model, stats, [100], 4, costs=(0.0, 0.0, 0.1, 0.0), bounds=[behind]) == 0
    assert choose_length(model, stats, [100], 4, costs=(0.0, 0.0, 0.01, 0.0), bounds=[behind]) == 3


def test_auto_length_counts_the_prompt_tokens_drafts_displace():
    """Drafts and prompt chunks share the budget the decodes leave. Model: 10 ms + 1 ms a token; acceptance
    0.8 over ~490 rows, priced at its lower bound 0.780 (0.781 past the first draft); one row and 4 prompt
    tokens waiting. With room for more, 3 drafts make 2.866 + 4 ms of work in 18 ms (0.3815) against 3.238 + 4
    in 19 at k = 4 (0.3810) and 5 in 15 at 0 (0.333): k = 3. With room for 4 tokens, k drafts leave 4 - k
    prompt tokens: the step takes 15 ms whatever k, for 1 + 4 = 5 ms of work at k = 0, 1.78 + 3 at 1, ...
    3.24 at 4: k = 0."""
    model = StepTimeModel(StepCoefficients(0.010, 0.001, 0.0, 0.0), adapt=False)
    stats = _stats_at(0.8)
    assert choose_length(model, stats, [100], 4, prompt_tokens=4) == 3
    assert choose_length(model, stats, [100], 4, prompt_tokens=4, room=4) == 0


def test_auto_reads_the_tpot_bounds_of_its_decode_rows():
    """The speculator passes ``choose_length`` the TPOT bound of each row that decodes this step, with later steps at
    the recent step time (300 ms here). A fresh row (its first token just out) that may end with the step may wait
    200 ms a token: beside 512 prompt tokens, 3 drafts (the test above). A row that streamed 5 tokens in 200 ms has
    banked 800 ms: the step fits without drafts, and the rate picks none. A row still prefilling does not count, nor
    does a row without an SLO. A row under a grammar verifies no drafts but waits for the step, one token a step
    whatever k, each later one 300 ms over a 200-ms SLO: lost at every k (bound at its ``max_tokens``: -0.4 s), it
    does not stop the fresh row beside it from verifying 3 drafts. A fresh row certain to emit 7 more tokens
    (``ignore_eos``), each later step 300 ms: at one token a step it ends over its SLO (-0.4 s), at ``E[k]`` a step
    within it from k = 2 on (k = 1: 0.520 s against a 0.524-s step), and k = 2 has the best rate of those."""
    model = StepTimeModel(StepCoefficients(0.010, 0.001, 0.0, 0.0), adapt=False)
    model.recent_step_s = 0.3
    spec = Speculator(SpeculativeConfig.from_cli('{"method": "ngram", "num_speculative_tokens": 4}', None),
                      model)
    spec.stats = _stats_at(0.8)
    decoding, prefilling = create_requests(2, prompt_len=100, max_tokens=8)
    decoding.num_computed_tokens = 100
    decoding.append_output_token(7)
    decoding.first_token_time = 50.0
    prefilling.options = dataclasses.replace(prefilling.options, slo_tpot=0.001)
    spec.begin_step([decoding, prefilling], prompt_tokens=512, now=50.0)
    assert spec.length == 0
    decoding.options = dataclasses.replace(decoding.options, slo_tpot=0.2)
    spec.begin_step([decoding, prefilling], prompt_tokens=512, now=50.0)
    assert spec.length == 3
    for _ in range(4):
        decoding.append_output_token(7)
    decoding.num_computed_tokens = decoding.num_tokens - 1
    spec.begin_step([decoding, prefilling], prompt_tokens=512, now=50.2)
    assert spec.length == 0
    fresh, constrained = create_requests(2, prompt_len=100, max_tokens=8)
    constrained.sampling_params = dataclasses.replace(constrained.sampling_params,
                                                      structured_outputs=StructuredOutputsParams(json_object=True))
    for r in (fresh, constrained):
        r.options = dataclasses.replace(r.options, slo_tpot=0.2)
        r.num_computed_tokens = 100
        r.append_output_token(7)
        r.first_token_time = 50.2
    spec.begin_step([fresh, prefilling], prompt_tokens=512, now=50.2)
    assert spec.length == 3
    spec.begin_step([fresh, prefilling, constrained], prompt_tokens=512, now=50.2)
    assert spec.length == 3
    fresh.sampling_params = dataclasses.replace(fresh.sampling_params, ignore_eos=True)
    spec.begin_step([fresh, prefilling], prompt_tokens=512, now=50.2)
    assert spec.length == 2


def test_the_scheduler_tells_auto_the_prompt_tokens_the_step_may_prefill():
    """What ``auto`` prices drafts against: running requests' unprefilled tokens and the prompts of the
    waiting requests that have a seat under ``max_num_seqs``, within the room the decodes leave in the budget
    (one token each), and that room. Issue 33: with every seat taken, a waiting prompt is no prompt the step
    could compute (counted, ``auto`` at a full batch of 16 verified no drafts, at 0.88 of k = 4's tokens/s)."""
    spec = SpeculativeConfig("ngram", 4)
    sched = Scheduler(SchedulerConfig(max_num_batched_tokens=64, max_model_len=128, max_num_seqs=2),
                      CacheConfig(num_blocks=32, block_size=4), StepTimeModel(adapt=False), speculative=spec)
    a, b, c = create_requests(3, prompt_len=40, max_tokens=8)
    sched.add_request(a)
    sched.update_from_output(sched.schedule(0.0), {"r0": SampledToken(7)}, 0.1)  # a decodes now
    assert sched._prompt_backlog(64, 1) == (0, 63)
    sched.add_request(b)
    sched.add_request(c)
    assert sched._prompt_backlog(64, 2) == (63, 63) and sched._prompt_backlog(1000, 2) == (80, 999)
    assert sched._prompt_backlog(1000, 1) == (40, 999) and sched._prompt_backlog(1000, 0) == (0, 999)
    b.num_computed_tokens = 30  # b with 30 tokens computed (a prefix hit): 10 left
    assert sched._prompt_backlog(1000, 2) == (50, 999)
    seen = []
    sched.speculator.begin_step = lambda running, limit, again, prompt_tokens, room, now: seen.append(prompt_tokens)
    sched.schedule(0.2)  # a decodes; b takes the one seat left (10 tokens to prefill), c has none
    assert seen == [10]


def _excess(cost: DraftCost, num_rows: int, num_drafts: int) -> float:
    """Seconds ``num_rows`` rows verifying ``num_drafts`` drafts add on ``cost``'s fit."""
    fixed, per_row, per_draft, _ = cost.costs()
    return fixed + per_row * num_rows + per_draft * num_drafts


def test_draft_cost_is_what_steps_take_over_the_model_without_drafts():
    """Three steps of 4 rows verifying 8 drafts, 8 verifying 24 and 2 verifying 8, each taking 1 ms a step,
    0.5 ms a row and 0.25 ms a draft more than predicted without them. The costs are the non-negative least
    squares with :data:`COST_RIDGE` (they meet its Karush-Kuhn-Tucker conditions), which fit each step within
    10%. Where every row verifies 8 drafts, rows and drafts are not told apart, and the excess is put on the
    drafts (0.5 ms each; split evenly it was 2 ms a row and 0.25 a draft, and fewer drafts never looked
    cheaper). Under auto, the step-time model learns from the steps without drafts, the draft costs from the
    steps with drafts: one from steps of decodes alone, one from steps with a prompt chunk (the two run on
    different paths)."""
    cost = DraftCost()
    assert cost.costs() is None
    steps = ((4, 8), (8, 24), (2, 8))
    for rows, drafts in steps:
        cost.observe(0.020, 0.020 + 0.001 + 0.0005 * rows + 0.00025 * drafts, rows, drafts)
    cost.observe(0.050, 0.040, 0, 0)  # a step without drafts teaches nothing
    assert cost.num_steps == 3
    theta = np.array(cost.costs())
    grad = (cost._xtx + np.diag(COST_RIDGE * np.diag(cost._xtx))) @ theta - cost._xty
    tol = 1e-9 * np.abs(cost._xty).max()
    assert (theta >= 0).all() and np.abs(grad[theta > 0]).max() < tol and (grad[theta == 0] > -tol).all()
    for rows, drafts in steps:
        assert _excess(cost, rows, drafts) == pytest.approx(0.001 + 0.0005 * rows + 0.00025 * drafts, rel=0.1)
    same = DraftCost()
    for rows in (4, 8, 16, 8):
        same.observe(0.050, 0.050 + 0.0005 * 8 * rows, rows, 8 * rows)
    assert same.costs() == pytest.approx((0.0, 0.0, 0.0005, 0.0), abs=1e-6)
    one = DraftCost()
    one.observe(0.020, 0.030, 2, 2)  # one kind of step: the terms are not told apart, and the excess is kept
    assert _excess(one, 2, 2) == pytest.approx(0.010, rel=1e-3)
    model = StepTimeModel(StepCoefficients(0.010, 0.001, 0.0, 0.0), adapt=False)
    spec = Speculator(SpeculativeConfig.from_cli('{"method": "ngram", "num_speculative_tokens": 4}', None),
                      model)
    out = SchedulerOutput(scheduled=[ScheduledRequest("a", 10, 3, sample=True, spec_token_ids=[5, 6]),
                                     ScheduledRequest("b", 20, 1, sample=True)])
    assert spec.observe(out, 0.019) is None  # predicted without drafts: 10 + 2 · 1 = 12 ms
    assert _excess(spec.cost, 1, 2) == pytest.approx(0.007, rel=1e-3)
    plain = SchedulerOutput(scheduled=[ScheduledRequest("b", 20, 1, sample=True)])
    shape, seconds = spec.observe(plain, 0.011)  # the step-time model learns from steps without drafts
    assert (shape.num_tokens, shape.num_sampled, shape.attention_pairs, seconds) == (1, 1, 21, 0.011)
    assert StepShape.of(out, drafts=False) == StepShape(2, 2, 11 + 21, 10 + 1 + 20 + 1, 2)
    mixed = SchedulerOutput(scheduled=[ScheduledRequest("a", 10, 3, sample=True, spec_token_ids=[5, 6]),
                                       ScheduledRequest("c", 0, 8, sample=True)])  # with a prompt chunk
    assert spec.observe(mixed, 0.030) is None  # predicted without drafts: 10 + 9 · 1 = 19 ms
    assert spec.cost.num_steps == 1 and spec.cost_beside.num_steps == 1
    assert _excess(spec.cost_beside, 1, 2) == pytest.approx(0.011, rel=1e-3)
    fixed = Speculator(SpeculativeConfig.from_cli('{"method": "ngram", "num_speculative_tokens": 4}', "2"),
                       model)
    assert fixed.observe(out, 0.019) == (StepShape.of(out), 0.019)  # a fixed length: every step as it ran


def test_proposing_is_priced_with_the_drafts_it_proposes():
    """A draft model's proposing (timed by the runner) is a cost of the drafts proposed, not of the step that
    proposed them: a step without drafts teaches the step-time model its seconds without its proposing, and a
    step with drafts teaches the draft costs its seconds plus the proposing of the step before. Learned where
    it was spent, a step at batch 1 without drafts was priced at what one with 4 drafts a row took, drafts
    looked free, and ``auto`` verified drafts a draft model almost never got accepted, below the output rate
    of none (BENCHMARKS.md, "Speculative decoding with a draft model"). Of the proposing, a draft model's
    catching up on context it missed is priced with neither step. A fixed length's steps are learned as they
    ran."""
    model = StepTimeModel(StepCoefficients(0.010, 0.001, 0.0, 0.0), adapt=False)
    spec = Speculator(SpeculativeConfig.from_cli('{"method": "ngram", "num_speculative_tokens": 4}', None),
                      model)
    plain = SchedulerOutput(scheduled=[ScheduledRequest("a", 20, 1, sample=True)])
    shape, seconds = spec.observe(plain, 0.041, proposing=0.030)  # proposed 4 drafts for the next step
    assert seconds == pytest.approx(0.011)
    out = SchedulerOutput(scheduled=[ScheduledRequest("a", 21, 5, sample=True, spec_token_ids=[5, 6, 7, 8])])
    assert spec.observe(out, 0.045, proposing=0.030) is None  # predicted without drafts: 10 + 1 = 11 ms
    assert _excess(spec.cost, 1, 4) == pytest.approx(0.045 - 0.030 + 0.030 - 0.011, rel=1e-3)
    assert spec.observe(plain, 0.012, proposing=0.0) == (StepShape.of(plain), 0.012)  # its drafts: unverified
    spec = Speculator(SpeculativeConfig.from_cli('{"method": "ngram", "num_speculative_tokens": 4}', None),
                      model)  # 20 ms of the proposing caught up on context the draft had missed: neither step's
    shape, seconds = spec.observe(plain, 0.041, proposing=0.030, catching_up=0.020)
    assert seconds == pytest.approx(0.011)
    assert spec.observe(out, 0.045, proposing=0.030) is None
    assert _excess(spec.cost, 1, 4) == pytest.approx(0.045 - 0.030 + 0.010 - 0.011, rel=1e-3)
    fixed = Speculator(SpeculativeConfig.from_cli('{"method": "ngram", "num_speculative_tokens": 4}', "4"),
                       model)
    assert fixed.observe(plain, 0.041, proposing=0.030) == (StepShape.of(plain), 0.041)


def test_draft_costs_are_the_nonnegative_least_squares():
    """The costs are the least squares with every coefficient non-negative: at the solution the gradient
    ``a θ - b`` is 0 where ``θ > 0`` and ``>= 0`` where ``θ = 0`` (the Karush-Kuhn-Tucker conditions, which
    the minimum of a convex problem meets and no other point does), over random problems of which many have
    an unconstrained fit with a negative coefficient."""
    rng = np.random.default_rng(0)
    clipped = 0
    for _ in range(300):
        x = rng.uniform(0, 1, (6, 3))
        a, b = x.T @ x, x.T @ rng.normal(0, 1, 6)
        theta = np.array(nonnegative_solve(a, b))
        grad = a @ theta - b
        assert (theta >= 0).all()
        assert np.abs(grad[theta > 0]).max(initial=0.0) < 1e-9 and (grad[theta == 0] > -1e-9).all()
        clipped += bool((np.linalg.solve(a, b) < 0).any())
    assert clipped > 100


# ------------------------------------------------------------------------------- scheduler: blocks
def test_rejected_drafts_free_their_slots_and_the_runner_is_told():
    """Block size 4. R (6 prompt tokens) decodes; with 3 drafts waiting its step computes 4 tokens at
    positions 6..9: 3 blocks. One draft accepted: 8 tokens, the third block (positions 8..11) stays for the
    next token; none accepted: 7 tokens, the third block is freed, and the next step's share of R tells the
    runner to keep 2 blocks."""
    spec = SpeculativeConfig("ngram", 3, length=3)
    sched = Scheduler(SchedulerConfig(max_num_batched_tokens=64, max_model_len=64),
                      CacheConfig(num_blocks=16, block_size=4), StepTimeModel(adapt=False), speculative=spec)
    (r,) = create_requests(1, prompt_len=6, max_tokens=20)
    sched.add_request(r)
    kv = sched.kv_cache_manager
    out = sched.schedule(0.0)
    assert out.scheduled[0].num_lookahead == 3  # the runner proposes after the prompt's step
    sched.update_from_output(out, {"r0": SampledToken(7, spec_token_ids=[8, 9, 10])}, 0.1)
    assert r.spec_token_ids == [8, 9, 10] and kv.get_block_ids("r0") == [0, 1]
    out = sched.schedule(0.1)
    s = out.scheduled[0]
    assert (s.num_computed_tokens, s.num_new_tokens, s.spec_token_ids, s.sample) == (6, 4, [8, 9, 10], True)
    assert kv.get_block_ids("r0") == [0, 1, 2] and s.new_block_ids == [2]
    sched.update_from_output(out, {"r0": SampledToken(11, accepted=[SampledToken(8)], spec_token_ids=[1])}, 0.2)
    assert r.output_token_ids == [7, 8, 11] and r.num_computed_tokens == 8 and kv.get_block_ids("r0") == [0, 1, 2]
    kv.check_integrity()
    out = sched.schedule(0.2)
    s = out.scheduled[0]
    assert (s.num_computed_tokens, s.num_new_tokens, s.spec_token_ids, s.num_kept_blocks) == (8, 2, [1], None)
    sched.update_from_output(out, {"r0": SampledToken(12)}, 0.3)  # the draft (1) rejected
    assert r.num_computed_tokens == 9 and r.num_tokens == 10 and kv.get_block_ids("r0") == [0, 1, 2]
    r.spec_token_ids = [3, 4, 5]
    out = sched.schedule(0.3)
    assert out.scheduled[0].num_new_tokens == 4 and kv.get_block_ids("r0") == [0, 1, 2, 3]  # positions 9..12
    sched.update_from_output(out, {"r0": SampledToken(13)}, 0.4)  # all three rejected: 11 tokens need 3 blocks
    assert r.num_computed_tokens == 10 and kv.get_block_ids("r0") == [0, 1, 2]
    kv.check_integrity()
    assert kv.num_free_blocks == 13
    out = sched.schedule(0.4)
    assert out.scheduled[0].num_kept_blocks == 3 and out.scheduled[0].num_new_tokens == 1
    stats = sched.make_stats()
    assert (stats.num_spec_drafts_total, stats.num_spec_draft_tokens_total, stats.num_spec_accepted_tokens_total,
            stats.spec_accepted_per_pos) == (3, 7, 1, (1, 0, 0))


# ---------------------------------------------------------------------------------- engine: tokens
@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory):
    return make_tiny_hf_model(tmp_path_factory.mktemp("spec"), "llama")


@pytest.fixture(scope="module")
def small_vocab_model(tmp_path_factory):
    """32 token ids: sampled outputs often repeat their context, so n-gram drafts come and are often rejected."""
    return make_tiny_hf_model(tmp_path_factory.mktemp("spec32"), "llama", overrides={"vocab_size": 32,
                                                                                     "eos_token_id": 31})


BASE = [100 + (7 * i) % 50 for i in range(30)]
PROMPTS = [BASE * 2, BASE[:20] * 3, [5, 6, 7, 8] * 10, list(range(200, 240)), BASE + [3, 4]]


def _run(model: str, params, spec: bool, **kw):
    """Outputs of ``PROMPTS`` stepped by hand with ``check_integrity()`` after every step."""
    llm = LLM(model, dtype="float32", block_size=4, log_stats_interval=0, **kw,
              **({"speculative_config": NGRAM, "speculative_length": "3"} if spec else {}))
    engine = llm.engine
    ids = [engine.add_request(p, params) for p in PROMPTS]
    tokens: dict[str, list[int]] = {i: [] for i in ids}
    reasons = {}
    while engine.has_unfinished_requests():
        for out in engine.step():  # delta outputs
            tokens[out.request_id] += out.token_ids
            if out.finished:
                reasons[out.request_id] = out.finish_reason
        engine.core.scheduler.kv_cache_manager.check_integrity()
    assert engine.core.scheduler.kv_cache_manager.usage == 0
    return [(tokens[i], reasons[i]) for i in ids], engine.make_stats()


@pytest.mark.parametrize("case, kw", [("plain", dict(num_blocks=256)),
                                      ("chunked", dict(num_blocks=256, max_num_batched_tokens=7)),
                                      ("preempted", dict(num_blocks=36)),
                                      ("prefix hit", dict(num_blocks=256))])
def test_greedy_tokens_are_the_same_with_speculation(tiny_model, case, kw):
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, stop_token_ids=[131])
    ref, _ = _run(tiny_model, params, False, **kw)
    if case == "prefix hit":  # the same prompts again: their prefixes now come from the cache
        llm = LLM(tiny_model, dtype="float32", block_size=4, log_stats_interval=0, speculative_config=NGRAM, **kw)
        llm.generate(PROMPTS, params, use_tqdm=False)
        outs = llm.generate(PROMPTS, params, use_tqdm=False)
        assert all(o.metrics.num_cached_tokens > 0 for o in outs)
        assert [o.token_ids for o in outs] == [t for t, _ in ref]
        return
    outs, stats = _run(tiny_model, params, True, **kw)
    assert outs == ref  # tokens and finish reasons
    assert stats.num_spec_accepted_tokens_total > 0
    assert stats.num_spec_draft_tokens_total > stats.num_spec_accepted_tokens_total  # some were rejected
    if case == "preempted":
        assert stats.num_preemptions_total > 0


@pytest.mark.parametrize("invariant", [False, True])
def test_seeded_sampling_gives_the_same_tokens_and_logprobs_with_speculation(small_vocab_model, invariant):
    """Each position is sampled with the noise sequential decoding would draw (seeded by the output's length),
    over the output as it would be (penalties, min_tokens before EOS): the same tokens. A verified position
    runs the prefill-chunk kernels where sequential decoding runs the decode ones, so its logprobs agree to
    float32 rounding, and bit for bit in batch-invariant mode (every token attended alone, issue 34)."""
    prompts = [[(7 * i + j) % 31 for j in range(12)] * 2 for i in range(6)]
    params = [SamplingParams(temperature=0.3, top_p=0.95, max_tokens=32, seed=i, frequency_penalty=0.1,
                             min_tokens=6, logprobs=2) for i in range(len(prompts))]
    kw = dict(dtype="float32", block_size=4, num_blocks=256, log_stats_interval=0, batch_invariant=invariant)
    ref = LLM(small_vocab_model, **kw).generate(prompts, params, use_tqdm=False)
    llm = LLM(small_vocab_model, **kw, speculative_config=NGRAM, speculative_length="4")
    outs = llm.generate(prompts, params, use_tqdm=False)
    assert [o.token_ids for o in outs] == [o.token_ids for o in ref]
    got, want = [o.outputs[0].logprobs for o in outs], [o.outputs[0].logprobs for o in ref]
    if invariant:
        assert got == want
        assert [o.outputs[0].top_logprobs for o in outs] == [o.outputs[0].top_logprobs for o in ref]
    else:
        assert [pytest.approx(w, rel=1e-5) for w in want] == got
    stats = llm.engine.make_stats()
    assert 0 < stats.num_spec_accepted_tokens_total < stats.num_spec_draft_tokens_total
    core = llm.engine.core  # the speculator prices attention runs as the runner's backend takes them
    assert core.scheduler.speculator.run_positions == core.runner.attention_run_positions() is None  # float32


def _chi_square_critical(df: int, z: float = 3.0902) -> float:
    """The chi-square quantile for ``df`` degrees of freedom at the normal quantile ``z`` (0.999 here), by
    Wilson and Hilferty's cube-root approximation (accurate to well under 1% for ``df >= 10``)."""
    return df * (1 - 2 / (9 * df) + z * math.sqrt(2 / (9 * df))) ** 3


def test_unseeded_sampling_keeps_the_target_distribution(tmp_path):
    """A random model over 8 tokens: the joint distribution of the first 3 output tokens after a prompt
    whose tokens repeat (so drafts are proposed and often rejected), sampled 20,000 times with speculation,
    against the exact distribution computed with transformers; chi-square at the 0.999 level over the
    outcomes expected at least 5 times (the rest pooled)."""
    import transformers

    model_dir = make_tiny_hf_model(tmp_path, "llama", overrides={"vocab_size": 8, "eos_token_id": 7})
    prompt = [1, 2, 3, 1, 2, 3, 1, 2]
    hf = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    exact = {}
    with torch.no_grad():
        for seq in itertools.product(range(8), repeat=2):
            ctx = torch.tensor([prompt + list(seq)])
            logp = hf(ctx).logits[0].log_softmax(-1)  # [len, 8]
            p12 = logp[len(prompt) - 1, seq[0]] + logp[len(prompt), seq[1]]
            for t3 in range(8):
                exact[seq + (t3,)] = float((p12 + logp[len(prompt) + 1, t3]).exp())
    n = 20000
    llm = LLM(model_dir, dtype="float32", block_size=4, num_blocks=4096, max_num_seqs=256, log_stats_interval=0,
              speculative_config='{"method": "ngram", "num_speculative_tokens": 2}', speculative_length="2")
    # Four tokens: the step after the first verifies two drafts (no draft is verified past max_tokens).
    outs = llm.generate([prompt] * n, SamplingParams(temperature=1.0, max_tokens=4, ignore_eos=True),
                        use_tqdm=False)
    counts: dict[tuple, int] = {}
    for o in outs:
        counts[tuple(o.token_ids[:3])] = counts.get(tuple(o.token_ids[:3]), 0) + 1
    stats = llm.engine.make_stats()
    assert stats.num_spec_draft_tokens_total > n // 2 and 0 < stats.num_spec_accepted_tokens_total \
        < stats.num_spec_draft_tokens_total
    big = [k for k, p in exact.items() if p * n >= 5]
    chi2 = sum((counts.get(k, 0) - exact[k] * n) ** 2 / (exact[k] * n) for k in big)
    rest_p = 1 - sum(exact[k] for k in big)
    rest = n - sum(counts.get(k, 0) for k in big)
    if rest_p * n >= 5:
        chi2 += (rest - rest_p * n) ** 2 / (rest_p * n)
    df = len(big) - (rest_p * n < 5)
    assert chi2 < _chi_square_critical(df), (chi2, df)


# --------------------------------------------------------------------------------------------- simulator
def test_the_simulator_speculates_with_the_given_acceptance():
    """One request, 10 prompt tokens and 13 output tokens, 3 drafts a step. Every draft accepted: the prompt's
    step gives the first token and asks for drafts, then each step emits 4 tokens (13 = 1 + 3 x 4): 4 steps.
    None accepted: a token a step, 13 steps. Under ``auto`` with 64 requests on a compute-bound cost model
    the length falls to 0: no draft verified, 14 steps (the 640 prompt tokens take two of 512)."""
    from goodserve.sim.cost_model import LinearCostModel
    from goodserve.sim.simulator import Simulator
    from goodserve.sim.spec import ClusterConfig, SimRequest

    def run(acceptance, length="3", n=1, cost=StepCoefficients(0.01, 1e-4, 0.0, 0.0)):
        config = ClusterConfig(SchedulerConfig(max_num_batched_tokens=512, max_model_len=256),
                               CacheConfig(num_blocks=4096, block_size=4),
                               speculative=SpeculativeConfig("ngram", 3, length if length == "auto" else int(length)),
                               spec_acceptance=acceptance)
        sim = Simulator(config, LinearCostModel(cost), [SimRequest(f"r{i}", 0.0, 10, 13) for i in range(n)])
        result = sim.run()
        assert all(len(r.itls) == 12 for r in result.records)  # 13 tokens each, whatever was accepted
        return sim.instances[0]

    assert run((1.0,)).num_steps == 4
    assert run((0.0,)).num_steps == 13
    inst = run((0.9,), "auto", n=64, cost=StepCoefficients(0.001, 0.01, 0.0, 0.0))
    assert inst.scheduler.make_stats().num_spec_draft_tokens_total == 0 and inst.num_steps == 14
    assert run((0.9,), "auto").scheduler.make_stats().num_spec_accepted_tokens_total > 0


def _auto_steps(per_token_s: float, steps: int = 2 * (EXPLORE_EVERY + 1),
                method: str = "ngram") -> tuple[list[int], list[int]]:
    """The lengths ``auto`` chooses and the lookaheads it asks for over ``steps`` steps of one decoding
    request, on a model pricing a step at ``10 ms + per_token_s`` a token."""
    config = SpeculativeConfig(method, 4, model="draft" if method == "draft_model" else None)
    spec = Speculator(config, StepTimeModel(StepCoefficients(0.01, per_token_s, 0.0, 0.0), adapt=False))
    (r,) = create_requests(1, prompt_len=8, max_tokens=100)
    r.num_computed_tokens = r.num_tokens - 1  # decoding
    r.spec_token_ids = [7] * 4  # proposed whatever was asked for
    lengths, lookaheads = [], []
    for _ in range(steps):
        spec.begin_step([r])
        lengths.append(spec.length)
        lookaheads.append(spec.lookahead(r))
    return lengths, lookaheads


def test_auto_explores_k_max_then_one_draft_after_sixteen_steps_at_zero():
    """A model that prices every token at 1 s makes ``auto`` choose 0; after 16 such steps a step verifies
    drafts (asked for on the step before), so the model can learn what a longer step costs: ``k_max`` per
    row, and at the next probe one per row, so that the costs of verifying at all, of a row and of each
    draft are told apart (where a row's first draft costs more than each further one, probing one length
    only, ``auto`` would never learn that ``k_max`` pays where one does not). For a draft model, each probe
    after which ``auto`` still chooses none doubles the steps to the next (32, then 64), and a probe's step asks
    for the drafts of ``auto``'s own choice (none), not its own length again: the draft's passes for drafts no
    step verifies were thrown away (BENCHMARKS.md, "Speculative decoding with a draft
    model"). Prompt lookup's proposals cost little: its probes keep their 16-step interval (no back-off), and
    its proposals run ahead of them."""
    lengths, lookaheads = _auto_steps(1.0)
    assert lengths == [0] * EXPLORE_EVERY + [4] + [0] * EXPLORE_EVERY + [1]
    assert lookaheads == [0] * (EXPLORE_EVERY - 1) + [4, 4] + [0] * (EXPLORE_EVERY - 1) + [1, 2]
    lengths, lookaheads = _auto_steps(1.0, steps=EXPLORE_EVERY + 1 + 32 + 1 + 64 + 1, method="draft_model")
    assert lengths == [0] * EXPLORE_EVERY + [4] + [0] * 32 + [1] + [0] * 64 + [4]
    assert lookaheads == [0] * (EXPLORE_EVERY - 1) + [4, 0] + [0] * 31 + [1, 0] + [0] * 63 + [4, 0]


def test_a_step_auto_verifies_drafts_in_brings_probes_back_to_every_sixteen_steps():
    """A draft model's probes back off while drafts do not pay, and come back to every :data:`EXPLORE_EVERY`
    steps at zero once ``auto`` chooses drafts itself (here, when the step-time model makes a token cheap)."""
    spec = Speculator(SpeculativeConfig("draft_model", 4, model="draft"),
                      StepTimeModel(StepCoefficients(0.01, 1.0, 0.0, 0.0), adapt=False))
    (r,) = create_requests(1, prompt_len=8, max_tokens=100)
    r.num_computed_tokens, r.spec_token_ids = r.num_tokens - 1, [7] * 4
    for _ in range(EXPLORE_EVERY + 1):
        spec.begin_step([r])
    assert spec.length == 4 and spec._probe_every == [32, EXPLORE_EVERY]
    spec.model = StepTimeModel(StepCoefficients(0.01, 1e-6, 0.0, 0.0), adapt=False)  # a token costs nothing
    spec.begin_step([r])
    assert spec.length > 0 and spec._probe_every == [EXPLORE_EVERY, EXPLORE_EVERY]


def test_a_draft_models_probes_back_off_only_once_drafts_cannot_pay_at_the_rates_upper_bounds():
    """Model: 10 ms + 5 ms a token, nothing measured yet. At the rates' lower bounds (0.21 a position) ``auto``
    chooses none, at their upper bounds (0.91) 4 drafts: the probes measure what decides it, and keep their
    16-step interval. Backed off, the rates of a draft that paid stayed at the few rows of its first probes and
    ``auto`` never verified its drafts (BENCHMARKS.md, "Speculative decoding with a draft model that pays").
    After 200 rows that accepted no draft, even the upper bounds choose none: the next probe doubles the
    interval."""
    model = StepTimeModel(StepCoefficients(0.01, 0.005, 0.0, 0.0), adapt=False)
    spec = Speculator(SpeculativeConfig("draft_model", 4, model="draft"), model)
    (r,) = create_requests(1, prompt_len=8, max_tokens=100)
    r.num_computed_tokens, r.spec_token_ids = r.num_tokens - 1, [7] * 4
    assert choose_length(model, spec.stats, [8], 4) == 0
    assert choose_length(model, spec.stats, [8], 4, rates=spec.stats.upper_rates()) == 4
    for _ in range(EXPLORE_EVERY + 1):
        spec.begin_step([r])
    assert spec.length == 4 and spec._probes == 1 and spec._probe_every == [EXPLORE_EVERY, EXPLORE_EVERY]
    for _ in range(200):
        spec.record(4, 0)
    for _ in range(EXPLORE_EVERY + 1):
        spec.begin_step([r])
    assert spec._probes == 2 and spec._probe_every == [2 * EXPLORE_EVERY, EXPLORE_EVERY]


def test_a_draft_model_catches_up_on_a_row_only_where_its_drafts_save_more():
    """Model: 10 ms + 1 ms a token; acceptance 0.8 (3.24 tokens expected at 4 drafts, at the lower bounds); two
    rows of 100 and 1,000 tokens, 99 tokens left each, that the draft has never read. ``auto`` chooses 4: a step
    takes 12 ms without drafts and 20 ms with them (drafts priced as decode rows), so a token saves
    (12 - 20 / 3.24) / 2 = 2.91 ms of the machine, 0.288 s over a row's 99 tokens. Catching up costs a prompt
    token's 1 ms a token until measured: 0.1 s for the first row, asked; 1 s for the second, not asked.
    The draft proposes for the first row, reading its whole context: the next step, after 4 tokens (3 drafts
    accepted), the draft has none of its tokens to read first, and it is asked without a catch-up. Measured at
    20 ms for the first row's 100 tokens, a token of catch-up costs 0.2 ms, and the second row's 0.2 s is worth
    it: asked. A row preempted, or asked and given no drafts, has its whole context to read again. Without this, ``auto`` under load asked for the drafts of rows whose prompts the draft had not read, and
    spent most of a step's time catching up (BENCHMARKS.md, "Speculative decoding with a draft model that
    pays")."""
    model = StepTimeModel(StepCoefficients(0.01, 0.001, 0.0, 0.0), adapt=False)
    spec = Speculator(SpeculativeConfig("draft_model", 4, model="draft"), model)
    spec.stats = _stats_at(0.8)
    reqs = [create_requests(1, prompt_len=n, max_tokens=100, start=i)[0] for i, n in enumerate((100, 1000))]
    for r in reqs:
        r.num_computed_tokens = r.num_tokens - 1
    spec.begin_step(reqs)
    assert spec.length == 4 and spec._saving == pytest.approx((0.012 - 0.020 / 3.2382) / 2, rel=1e-4)
    assert [spec.lookahead(r) for r in reqs] == [4, 0]
    step = SchedulerOutput(scheduled=[ScheduledRequest(r.request_id, r.num_computed_tokens, 1, sample=True)
                                      for r in reqs])
    spec.observe(step, 0.05, proposing=0.03, catching_up=0.02)  # the first row's 100 tokens: 0.2 ms each
    for r in reqs:
        for _ in range(4):
            r.append_output_token(7)
        r.num_computed_tokens = r.num_tokens - 1
        r.spec_token_ids = [7] * 4 if r is reqs[0] else []  # proposed as asked
        spec.proposed(r)
    spec.begin_step(reqs)
    assert [spec.lookahead(r) for r in reqs] == [4, 4] and spec._catching_up == 1004  # the second row's alone
    reqs[0].num_preemptions += 1
    assert spec._unseen(reqs[0]) == reqs[0].num_tokens
    reqs[1].spec_token_ids = []  # asked, and no drafts came
    spec.proposed(reqs[1])
    assert spec._unseen(reqs[1]) == reqs[1].num_tokens


def test_a_draft_models_probes_go_on_while_auto_chooses_drafts_no_catch_up_repays():
    """Model: 10 ms a step, tokens nearly free, so ``auto`` chooses drafts at its price of drafts never measured
    (each a decode row); but the draft has read neither row, and a token of catch-up costs 0.1 s: no row is
    asked. The probes still come: after :data:`EXPLORE_EVERY` steps that verified nothing, the row with the
    shortest context is asked for a probe's drafts (one step later here: the 16th step with drafts chosen asks
    for none, to check the model), and the step after verifies them. Asked for none, a server
    whose every row was new to the draft never measured what its drafts cost, and chose drafts at every step
    (BENCHMARKS.md, "Speculative decoding with a draft model under load")."""
    model = StepTimeModel(StepCoefficients(0.01, 1e-6, 0.0, 0.0), adapt=False)
    spec = Speculator(SpeculativeConfig("draft_model", 4, model="draft"), model)
    spec._caught_up = [10.0, 100.0]  # measured: 0.1 s a token
    reqs = [create_requests(1, prompt_len=n, max_tokens=100, start=i)[0] for i, n in enumerate((300, 100))]
    for r in reqs:
        r.num_computed_tokens = r.num_tokens - 1
    asked = []
    for _ in range(EXPLORE_EVERY + 1):
        spec.begin_step(reqs)
        assert spec.length > 0  # auto's own choice
        asked.append([spec.lookahead(r) for r in reqs])
    assert asked == [[0, 0]] * EXPLORE_EVERY + [[0, 4]]  # the 16th would check the model without drafts
    reqs[1].spec_token_ids = [7] * 4  # proposed as asked
    spec.begin_step(reqs)
    assert spec.drafts(reqs[1], 100) == [7] * min(4, spec.length) and spec._at_zero == [0, 0]


def test_a_draft_models_probe_takes_the_row_with_the_shortest_context():
    """A draft model reads what it has not seen of a row's context before it proposes, after steps without drafts
    most of it: its probe asks drafts of the one row with the shortest context, and is priced as that row's drafts
    beside the other rows' decodes (each emitting a token). Prompt lookup's probe asks every row (the others)."""
    model = StepTimeModel(StepCoefficients(0.01, 1.0, 0.0, 0.0), adapt=False)  # every token costs 1 s: auto at 0
    spec = Speculator(SpeculativeConfig("draft_model", 4, model="draft"), model)
    reqs = [create_requests(1, prompt_len=n, max_tokens=100, start=i)[0] for i, n in enumerate((300, 100, 200))]
    for r in reqs:
        r.num_computed_tokens = r.num_tokens - 1
    for _ in range(EXPLORE_EVERY):
        spec.begin_step(reqs, limit=3.5)
    assert spec.length == 0 and [spec.lookahead(r) for r in reqs] == [0, 4, 0]
    reqs[1].spec_token_ids = [7] * 4  # proposed as asked
    spec.begin_step(reqs, limit=3.5)  # 3 decodes: 3.01 s; one draft more 4.01 s, over the limit; as decode rows too
    assert spec.length == 0 and spec._probes == 0
    spec = Speculator(SpeculativeConfig("draft_model", 4, model="draft"), model)
    for _ in range(EXPLORE_EVERY + 1):
        spec.begin_step(reqs, limit=8.5)  # k_max = 4 for the one row: 3.01 + 4 = 7.01 s
    assert spec.length == 4 and spec._probes == 1
    reqs[0].spec_token_ids, reqs[1].spec_token_ids = [7] * 4, []  # drafts on another row than the probe's
    spec = Speculator(SpeculativeConfig("draft_model", 4, model="draft"), model)
    for _ in range(EXPLORE_EVERY + 1):
        spec.begin_step(reqs, limit=3.5)  # priced on the row that has them: 4.01 s at one draft, no probe
    assert spec.length == 0 and spec._probes == 0
    ngram = Speculator(SpeculativeConfig("ngram", 4), model)
    for _ in range(EXPLORE_EVERY):
        ngram.begin_step(reqs)
    assert [ngram.lookahead(r) for r in reqs] == [4, 4, 4]


def _lengths_over_a_probe(spec: Speculator, rows: int, slo_tpot: float, **step) -> list[int]:
    """The lengths ``spec`` chooses over ``EXPLORE_EVERY + 1`` steps of ``rows`` requests that each just got
    their first token (at 5 s), with 4 drafts to verify, and decode under a TPOT SLO of ``slo_tpot`` seconds
    (``step``: further arguments of each ``begin_step``)."""
    reqs = create_requests(rows, prompt_len=8, max_tokens=100)
    for r in reqs:
        r.options = dataclasses.replace(r.options, slo_tpot=slo_tpot)
        r.num_computed_tokens = 8
        r.append_output_token(7)
        r.first_token_time = 5.0
        r.spec_token_ids = [7] * 4  # proposed whatever was asked for
    lengths = []
    for _ in range(EXPLORE_EVERY + 1):
        spec.begin_step(reqs, now=5.0, **step)
        lengths.append(spec.length)
    return lengths


def test_auto_probes_within_the_rows_tpot_slos():
    """A probe keeps as many rows within their TPOT SLOs as a step without drafts. Model: 10 ms + 1 ms a token; drafts
    never accepted, so ``auto`` chooses 0. A fresh row with a 12.5-ms TPOT SLO (later steps 11 ms) is kept by the
    11-ms step without drafts, and allows 12.5 ms a token: a probe of 4 drafts (15 ms) would break it, one draft (12
    ms) does not."""
    model = StepTimeModel(StepCoefficients(0.01, 0.001, 0.0, 0.0), adapt=False)
    spec = Speculator(SpeculativeConfig("ngram", 4), model)
    spec.stats = _stats_at(0.0)
    assert _lengths_over_a_probe(spec, 1, slo_tpot=0.0125) == [0] * EXPLORE_EVERY + [1]


def test_auto_probes_at_the_cheaper_price_of_its_drafts():
    """Issue 33: the learned costs of the warmup request's steps at batch 1 priced a draft at ~5.7 ms, and
    judged at that price no probe kept the rows' TPOT at 56 rows: ``auto`` verified no drafts for ~100
    steps. A probe is judged at the cheaper of the learned price and the model's (here a draft learned at 1 s,
    on the model 1 ms): one draft (12 ms) fits the 12.5-ms bound of the test above."""
    model = StepTimeModel(StepCoefficients(0.01, 0.001, 0.0, 0.0), adapt=False)
    spec = Speculator(SpeculativeConfig("ngram", 4), model)
    spec.stats = _stats_at(0.0)
    spec.cost.costs = lambda: (0.0, 0.0, 1.0, 0.0)
    assert _lengths_over_a_probe(spec, 1, slo_tpot=0.0125) == [0] * EXPLORE_EVERY + [1]


def test_auto_probes_beside_a_chunk_at_the_prompt_tokens_its_drafts_displace():
    """Issue 33: drafts and prompt chunks share the token budget the decodes leave, and a probe beside a chunk
    is priced so, as :func:`choose_length` prices any length (priced on top of the whole chunk, the probes
    beside the 1,024-token chunks of a burst of arrivals did not keep the rows' TPOT). Model: 10 ms + 1 ms a
    token; one row, 100 prompt tokens filling the room: k = 4 displaces 4 of them (111 ms), within the row's
    111.5 ms (on top of the chunk, 115 ms: no; and the probe would fall back to one draft, 112 ms)."""
    model = StepTimeModel(StepCoefficients(0.01, 0.001, 0.0, 0.0), adapt=False)
    spec = Speculator(SpeculativeConfig("ngram", 4), model)
    spec.stats = _stats_at(0.0)
    assert _lengths_over_a_probe(spec, 1, slo_tpot=0.1115, prompt_tokens=100, room=100) == [0] * EXPLORE_EVERY + [4]


def test_auto_probes_steps_with_and_without_a_prompt_chunk_apart():
    """Each kind of step learns its own draft costs, so each counts its own steps without drafts: with steps
    of decodes alone and steps beside a prompt chunk in turn (drafts priced out of both), the probe of the
    decodes alone comes at their 17th step; counted together, it came on a step with a chunk, and the costs of
    the decodes alone went unmeasured. A step whose rows have no drafts to verify is one without drafts
    whatever its length (counted as one with, it put the next probe off)."""
    spec = Speculator(SpeculativeConfig("ngram", 4), StepTimeModel(StepCoefficients(0.01, 1.0, 0.0, 0.0),
                                                                   adapt=False))
    (r,) = create_requests(1, prompt_len=8, max_tokens=100)
    r.num_computed_tokens = r.num_tokens - 1
    r.spec_token_ids = [7] * 4
    alone, beside = [], []
    for _ in range(EXPLORE_EVERY + 1):
        spec.begin_step([r], prompt_tokens=512)
        beside.append(spec.length)
        spec.begin_step([r])
        alone.append(spec.length)
    assert beside == [0] * EXPLORE_EVERY + [4] and alone == [0] * EXPLORE_EVERY + [1]  # k_max and one in turn
    assert spec._at_zero == [0, 0]
    free = Speculator(SpeculativeConfig("ngram", 4), StepTimeModel(StepCoefficients(0.01, 0.0, 0.0, 0.0),
                                                                   adapt=False))
    r.spec_token_ids = []
    for n in range(1, 4):
        free.begin_step([r])
        assert free.length == 4 and free._at_zero == [n, 0] and free.lookahead(r) == 4
    r.spec_token_ids = [7] * 4
    free.begin_step([r])
    assert free._at_zero == [0, 0]


def test_draft_costs_do_not_learn_a_stalled_step():
    """A step with drafts that took more than 3x the model's price of it (each draft a decode row) stalled on
    something else: learned, two 2-s steps among ~0.15-s ones priced each row verifying drafts at tens of ms
    for as long as they weighed in the fit."""
    model = StepTimeModel(StepCoefficients(0.010, 0.001, 0.0, 0.0), adapt=False)
    spec = Speculator(SpeculativeConfig.from_cli(NGRAM, None), model)
    out = SchedulerOutput(scheduled=[ScheduledRequest("a", 10, 3, sample=True, spec_token_ids=[5, 6])])
    assert spec.observe(out, 0.040) is None  # the model prices it at 13 ms with its drafts as decode rows
    assert spec.cost.num_steps == 0
    assert spec.observe(out, 0.039) is None
    assert spec.cost.num_steps == 1


def test_acceptance_lower_bound_prices_a_long_length_measured_on_few_rows_lower():
    """Issue 33: ``auto`` chooses at the acceptance rates' lower bound (Wilson's, z = 1): choosing the ``k``
    whose estimated rate is highest picks the length whose estimate erred up (the optimizer's curse, Smith &
    Winkler 2006), and the later positions, which fewer rows reach, are measured the least. Before any row,
    0.5 over the prior's 2 rows bounds at (0.5 + 0.25 - sqrt(0.125 + 0.0625)) / 1.5 = 0.2113. Over ~490 rows
    at 0.8 (every row reaching every position), 0.780. One row alone (model: 10 ms + 1 ms a token + 2 ms a
    sampled token; a decode token worth 3 ms) makes ``3 E[k]`` ms of work in ``13 + 3 k`` ms: at the estimates
    0.4021 at k = 3 against 0.4029 at 4, at the bounds 0.3908 against 0.3886: k = 3. With positions 2-4 measured
    on 5 rows each (4 accepted: estimates still 0.8), their bounds fall to 0.616, and k = 2 (0.3569 against
    0.3486 at 3)."""
    stats = AcceptanceStats(2)
    assert stats.lower_rates() == pytest.approx([0.21132] * 2, abs=1e-5)
    assert _stats_at(0.8).lower_rates()[0] == pytest.approx(0.78013, abs=1e-5)
    few = _stats_at(0.8)
    few._reached = [few._reached[0]] + [5.0] * 3
    few._accepted = [0.8 * few._reached[0]] + [4.0] * 3
    assert few.rates() == pytest.approx([0.8] * 4, abs=2e-3)
    assert few.lower_rates()[1:] == pytest.approx([0.616] * 3, abs=1e-3)
    model = StepTimeModel(StepCoefficients(0.010, 0.001, 0.002, 0.0), adapt=False)
    assert choose_length(model, _stats_at(0.8), [100], 4) == 3
    assert choose_length(model, few, [100], 4) == 2


def test_acceptance_upper_bound_is_wide_on_few_rows_and_tight_on_many():
    """Wilson's upper bound at z = 2 around each rate over its verified rows plus the prior's 2: before any
    row, 0.5 over 2 rows bounds at (0.5 + 1 + 2 sqrt(0.125 + 0.25)) / 3 = 0.9082; after one row rejected its
    first draft, 1/3 over 3 rows at (1/3 + 2/3 + 2 sqrt(2/27 + 1/9)) / (7/3) = 0.7974; none accepted over ~500
    rows (an estimate of 0.002 with the prior) at 0.012."""
    stats = AcceptanceStats(2)
    assert stats.upper_rates() == pytest.approx([0.90825] * 2, abs=1e-5)
    stats.record(1, 0)
    assert stats.upper_rates()[0] == pytest.approx(0.79743, abs=1e-5)
    assert max(_stats_at(0.0).upper_rates()) == pytest.approx(0.0117, abs=1e-4)


def test_auto_probes_at_the_acceptance_upper_bound():
    """Issue 33: a rate estimated from a few rows must not keep ``auto`` from the probe that measures it. One
    row rejected its draft (α = 1/3 over 3 rows with the prior); 58 fresh rows under an 80-ms TPOT SLO on a
    model of 10 ms + 1 ms a token (68 ms without drafts). One draft a row makes a 126-ms step: at α = 1/3 it
    expects 1.33 tokens a row, within 80 · 1.33 = 106.7 ms: no, and 4 drafts (300 ms) neither, so judged at
    the estimate no probe was ever taken (as after a served run's warmup row rejected its draft). At the
    upper bound (0.797, then 0.845) one draft fits (143.8 ms), 4 do not (281.8 ms): the 17th step probes one."""
    model = StepTimeModel(StepCoefficients(0.01, 0.001, 0.0, 0.0), adapt=False)
    spec = Speculator(SpeculativeConfig("ngram", 4), model)
    spec.stats.record(1, 0)
    assert _lengths_over_a_probe(spec, 58, slo_tpot=0.08) == [0] * EXPLORE_EVERY + [1]


def test_auto_asks_for_the_drafts_of_every_probe_it_takes():
    """A probe that does not fit (here the step limit: every token costs 1 s, one draft makes a 2.01-s step
    against 1.5 s) is put off another 16 steps (not doubled: no probe was taken), and the step before the next
    try asks for its drafts: a probe verifies drafts the runner proposed for it. Before, the count ran on past
    16 without asking, and the probe taken once the limit was lifted had no drafts to verify. Where no row has
    drafts to verify (no match, no room), each step asks again and no probe is counted."""
    spec = Speculator(SpeculativeConfig("ngram", 4), StepTimeModel(StepCoefficients(0.01, 1.0, 0.0, 0.0),
                                                                   adapt=False))
    (r,) = create_requests(1, prompt_len=8, max_tokens=100)
    r.num_computed_tokens, r.spec_token_ids = r.num_tokens - 1, [7] * 4
    lengths, lookaheads = [], []
    for i in range(2 * (EXPLORE_EVERY + 1)):
        spec.begin_step([r], limit=1.5 if i <= EXPLORE_EVERY else math.inf)
        lengths.append(spec.length)
        lookaheads.append(spec.lookahead(r))
    assert lengths == [0] * (2 * EXPLORE_EVERY + 1) + [4]
    assert lookaheads[EXPLORE_EVERY - 1] == 4 and lookaheads[2 * EXPLORE_EVERY] == 4
    assert all(lookaheads[i - 1] >= k for i, k in enumerate(lengths) if k)
    assert spec._probe_every == [EXPLORE_EVERY, EXPLORE_EVERY] and spec._probes == 1
    r.spec_token_ids = []  # none proposed
    for _ in range(EXPLORE_EVERY + 2):
        spec.begin_step([r])
        assert spec.length == 0 and spec.lookahead(r) in (0, 1)
    assert spec._at_zero[0] == EXPLORE_EVERY and spec.lookahead(r) == 1 and spec._probes == 1


def test_auto_verifies_no_drafts_once_after_sixteen_steps_with_drafts():
    """Free tokens make ``auto`` choose all 4 drafts; after 16 such steps one step verifies none, so the
    step-time model keeps measuring the decodes alone, and asks for the drafts of the step after it. The step
    before it asks for none: it would not verify them, and a draft model's passes for them were lost."""
    lengths, lookaheads = _auto_steps(0.0)
    assert lengths == ([4] * EXPLORE_EVERY + [0]) * 2
    assert lookaheads == ([4] * (EXPLORE_EVERY - 1) + [0, 4]) * 2


def test_auto_checks_the_model_less_often_while_it_holds():
    """Free drafts (every step priced at 10 ms): ``auto`` verifies 4 drafts a row, and now and then a step
    verifies none, to check the step-time model. A check it predicts within 10% (10.5 and 9.5 ms) doubles the
    steps with drafts before the next; one it misses (12 ms) after one that held brings them back to 16; a
    second miss in a row (12 ms again: more checks did not mend the model) doubles them again."""
    spec = Speculator(SpeculativeConfig("ngram", 4), StepTimeModel(StepCoefficients(0.01, 0.0, 0.0, 0.0),
                                                                   adapt=False))
    (r,) = create_requests(1, prompt_len=8, max_tokens=10_000)
    r.num_computed_tokens = r.num_tokens - 1  # decoding
    r.spec_token_ids = [7] * 4
    took = iter([0.0105, 0.0095, 0.012, 0.012, 0.010, 0.012, 0.010])
    gaps, run = [], 0
    while len(gaps) < 7:
        spec.begin_step([r])
        if spec.length:
            run += 1
            continue
        gaps.append(run)
        run = 0
        plain = SchedulerOutput(scheduled=[ScheduledRequest(r.request_id, r.num_computed_tokens, 1, sample=True)])
        assert spec.observe(plain, next(took)) is not None  # the model learns it too
    assert gaps == [EXPLORE_EVERY, 32, 64, EXPLORE_EVERY, 32, 64, EXPLORE_EVERY]


def test_auto_tries_one_draft_more_half_way_between_checks():
    """Issue 33: a position no step verifies is never measured, so ``auto`` at one draft a row kept the
    second priced at the estimate of a few early rows (0.65 lower bound where ~0.9 was true) for 200 steps.
    Half way through each 16 steps with drafts, a step of decodes alone verifies one more draft where that
    may pay with the next position's acceptance at its upper bound. A step of 10 ms and 3 ms a draft; position
    1 measured at 0.9 over ~500 rows, position 2 at 0.3 over 6 rows: 1 draft a row is chosen (1.884 tokens in
    13 ms, against 2.140 in 16 ms with the second at its lower bound, 0.289); the eighth step with drafts
    verifies 2 (2.618 tokens with it at its upper bound, 0.754). Measured at 0.3 over ~500 rows too, the
    second no longer may pay: every step verifies 1."""
    model = StepTimeModel(StepCoefficients(0.01, 0.0, 0.0, 0.0), adapt=False)
    spec = Speculator(SpeculativeConfig("ngram", 2), model)
    spec.cost.costs = lambda: (0.0, 0.0, 0.003, 0.0)  # as measured
    for _ in range(2000):
        spec.stats.record(2, 2)
    spec.stats._accepted[0] = 0.9 * spec.stats._reached[0]
    spec.stats._reached[1], spec.stats._accepted[1] = 6.0, 1.8
    (r,) = create_requests(1, prompt_len=8, max_tokens=10_000)
    r.num_computed_tokens = r.num_tokens - 1
    r.spec_token_ids = [7] * 2
    lengths = []
    for _ in range(EXPLORE_EVERY):
        spec.begin_step([r])
        lengths.append(spec.length)
    assert lengths == [1] * 7 + [2] + [1] * 8
    spec.stats._reached[1] = 500.0
    spec.stats._accepted[1] = 150.0
    lengths = []
    for _ in range(EXPLORE_EVERY):
        spec.begin_step([r])
        lengths.append(spec.length)
    assert 2 not in lengths


def test_drafts_stop_where_the_request_must():
    """A request that may emit 3 more tokens verifies at most 2 drafts (the third token comes as the bonus),
    and asks for at most 1 after this step (which emits at least one token): no position past
    ``max_tokens``, so none past ``max_model_len``."""
    spec = Speculator(SpeculativeConfig("ngram", 4, length=4), StepTimeModel(adapt=False))
    (r,) = create_requests(1, prompt_len=8, max_tokens=5)
    r.append_output_token(7)
    r.append_output_token(7)
    r.num_computed_tokens = r.num_tokens - 1
    r.spec_token_ids = [1, 2, 3, 4]
    spec.begin_step([r])
    assert spec.drafts(r, room=100) == [1, 2] and spec.lookahead(r) == 1
    r.append_output_token(7)
    r.append_output_token(7)
    assert spec.drafts(r, room=100) == [] and spec.lookahead(r) == 0


def test_a_draft_model_must_share_the_targets_vocabulary(tiny_model, small_vocab_model):
    with pytest.raises(ValueError, match="vocabulary \\(32 ids\\) is not the target's \\(49152\\)"):
        LLM(tiny_model, dtype="float32", num_blocks=64, log_stats_interval=0,
            speculative_config=f'{{"method": "draft_model", "model": "{small_vocab_model}", "num_speculative_tokens": 4}}')


@pytest.mark.parametrize("draft_seed", [0, 1])
def test_greedy_tokens_are_the_same_with_a_draft_model(tmp_path, tiny_model, draft_seed):
    """The target as its own draft proposes exactly its greedy tokens: every draft is accepted (its cache
    bookkeeping is right, or they would not be). Another random model of the same shape is mostly wrong: the
    tokens are the target's all the same. The pool holds both models' K/V: with the same KV budget, a draft
    as large as the target halves the blocks."""
    draft = tiny_model if draft_seed == 0 else make_tiny_hf_model(tmp_path, "llama", seed=draft_seed)
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    ref, _ = _run(tiny_model, params, False, kv_cache_memory=1 << 20)
    spec = f'{{"method": "draft_model", "model": "{draft}", "num_speculative_tokens": 4}}'
    llm = LLM(tiny_model, dtype="float32", block_size=4, log_stats_interval=0, kv_cache_memory=1 << 20,
              speculative_config=spec, speculative_length="3")
    plain = LLM(tiny_model, dtype="float32", block_size=4, log_stats_interval=0, kv_cache_memory=1 << 20)
    assert llm.engine.config.cache.num_blocks == plain.engine.config.cache.num_blocks // 2
    outs = llm.generate(PROMPTS, params, use_tqdm=False)
    assert [o.token_ids for o in outs] == [t for t, _ in ref]
    stats = llm.engine.make_stats()
    assert stats.num_spec_draft_tokens_total > 0
    if draft_seed == 0:
        assert stats.num_spec_accepted_tokens_total == stats.num_spec_draft_tokens_total
    else:
        assert stats.num_spec_accepted_tokens_total < stats.num_spec_draft_tokens_total
    llm.engine.core.scheduler.kv_cache_manager.check_integrity()
    llm.engine.step()  # finished requests reach the runner (and the draft's cache) with the next step
    proposer = llm.engine.core.runner.proposer
    proposer.kv.check_integrity()
    assert proposer.kv.usage == 0 and not proposer._states  # every finished request's draft blocks freed


def test_a_draft_model_reads_the_context_it_missed_in_a_pass_timed_apart(tiny_model):
    """The target as its own draft proposes its greedy tokens. A new request's context, or one with more tokens
    than the draft reads after a step it proposed for (the next token, and the last draft where all were
    accepted), is read but for its last token in a pass of its own, timed as ``catch_up_seconds``; the drafts
    are the greedy tokens all the same. After a step it proposed for, there is no such pass."""
    ctx = PROMPTS[3]
    greedy = LLM(tiny_model, dtype="float32", block_size=4, log_stats_interval=0).generate(
        [ctx], SamplingParams(temperature=0, max_tokens=12, ignore_eos=True), use_tqdm=False)[0].token_ids
    llm = LLM(tiny_model, dtype="float32", block_size=4, log_stats_interval=0, kv_cache_memory=1 << 20,
              speculative_config=f'{{"method": "draft_model", "model": "{tiny_model}", "num_speculative_tokens": 4}}')
    proposer = llm.engine.core.runner.proposer
    assert proposer.propose_batch([("x", ctx, 4)]) == {"x": greedy[:4]} and proposer.catch_up_seconds > 0
    # one draft accepted, then the target's token: the draft reads that token alone
    assert proposer.propose_batch([("x", ctx + greedy[:2], 4)]) == {"x": greedy[2:6]}
    assert proposer.catch_up_seconds == 0
    # the draft missed steps: it reads 4 tokens, 3 of them in the catch-up pass
    assert proposer.propose_batch([("x", ctx + greedy[:9], 3)]) == {"x": greedy[9:12]}
    assert proposer.catch_up_seconds > 0
    proposer.kv.check_integrity()


def test_a_draft_model_runs_the_fastest_kernels_beside_a_batch_invariant_target(tmp_path, tiny_model):
    """The target's verification decides every token whatever the drafts, so the draft runs the default
    kernels, not batch-invariant ones (which read dense copies of the weights at one row): a mixture of experts,
    which has no batch-invariant path, drafts for a batch-invariant target, whose greedy tokens are unchanged."""
    draft = make_tiny_hf_model(tmp_path, "mixtral")
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    kw = dict(dtype="float32", block_size=4, log_stats_interval=0, kv_cache_memory=1 << 20, batch_invariant=True)
    ref = LLM(tiny_model, **kw).generate(PROMPTS, params, use_tqdm=False)
    llm = LLM(tiny_model, **kw, speculative_length="3",
              speculative_config=f'{{"method": "draft_model", "model": "{draft}", "num_speculative_tokens": 4}}')
    assert llm.engine.config.batch_invariant and llm.engine.core.runner.model.batch_invariant
    assert not llm.engine.core.runner.proposer.runner.config.batch_invariant
    outs = llm.generate(PROMPTS, params, use_tqdm=False)
    assert [o.token_ids for o in outs] == [o.token_ids for o in ref]
    assert llm.engine.make_stats().num_spec_draft_tokens_total > 0


def test_a_pd_consumer_speculates_and_answers_the_colocated_greedy_text(tiny_model):
    """Prefill on a producer (a ``goodserve serve`` subprocess), decode on a consumer that speculates: the
    answer is the greedy text of a colocated engine without speculation, and the consumer verified drafts."""
    import httpx

    from goodserve.engine.args import EngineArgs
    from goodserve.engine.async_engine import AsyncEngine
    from goodserve.engine.engine import Engine
    from goodserve.server.app import build_app
    from server_fixtures import ServeProcess, ServerThread, wait_idle

    prompt = "one two three four one two three four one two three four one two three"
    ref = LLM(tiny_model, dtype="float32", num_blocks=256, block_size=4, log_stats_interval=0).generate(
        [prompt], SamplingParams(temperature=0, max_tokens=24, ignore_eos=True), use_tqdm=False)[0]
    producer = ServeProcess(tiny_model, "--kv-role", "producer", "--num-blocks", "256")
    consumer = AsyncEngine(Engine(EngineArgs(model=tiny_model, dtype="float32", num_blocks=256, block_size=4,
                                             log_stats_interval=0, kv_role="consumer", speculative_config=NGRAM)))
    try:
        body = {"model": "tiny", "prompt": prompt, "temperature": 0, "ignore_eos": True}
        with ServerThread(build_app(consumer, served_model_name="tiny")) as srv:
            first = httpx.post(producer.base_url + "/v1/completions", timeout=60,
                               json={**body, "max_tokens": 1, "kv_transfer_params": {"do_remote_decode": True}})
            assert first.status_code == 200, first.text
            r = httpx.post(srv.base_url + "/v1/completions", timeout=60,
                           json={**body, "max_tokens": 24, "kv_transfer_params": first.json()["kv_transfer_params"]})
            assert r.status_code == 200, r.text
            assert r.json()["choices"][0]["text"] == ref.outputs[0].text
            wait_idle(consumer)
            assert consumer.stats.num_spec_draft_tokens_total > 0
    finally:
        consumer.shutdown()
        producer.close()
