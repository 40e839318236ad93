"""Speculation lengths per request (issue 33): a row's drafts are priced by the class of its last verification
(none, some or all of its drafts accepted), and ``auto`` chooses a length per class."""

from __future__ import annotations

import itertools

import pytest

from factories import create_requests
from goodserve.scheduler.step_time import StepCoefficients, StepTimeModel
from goodserve.spec.config import SpeculativeConfig
from goodserve.spec.length import AcceptanceStats, RowGroup, choose_length, choose_lengths, parts_seconds, wilson
from goodserve.spec.outcomes import (ALL, CLASS_PRIOR_ROWS, FRESH, NONE, OUTCOME_TOKENS, SOME, ClassStats,
                                     row_class)
from goodserve.spec.speculator import Speculator

#: A step of 10 ms and 1 ms a token.
MODEL = StepCoefficients(0.010, 0.001, 0.0, 0.0)


def _decoding(n: int = 1, drafts: int = 4):
    reqs = create_requests(n, prompt_len=100, max_tokens=1000)
    for r in reqs:
        r.num_computed_tokens = 100
        r.append_output_token(7)
        r.spec_token_ids = [7] * drafts
    return reqs


def test_a_row_is_classed_by_its_last_verification_until_it_is_old():
    (r,) = _decoding()
    stats = ClassStats(4)
    assert row_class(r) == FRESH  # never verified
    for drafts, accepted, cls in ((4, 4, ALL), (4, 0, NONE), (3, 1, SOME), (2, 2, ALL)):
        for _ in range(accepted + 1):  # the scheduler appends the accepted drafts and the token after them
            r.append_output_token(7)
        stats.record(r, drafts, accepted)
        assert row_class(r) == cls
    for _ in range(OUTCOME_TOKENS):
        r.append_output_token(7)
    assert row_class(r) == ALL
    r.append_output_token(7)
    assert row_class(r) == FRESH  # more than OUTCOME_TOKENS tokens since: priced at the engine-wide rates again


def test_a_verification_counts_under_the_class_the_row_was_verified_in():
    """Rows verified as ALL accepted 3 of 4 drafts, as NONE none of 4: each class's counts are its own rows'
    (a FRESH row's are the engine-wide statistics'), shrunk toward the engine-wide rates with
    ``min(CLASS_PRIOR_ROWS, rows)`` pseudo-rows."""
    overall, stats = AcceptanceStats(4), ClassStats(4)
    reqs = _decoding(2)
    for r in reqs:  # both first verified fresh: all accepted
        overall.record(4, 4)
        stats.record(r, 4, 4)
    for _ in range(10):
        for r, accepted in zip(reqs, (3, 0)):
            cls = row_class(r)
            for _ in range(accepted + 1):
                r.append_output_token(7)
            overall.record(4, accepted)
            stats.record(r, 4, accepted)
            assert row_class(r) == (SOME if accepted else NONE)
    assert cls in (SOME, NONE)
    assert stats.lower_rates(FRESH, overall) == overall.lower_rates()
    d = 0.998
    p, n = overall.rates()[0], overall.rows()[0]
    w = min(CLASS_PRIOR_ROWS, n)
    # NONE's first position: the nine rows verified as NONE (decayed), none accepted.
    reached = sum(d ** i for i in range(9))
    assert stats.lower_rates(NONE, overall)[0] == pytest.approx(wilson(w * p / (reached + w), reached + w, -1.0))
    # ALL's: the second verification of each row (the first classed both ALL): r0's accepted its first draft,
    # r1's did not. SOME's: r0's nine after, each accepting it.
    assert stats.upper_rates(ALL, overall)[0] == pytest.approx(wilson((d + w * p) / (1 + d + w), 1 + d + w, 2.0))
    assert stats.lower_rates(SOME, overall)[0] > overall.lower_rates()[0] > stats.lower_rates(NONE, overall)[0]


def _rate(model, groups, ks):
    seconds = parts_seconds(model, [(len(g.contexts), sum(g.contexts), k) for g, k in zip(groups, ks)], None)
    tokens = sum(len(g.contexts) * AcceptanceStats.expected_tokens(g.rates, k) for g, k in zip(groups, ks))
    return tokens / seconds


def test_each_group_gets_its_own_length():
    """8 rows whose drafts are accepted at 0.95 and 8 at 0.1, each draft one more token of the step. Priced
    apart, the first verify 4 drafts and the others none: 762 tokens/s, against 615 without drafts and 501
    with 4 for every row. Priced alike at the mean rate (0.525), the rows would verify none. The search
    finds the best of every pair of lengths."""
    model = StepTimeModel(MODEL, adapt=False)
    groups = [RowGroup([100] * 8, [0.95] * 4), RowGroup([100] * 8, [0.1] * 4)]
    assert choose_lengths(model, groups, 4) == [4, 0]
    assert _rate(model, groups, [4, 0]) == pytest.approx((8 * sum(0.95 ** i for i in range(5)) + 8) / 0.058)
    assert round(_rate(model, groups, [0, 0])) == 615 and round(_rate(model, groups, [4, 4])) == 501
    assert choose_lengths(model, [RowGroup([100] * 16, [0.525] * 4)], 4) == [0]
    for rows in (1, 16, 32):
        groups = [RowGroup([100] * rows, [0.95] * 4), RowGroup([100] * rows, [0.1] * 4),
                  RowGroup([300] * rows, [0.6] * 4)]
        best = max(itertools.product(range(5), repeat=3), key=lambda ks: (_rate(model, groups, ks), [-k for k in ks]))
        assert tuple(choose_lengths(model, groups, 4)) == best
    # A group without rows gets 0; one group alone is choose_length.
    assert choose_lengths(model, [RowGroup([], [0.9] * 4), RowGroup([100], [0.9] * 4)], 4) == [0, 4]
    stats = AcceptanceStats(4)
    assert choose_lengths(model, [RowGroup([100] * 8, stats.lower_rates())], 4) == \
        [choose_length(model, stats, [100] * 8, 4)]


def test_auto_gives_the_rows_that_copy_drafts_and_the_others_none():
    """Issue 33 (code-copy, served at 4.8 req/s): the speculator groups the step's rows by class. Rows whose
    last verification accepted every draft verify 4 (measured at 0.95), rows whose last accepted none verify
    none (0.1); priced at the engine-wide rates alike, every row would verify none."""
    spec = Speculator(SpeculativeConfig("ngram", 4), StepTimeModel(MODEL, adapt=False))
    copying, other = _decoding(8), _decoding(8)
    for cls, reqs, alpha in ((ALL, copying, 0.95), (NONE, other, 0.1)):
        for r in reqs:
            r.spec_outcome = (cls, r.num_output_tokens)
        spec.classes._reached[cls] = [1e6] * 4  # measured over many rows
        spec.classes._accepted[cls] = [alpha * 1e6] * 4
    spec.stats._reached = [1e6] * 4
    spec.stats._accepted = [0.525e6] * 4
    spec.begin_step(copying + other)
    assert spec.lengths == [0, 0, 0, 4] and spec.length == 4
    assert [len(spec.drafts(r, 100)) for r in copying + other] == [4] * 8 + [0] * 8
    for r in copying:
        r.spec_outcome = None  # fresh: the engine-wide rates
    spec.begin_step(copying + other)
    assert spec.length == 0


def test_a_step_whose_rows_have_no_drafts_asks_for_them_and_counts_as_one_without():
    """A row without drafts verifies none whatever the length: the step is one without drafts (so 16 of them
    bring a probe), and the runner is asked for the drafts the row would verify had it some."""
    spec = Speculator(SpeculativeConfig("ngram", 4), StepTimeModel(StepCoefficients(0.010, 0.0, 0.0, 0.0),
                                                                   adapt=False))
    (r,) = _decoding(drafts=0)
    spec.begin_step([r])
    assert spec.length == 0 and spec.lookahead(r) == 4 and spec._at_zero == [1, 0]
    r.spec_token_ids = [7] * 4
    spec.begin_step([r])
    assert spec.length == 4 and spec._at_zero == [0, 0] and len(spec.drafts(r, 100)) == 4


def test_a_row_is_priced_at_the_drafts_it_has():
    """A prompt lookup finds fewer drafts than the length for some rows: a row verifies at most those, and the
    step is priced so. 8 rows at 0.95 with one draft each, 8 with four: at length 4 the step computes 56
    positions (66 ms; priced at four drafts for every row, 80 positions), and its expected tokens are those of
    one and four drafts. Its rows' TPOT allowances are read at the drafts each has."""
    model = StepTimeModel(MODEL, adapt=False)
    rates = [0.95] * 4
    group = RowGroup([100] * 16, rates, drafts=[1] * 8 + [4] * 8)
    assert parts_seconds(model, [(8, 800, 1), (8, 800, 4)], None) == pytest.approx(0.010 + 0.001 * 56)
    e1, e4 = (AcceptanceStats.expected_tokens(rates, k) for k in (1, 4))
    assert choose_lengths(model, [group], 4) == [4]
    assert _rate(model, [RowGroup([100] * 8, rates), RowGroup([100] * 8, rates)], [1, 4]) == \
        pytest.approx(8 * (e1 + e4) / 0.066)
    # A row with one draft allowing 40 ms and 10 ms a further token: 49.5 ms at its 1.95 tokens. The 66-ms step
    # of length 4 and the 50-ms one of length 2 break it, the 42-ms one of length 1 does not. Had it four
    # drafts, length 4 would keep it (40 + 35.2 ms).
    tight = group._replace(allowances=[(0.040, 0.010, 1)])
    assert choose_lengths(model, [tight], 4) == [1]
    assert choose_lengths(model, [group._replace(allowances=[(0.040, 0.010)])], 4) == [4]
