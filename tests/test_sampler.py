"""Exact CPU tests of the token sampler (runner/sampler.py)."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from goodserve.runner.sampler import (
    Sampler,
    SamplingMetadata,
    SamplingRow,
    apply_min_tokens,
    apply_penalties,
)
from goodserve.sampling_params import SamplingParams

V = 6
# A hand-made distribution with well separated cumulative masses: 0.4 0.65 0.8 0.9 0.96 1.0.
PROBS = torch.tensor([0.40, 0.25, 0.15, 0.10, 0.06, 0.04])
LOGITS6 = PROBS.log()


def row(prompt=(), output=(), eos=(), **kw) -> SamplingRow:
    return SamplingRow(SamplingParams(**kw), list(prompt), list(output), tuple(eos))


def meta(rows, vocab_size=V) -> SamplingMetadata:
    return SamplingMetadata.from_requests(rows, vocab_size, "cpu")


def sample(logits, rows, seed=0):
    return Sampler(seed)(logits, meta(rows, logits.shape[1]))


def support(num_draws=3000, **kw) -> set[int]:
    """Tokens drawn from LOGITS6 over many unseeded rows and a few engine seeds."""
    seen: set[int] = set()
    for engine_seed in range(2):
        out = sample(LOGITS6.expand(num_draws, V), [row(**kw)] * num_draws, seed=engine_seed)
        seen |= set(out.token_ids)
    # Also through per-request seeds.
    seeded = [row(seed=s, **kw) for s in range(300)]
    seen |= set(sample(LOGITS6.expand(300, V), seeded).token_ids)
    return seen


def test_greedy_is_argmax():
    logits = torch.randn(16, 50, generator=torch.Generator().manual_seed(1))
    out = sample(logits, [row(temperature=0.0)] * 16)
    assert out.token_ids == logits.argmax(-1).tolist()
    assert out.logprobs is None and out.top_logprobs is None


def test_greedy_accepts_half_precision_and_leaves_logits_untouched():
    logits = torch.randn(4, 30, generator=torch.Generator().manual_seed(2))
    before = logits.clone()
    out = sample(logits.to(torch.bfloat16), [row(temperature=0.0, repetition_penalty=1.3, prompt=[1])] * 4)
    assert len(out.token_ids) == 4
    out = sample(logits, [row(temperature=0.0, repetition_penalty=1.3, prompt=[1, 2])] * 4)
    assert torch.equal(logits, before)


def test_top_k_1_equals_argmax():
    logits = torch.randn(32, 100, generator=torch.Generator().manual_seed(3))
    rows = [row(temperature=1.5, top_k=1, seed=i if i % 2 else None) for i in range(32)]
    assert sample(logits, rows).token_ids == logits.argmax(-1).tolist()


@pytest.mark.parametrize(
    "kw, expected",
    [
        ({}, {0, 1, 2, 3, 4, 5}),
        ({"top_k": 3}, {0, 1, 2}),
        ({"top_k": -1}, {0, 1, 2, 3, 4, 5}),
        ({"top_p": 0.5}, {0, 1}),
        ({"top_p": 0.7}, {0, 1, 2}),
        ({"top_p": 0.85}, {0, 1, 2, 3}),
        ({"top_p": 0.1}, {0}),
        ({"min_p": 0.3}, {0, 1, 2}),  # 0.3 * 0.4 = 0.12
        ({"min_p": 0.2}, {0, 1, 2, 3}),  # 0.08
        # top-p after top-k renormalises over 4 tokens: 0.444 0.722 0.889 1.0
        ({"top_k": 4, "top_p": 0.8}, {0, 1, 2}),
        ({"top_k": 5, "min_p": 0.12}, {0, 1, 2, 3, 4}),  # 0.048
        ({"top_p": 0.99, "min_p": 0.3}, {0, 1, 2}),
    ],
)
def test_filters_keep_exactly_the_expected_support(kw, expected):
    assert support(temperature=1.0, **kw) == expected


def test_penalties_change_logits_by_exact_amounts():
    logits = torch.tensor([[2.0, -1.0, 0.5, 3.0, -2.0, 0.0]] * 3)
    rows = [
        # Repetition over prompt + output, each distinct token once.
        row(prompt=[0, 1, 1], output=[0, 4], repetition_penalty=2.0),
        # Presence: once per distinct output token; frequency: once per occurrence.
        row(prompt=[5], output=[3, 3, 2], presence_penalty=0.5, frequency_penalty=0.25),
        row(prompt=[0], output=[1]),  # no penalties
    ]
    out = apply_penalties(logits, meta(rows))
    expected = logits.clone()
    expected[0, 0] = 2.0 / 2.0
    expected[0, 1] = -1.0 * 2.0
    expected[0, 4] = -2.0 * 2.0
    expected[1, 3] = 3.0 - 0.5 - 2 * 0.25
    expected[1, 2] = 0.5 - 0.5 - 1 * 0.25
    torch.testing.assert_close(out, expected, rtol=0, atol=0)
    assert torch.equal(logits[0], torch.tensor([2.0, -1.0, 0.5, 3.0, -2.0, 0.0]))  # input untouched


def test_repetition_then_additive_penalties_compose():
    logits = torch.tensor([[4.0, 1.0, 1.0]])
    rows = [row(output=[0, 0], repetition_penalty=2.0, frequency_penalty=1.0)]
    out = apply_penalties(logits, meta(rows, 3))
    assert out[0, 0].item() == 4.0 / 2.0 - 2 * 1.0


def test_penalties_steer_greedy():
    logits = torch.tensor([[3.0, 2.9, 0.0, 0.0]])
    assert sample(logits, [row(temperature=0.0)]).token_ids == [0]
    assert sample(logits, [row(temperature=0.0, output=[0], presence_penalty=0.2)]).token_ids == [1]


def test_min_tokens_blocks_eos_and_stop_ids_until_reached():
    logits = torch.tensor([[0.0, 0.0, 10.0, 9.0, 8.0, 0.0]])
    # EOS=2, stop id 3; min_tokens 2 with 1 token so far: both blocked, ignore_eos or not.
    for ignore_eos in (False, True):
        r = row(output=[5], eos=(2,), min_tokens=2, stop_token_ids=[3], temperature=0.0,
                ignore_eos=ignore_eos)
        blocked = apply_min_tokens(logits, meta([r]))
        assert blocked[0, 2] == -math.inf and blocked[0, 3] == -math.inf
        assert sample(logits, [r]).token_ids == [4]
    # Reached: nothing blocked.
    r = row(output=[5, 5], eos=(2,), min_tokens=2, stop_token_ids=[3], temperature=0.0)
    assert sample(logits, [r]).token_ids == [2]
    # Sampled rows never draw blocked tokens either.
    rs = [row(output=[], eos=(2,), min_tokens=1, stop_token_ids=[3], seed=s) for s in range(200)]
    assert not {2, 3} & set(sample(logits.expand(200, V), rs).token_ids)


def test_seeded_row_is_independent_of_batch_and_position():
    """Real-world case C13: each request's tokens depend only on its own seed and prompt.

    The same seeded row gives the same token alone, in a batch of 8 mixed rows (greedy, unseeded,
    other seeds, other filters), and at another batch position.
    """
    gen = torch.Generator().manual_seed(4)
    vocab = 1000
    target_logits = torch.randn(vocab, generator=gen) * 0.5
    target = row(output=[1, 2, 3], temperature=0.9, top_p=0.95, seed=1234)
    alone = sample(target_logits[None], [target], seed=0).token_ids[0]
    others = [
        row(temperature=0.0),
        row(temperature=1.0),
        row(temperature=0.7, top_k=5, seed=7),
        row(temperature=1.2, min_p=0.1),
        row(temperature=1.0, presence_penalty=1.0, output=[3]),
        row(temperature=0.5, seed=99),
        row(temperature=0.0, repetition_penalty=1.2, prompt=[1]),
    ]
    for pos in (0, 3, 7):
        for engine_seed in (0, 1):
            rows = others[:pos] + [target] + others[pos:]
            logits = torch.randn(8, vocab, generator=gen)
            logits[pos] = target_logits
            assert sample(logits, rows, seed=engine_seed).token_ids[pos] == alone
    # The same step repeats whatever the engine seed (a preempted request recomputes the same).
    again = sample(target_logits[None], [target], seed=5).token_ids[0]
    assert again == alone


def test_different_seeds_give_different_samples():
    flat = torch.zeros(64, 1000)
    tokens = sample(flat, [row(seed=s) for s in range(64)]).token_ids
    assert len(set(tokens)) > 50
    # And one seed over many steps is not stuck on one token.
    steps = [sample(flat[:1], [row(seed=3, output=[0] * n)]).token_ids[0] for n in range(20)]
    assert len(set(steps)) > 15


def test_unseeded_rows_follow_engine_seed():
    flat = torch.zeros(16, 1000)
    rows = [row()] * 16
    assert sample(flat, rows, seed=1).token_ids == sample(flat, rows, seed=1).token_ids
    assert sample(flat, rows, seed=1).token_ids != sample(flat, rows, seed=2).token_ids


def test_greedy_logprobs_equal_log_softmax_at_argmax():
    logits = torch.randn(5, 40, generator=torch.Generator().manual_seed(5))
    rows = [row(temperature=0.0, logprobs=0)] * 5
    out = sample(logits, rows)
    lsm = logits.log_softmax(-1)
    expected = lsm.gather(1, logits.argmax(-1, keepdim=True)).squeeze(1)
    torch.testing.assert_close(torch.tensor(out.logprobs), expected)
    assert out.top_logprobs is None  # logprobs=0 asks for the sampled token's only


@pytest.mark.parametrize("kw", [dict(top_k=2), dict(temperature=0.5), dict(temperature=1.7, top_p=0.5),
                                dict(min_p=0.3, temperature=1.3), dict(temperature=0.0)])
def test_logprobs_are_the_processed_distribution_whatever_the_sampling_C16(kw):
    """C16: one distribution, the model's (after logit processors, before temperature and filters): the
    sampled token's logprob equals its entry in the top logprobs and does not move with temperature, top-k,
    top-p or min-p."""
    rows = [row(logprobs=V, seed=s, **kw) for s in range(50)]
    out = sample(LOGITS6.expand(50, V), rows)
    for tok, lp, top in zip(out.token_ids, out.logprobs, out.top_logprobs):
        assert lp == pytest.approx(math.log(PROBS[tok].item()), abs=1e-6)
        assert dict(top)[tok] == lp  # the same number, to the bit
        assert [t for t, _ in top] == [0, 1, 2, 3, 4, 5]


def test_logit_bias_is_a_logit_processor_C17():
    """C17: logit_bias adds to the logits; -100 bans the argmax, +100 forces a token; logprobs include it."""
    banned = sample(LOGITS6.expand(1, V), [row(temperature=0.0, logit_bias={0: -100.0}, logprobs=1)])
    assert banned.token_ids == [1]
    forced = sample(LOGITS6.expand(200, V), [row(logit_bias={5: 100.0}, seed=s) for s in range(200)])
    assert set(forced.token_ids) == {5}
    mixed = sample(LOGITS6.expand(3, V), [row(temperature=0.0), row(temperature=0.0, logit_bias={3: 100.0}),
                                          row(temperature=0.0, logit_bias={0: -100.0, 99: 5.0})])
    assert mixed.token_ids == [0, 3, 1]  # per row; an id past the vocabulary is ignored
    expected = (LOGITS6 + torch.tensor([-100.0, 0, 0, 0, 0, 0])).log_softmax(-1)[1].item()
    assert banned.logprobs[0] == pytest.approx(expected, abs=1e-6)


@pytest.mark.parametrize("kw", [dict(temperature=1e-40), dict(temperature=2.0, top_p=1e-9),
                                dict(temperature=0.01, top_k=1, min_p=1.0), dict(repetition_penalty=1e-9),
                                dict(repetition_penalty=1e9, presence_penalty=2.0, frequency_penalty=-2.0),
                                dict(temperature=1e-5, logit_bias={0: -100.0, 1: 100.0})])
def test_no_nan_or_inf_reaches_a_token_or_logprob_C14(kw):
    """C14: whatever the penalties and filters, the chosen token is a real one and every logprob finite."""
    logits = torch.randn(8, 50, generator=torch.Generator().manual_seed(3)) * 30
    rows = [row(prompt=[1, 2, 3], output=[4, 4, 5], logprobs=5, seed=i, **kw) for i in range(8)]
    out = sample(logits, rows)
    assert all(0 <= t < 50 for t in out.token_ids)
    assert all(math.isfinite(v) for v in out.logprobs)
    assert all(math.isfinite(v) for top in out.top_logprobs for _, v in top)


def test_top_logprobs_sorted_and_of_length_k():
    logits = torch.randn(4, 100, generator=torch.Generator().manual_seed(6))
    rows = [row(temperature=0.0, logprobs=5), row(temperature=0.8, logprobs=3, seed=1),
            row(temperature=0.0), row(temperature=1.0, logprobs=20)]
    out = sample(logits, rows)
    assert [len(t) for t in out.top_logprobs] == [5, 3, 0, 20]
    lsm = logits.log_softmax(-1)
    for i, top in enumerate(out.top_logprobs):
        values = [v for _, v in top]
        assert values == sorted(values, reverse=True)
        for tok, v in top:
            assert v == pytest.approx(lsm[i, tok].item(), abs=1e-5)
        if top:
            assert top[0][0] == logits[i].argmax().item()
    assert out.logprobs[2] == pytest.approx(lsm[2].max().item(), abs=1e-5)


def test_metadata_fast_path_flags():
    m = meta([row(temperature=0.0)] * 3)
    assert m.all_greedy and m.no_penalties and m.top_k is None and m.top_p is None and m.min_p is None
    m = meta([row(temperature=0.0, top_p=0.5, top_k=2), row(temperature=1.0)])
    assert not m.all_greedy and not m.all_random and m.top_p is None and m.top_k is None
    m = meta([row(top_k=3, output=[1], frequency_penalty=0.1)])
    assert m.all_random and not m.no_penalties and m.top_k.tolist() == [3]
    with pytest.raises(ValueError):
        SamplingMetadata.from_requests([], V, "cpu")


@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    data=st.data(),
    # Above 256 tokens top-p first looks among the best 256 and falls back to a full sort.
    vocab=st.one_of(st.integers(2, 40), st.sampled_from([300, 700])),
    num_rows=st.integers(1, 6),
    scale=st.sampled_from([0.1, 3.0, 10.0]),
)
def test_sampled_tokens_lie_in_the_allowed_support(data, vocab, num_rows, scale):
    seed = data.draw(st.integers(0, 2**31))
    logits = torch.randn(num_rows, vocab, generator=torch.Generator().manual_seed(seed)) * scale
    rows = []
    for _ in range(num_rows):
        rows.append(row(
            temperature=data.draw(st.sampled_from([0.0, 0.3, 1.0, 2.0])),
            top_k=data.draw(st.one_of(st.integers(-1, 40), st.integers(-1, vocab + 2))),
            top_p=data.draw(st.floats(0.05, 1.0)),
            min_p=data.draw(st.floats(0.0, 1.0)),
            seed=data.draw(st.one_of(st.none(), st.integers(-(2**40), 2**40))),
        ))
    out = sample(logits, rows, seed=seed)
    for i, (r, tok) in enumerate(zip(rows, out.token_ids)):
        p = r.params
        x = logits[i].double()
        if p.greedy:
            assert tok == x.argmax().item()
            continue
        x = x / p.temperature
        order = x.argsort(descending=True)
        rank = (order == tok).nonzero().item()
        # top-k (ties with the k-th logit are allowed)
        if p.top_k > 0:
            kth = x[order[min(p.top_k, vocab) - 1]]
            assert x[tok] >= kth
            x = torch.where(x >= kth, x, torch.tensor(-math.inf, dtype=x.dtype))
        probs = x.softmax(-1)
        sorted_probs = probs[order]
        mass_before = sorted_probs[:rank].sum().item()
        if p.top_p < 1.0 and rank > 0:
            assert mass_before < p.top_p + 1e-5
        assert probs[tok] >= p.min_p * probs.max() - 1e-6


def test_sampling_frequencies_match_probabilities():
    n = 20000
    out = sample(LOGITS6.expand(n, V), [row()] * n, seed=11)
    freq = torch.bincount(torch.tensor(out.token_ids), minlength=V).double() / n
    torch.testing.assert_close(freq, PROBS.double(), rtol=0, atol=0.015)


@pytest.mark.parametrize("top_k", [0, 100, 400])
def test_top_p_candidate_path_and_full_sort_agree(top_k):
    """Rows whose nucleus fits in the best 256 tokens and rows that need the full sort.

    Each row's support must match a float64 reference, and a seeded row's token must not depend on
    which path its neighbours take.
    """
    vocab = 1000
    gen = torch.Generator().manual_seed(8)
    peaked = torch.randn(vocab, generator=gen) * 8  # nucleus of a few tokens
    flat = torch.randn(vocab, generator=gen) * 0.1  # nucleus of ~900 tokens
    for logits in (peaked, flat):
        n = 400
        rows = [row(top_p=0.9, top_k=top_k, seed=s) for s in range(n)]
        seen = set(sample(logits.expand(n, vocab), rows).token_ids)
        x = logits.double()
        order = x.argsort(descending=True)
        if top_k:
            x = torch.where(x >= x[order[top_k - 1]], x, torch.tensor(-math.inf, dtype=x.dtype))
        p = x.softmax(-1)[order]
        nucleus = int(((p.cumsum(0) - p) < 0.9).sum())
        allowed = set(order[:nucleus].tolist())
        assert seen <= allowed
        if nucleus <= 10:
            assert seen == allowed
    target = row(top_p=0.9, top_k=top_k, seed=42, output=[1])
    alone = sample(flat[None], [target]).token_ids[0]
    batch = torch.stack([peaked, flat, peaked])
    rows = [row(top_p=0.5), target, row(top_p=0.95, top_k=300)]
    assert sample(batch, rows).token_ids[1] == alone
