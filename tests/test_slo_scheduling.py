"""The ``slo`` scheduling policy (issue 14) on hand-made timelines through the simulator, whose cost model is
fixed and linear, so the scheduler's own step-time model predicts every step exactly: EDF order, the late
and shed decisions, the per-step token budget from the TPOT SLO, the admission stop and the preemption
victim, each to the exact value. Plus the online step-time model, and the policy through the engine and the
server."""

from __future__ import annotations

import dataclasses
import json
import math
import random

import numpy as np
import pytest

from goodserve.config import CacheConfig, SchedulerConfig
from goodserve.request_options import RequestOptions
from goodserve.request import Request, RequestStatus
from goodserve.sampling_params import SamplingParams
from goodserve.scheduler.output import SampledToken, SchedulerOutput, StepShape
from goodserve.scheduler.scheduler import Scheduler
from goodserve.scheduler.policy import Triage
from goodserve.scheduler.slo import SLOPolicy, SLOUnattainableError
from goodserve.scheduler.slo_pace import SLOPredictor
from goodserve.scheduler.step_time import DEFAULT_SEED, StepCoefficients, StepTimeModel
from goodserve.sim.cost_model import LinearCostModel
from goodserve.sim.simulator import Simulator
from goodserve.sim.spec import ClusterConfig, SimRequest

# A step costs 10 ms plus 1 ms per computed token: a 100-token prefill step takes 0.11 s.
COST = LinearCostModel(StepCoefficients(overhead_s=0.010, per_token_s=0.001, per_sampled_s=0.0, per_pair_s=0.0))


def run(policy: str, requests: list[SimRequest], budget: int = 100, shed_load: bool = False,
        max_num_seqs: int = 16, slos=None):
    config = ClusterConfig(SchedulerConfig(max_num_batched_tokens=budget, max_num_seqs=max_num_seqs,
                                           max_model_len=1024, policy=policy, shed_load=shed_load),
                           CacheConfig(num_blocks=256, block_size=4))
    sim = Simulator(config, COST, requests, slos)
    result = sim.run()
    for inst in sim.instances:  # nothing leaks, whatever was shed
        kv = inst.scheduler.kv_cache_manager
        kv.check_integrity()
        assert kv.num_free_blocks == kv.num_blocks
    return sim, result


def ttfts(result) -> list:
    return [None if r.ttft is None else round(r.ttft, 9) for r in result.records]


# ----------------------------------------------------------------------------------------- order
def test_edf_order_by_ttft_slack():
    """Three 100-token prompts at t=0, one prefill per step (0.11 s): fcfs serves them in arrival order, slo
    by deadline minus own prefill time (C, then B, then A)."""
    reqs = [SimRequest("A", 0.0, 100, 1, slo_ttft=10.0), SimRequest("B", 0.0, 100, 1, slo_ttft=5.0),
            SimRequest("C", 0.0, 100, 1, slo_ttft=1.0)]
    assert ttfts(run("fcfs", reqs)[1]) == [0.11, 0.22, 0.33]
    assert ttfts(run("slo", reqs)[1]) == [0.33, 0.22, 0.11]


def test_a_request_that_cannot_meet_its_ttft_goes_behind_the_others():
    """B and C (TTFT SLO 0.15 s) and A (1 s): only one of B and C can have its first token by 0.15 s. fcfs
    serves A first and both miss; slo serves B, then A (still in time), and C, now late, last."""
    reqs = [SimRequest("A", 0.0, 100, 1, slo_ttft=1.0), SimRequest("B", 0.0, 100, 1, slo_ttft=0.15),
            SimRequest("C", 0.0, 100, 1, slo_ttft=0.15)]
    fcfs, slo = run("fcfs", reqs)[1], run("slo", reqs)[1]
    assert ttfts(fcfs) == [0.11, 0.22, 0.33]
    assert ttfts(slo) == [0.22, 0.11, 0.33]
    assert [r.ttft <= s.slo_ttft for r, s in zip(slo.records, reqs)] == [True, True, False]


def test_shed_load_refuses_on_arrival_when_the_queue_ahead_is_too_long():
    """With shedding, C is refused as it arrives: B (same key, ahead) and C need 0.22 s > 0.15 s."""
    reqs = [SimRequest("A", 0.0, 100, 1, slo_ttft=1.0), SimRequest("B", 0.0, 100, 1, slo_ttft=0.15),
            SimRequest("C", 0.0, 100, 1, slo_ttft=0.15)]
    sim, result = run("slo", reqs, shed_load=True)
    assert ttfts(result) == [0.22, 0.11, None]
    assert "cannot meet this request's TTFT SLO of 150 ms" in result.records[2].error
    assert "predicted after 220 ms" in result.records[2].error
    assert sim.instances[0].scheduler.make_stats().num_shed_total == 1


def test_the_ttft_prediction_charges_the_last_step_only_its_own_tokens():
    """A 30-token prompt alone takes one 0.04 s step, a 130-token one a full 0.11 s step and a 0.04 s one:
    both are admitted under TTFT SLOs a full-budget last step (0.11 s, 0.22 s) would call unattainable, and both
    meet them. (Charging every step a whole token budget shed short prompts on a slow machine.)"""
    reqs = [SimRequest("short", 0.0, 30, 1, slo_ttft=0.05), SimRequest("long", 1.0, 130, 1, slo_ttft=0.16)]
    sim, result = run("slo", reqs, shed_load=True)
    assert ttfts(result) == [0.04, 0.15]
    assert sim.instances[0].scheduler.make_stats().num_shed_total == 0


def test_shed_load_sheds_a_queued_request_that_became_late():
    """A (TTFT SLO 0.2 s) is in time when it arrives; B (0.12 s) arrives at the same instant and goes ahead
    of it, after which A's first token would come at 0.22 s: the first schedule sheds A."""
    reqs = [SimRequest("A", 0.0, 100, 1, slo_ttft=0.2), SimRequest("B", 0.0, 100, 1, slo_ttft=0.12)]
    sim, result = run("slo", reqs, shed_load=True)
    assert ttfts(result) == [None, 0.11]
    assert result.records[0].error.startswith("shed: its TTFT SLO of 200 ms can no longer be met")
    # Without shedding A is late, not dropped: served after B.
    assert ttfts(run("slo", reqs)[1]) == [0.22, 0.11]


def _stalled_prefill(shed_load: bool):
    """P (200 tokens, TTFT SLO 1 s) gets its first 100-token chunk at t=0; the machine then stalls and the next
    step is scheduled at 0.95 s, when P's last chunk (0.11 s) would end at 1.06 s: too late."""
    sched = Scheduler(SchedulerConfig(max_num_batched_tokens=100, max_model_len=1024, policy="slo",
                                      shed_load=shed_load),
                      CacheConfig(num_blocks=128, block_size=4), StepTimeModel(StepCoefficients(0.01, 0.001, 0, 0),
                                                                               adapt=False))
    p = Request("P", list(range(200)), SamplingParams(max_tokens=2), arrival_time=0.0, max_tokens=2,
                options=RequestOptions(slo_ttft=1.0))
    sched.add_request(p)
    first = sched.schedule(0.0)
    assert [(s.request_id, s.num_new_tokens) for s in first.scheduled] == [("P", 100)]
    assert sched.update_from_output(first, {}, 0.11) == []
    return sched, p, sched.schedule(0.95)


def test_a_running_prompt_that_became_late_is_shed_before_it_streams():
    """With shedding, P is shed while still prefilling: it ends with ``shed`` and its blocks are freed in the
    same step; without, it runs on, marked late (behind every prompt that can still make it)."""
    sched, p, step = _stalled_prefill(shed_load=True)
    assert step.is_empty
    [out] = sched.update_from_output(step, {}, 0.95)
    assert out.request_id == "P" and out.finish_reason == "shed"
    assert out.error.startswith("shed: its TTFT SLO of 1000 ms can no longer be met (950 ms after arrival")
    assert sched.kv_cache_manager.num_free_blocks == 128 and not sched.has_unfinished_requests()
    sched, p, step = _stalled_prefill(shed_load=False)
    assert [(s.request_id, s.num_new_tokens) for s in step.scheduled] == [("P", 100)] and p.slo_late
    # The first preemption victim among prefilling requests.
    assert sched.policy.predict.slack(p, 0.95, sched.plan.figures) == math.inf


def test_the_ttft_prediction_paces_prefill_by_the_tightest_tpot():
    """D decodes under a 60.5-ms TPOT SLO (a decode step takes 11 ms), so a step beside it holds 49 prompt
    tokens (10 + 50 x 1 ms = 60 ms), not the 99 the token budget leaves: a 147-token prompt is predicted to
    need three such steps, 0.18 s. With a TTFT SLO of 0.17 s it is refused on arrival; with 0.19 s it is
    admitted."""
    sched = Scheduler(SchedulerConfig(max_num_batched_tokens=100, max_model_len=1024, policy="slo", shed_load=True),
                      CacheConfig(num_blocks=256, block_size=4), StepTimeModel(StepCoefficients(0.01, 0.001, 0, 0),
                                                                               adapt=False))
    sched.add_request(Request("D", [1, 2, 3], SamplingParams(max_tokens=50), 0.0, max_tokens=50,
                              options=RequestOptions(slo_tpot=0.0605)))
    step = sched.schedule(0.0)
    sched.update_from_output(step, {"D": SampledToken(5)}, 0.013)
    pace = sched.policy.predict.prefill_pace(sched.running, 0.013)
    assert (pace.chunk, pace.banked) == (49, [])  # D may stop at any token: no time banked ahead
    with pytest.raises(SLOUnattainableError, match="predicted after 180 ms"):
        sched.add_request(Request("P", list(range(147)), SamplingParams(max_tokens=2), 0.013, max_tokens=2,
                                  options=RequestOptions(slo_ttft=0.17)))
    sched.add_request(Request("Q", list(range(147)), SamplingParams(max_tokens=2), 0.013, max_tokens=2,
                              options=RequestOptions(slo_ttft=0.19)))


def test_the_ttft_prediction_spends_the_time_a_request_of_known_length_banked():
    """As above, but D's length is forced (exactly ``max_tokens``, as the bench client sends): with 49 tokens
    to come its TPOT average lets the next step take 60.5 + 48 x (60.5 - 11) ms = 2.4365 s, and every step of
    t leaves t - 60.5 ms less. So prefill runs at the full 99-token budget (0.11 s) for as long as that lasts:
    the 147-token prompt is predicted at 0.11 + 0.059 = 0.169 s and admitted under a TTFT SLO of 0.17 s,
    which it meets. With 2 tokens to come (a = 110 ms), one full step is banked, then the 49-token pace."""
    def scheduler(max_tokens: int):
        sched = Scheduler(SchedulerConfig(max_num_batched_tokens=100, max_model_len=1024, policy="slo",
                                          shed_load=True), CacheConfig(num_blocks=256, block_size=4),
                          StepTimeModel(StepCoefficients(0.01, 0.001, 0, 0), adapt=False))
        sched.add_request(Request("D", [1, 2, 3], SamplingParams(max_tokens=max_tokens, ignore_eos=True), 0.0,
                                  max_tokens=max_tokens, options=RequestOptions(slo_tpot=0.0605)))
        sched.update_from_output(sched.schedule(0.0), {"D": SampledToken(5)}, 0.013)
        return sched

    sched = scheduler(50)
    pace = sched.policy.predict.prefill_pace(sched.running, 0.013)
    assert pace.chunk == 49 and pace.banked[:2] == [(99, pytest.approx(0.11)), (198, pytest.approx(0.22))]
    with pytest.raises(SLOUnattainableError, match="predicted after 169 ms"):
        sched.add_request(Request("P", list(range(147)), SamplingParams(max_tokens=2), 0.013, max_tokens=2,
                                  options=RequestOptions(slo_ttft=0.16)))
    sched.add_request(Request("Q", list(range(147)), SamplingParams(max_tokens=2), 0.013, max_tokens=2,
                              options=RequestOptions(slo_ttft=0.17)))
    step = sched.schedule(0.013)
    assert sorted((s.request_id, s.num_new_tokens) for s in step.scheduled) == [("D", 1), ("Q", 99)]
    sched.update_from_output(step, {"D": SampledToken(5)}, 0.123)
    step = sched.schedule(0.123)
    assert sorted((s.request_id, s.num_new_tokens) for s in step.scheduled) == [("D", 1), ("Q", 48)]

    sched = scheduler(3)
    pace = sched.policy.predict.prefill_pace(sched.running, 0.013)
    assert pace.chunk == 49 and pace.banked == [(99, pytest.approx(0.11))]
    # 99 banked tokens, two 49-token steps (0.06 s each), and 3 tokens (0.014 s) for a 200-token prompt.
    assert sched.policy.predict.first_token_time(200, pace, 0.013) == pytest.approx(0.013 + 0.11 + 0.12 + 0.014)


# A step with a prompt chunk costs 40 ms more than one of decodes alone (a CPU engine's one-call decode step,
# CUDA graphs on a GPU): 10 ms + 1 ms per token, + 40 ms with a chunk. A chunk under 40 tokens costs more in
# that overhead than in its own tokens.
CHUNK_OVERHEAD = StepCoefficients(0.010, 0.001, 0.0, 0.0, prefill_overhead_s=0.040)


def test_a_chunk_too_small_to_pay_for_its_step_waits_for_time_banked_by_decodes():
    """D (TPOT SLO 60.5 ms, may stop at any token) streams from 0.06 s; P's 100-token prompt arrives at
    0.015 s. At 0.06 s D's next deadline leaves 60.5 ms: 9 of P's tokens (51 + 9 ms), below the 40 tokens
    worth the overhead, so the step is D's decode alone (11 ms). At 0.071 s D has banked 49.5 ms more: 58
    tokens (110 ms). At 0.18 s again 10 tokens would fit, and D decodes alone; at 0.191 s P's last 42 run
    (93 ms). P's first token comes 0.269 s after it arrived and D's TPOT stays ~17 ms. The policy before
    this rule (a chunk each step, cut to fit) gave P 9 tokens in each 60-ms step: 0.706 s, and D ~30 ms."""
    reqs = [SimRequest("D", 0.0, 10, 30, slo_tpot=0.0605, max_tokens=40), SimRequest("P", 0.015, 100, 2, slo_ttft=1.0)]
    config = ClusterConfig(SchedulerConfig(max_num_batched_tokens=100, max_num_seqs=16, max_model_len=1024,
                                           policy="slo"), CacheConfig(num_blocks=256, block_size=4))
    result = Simulator(config, LinearCostModel(CHUNK_OVERHEAD), reqs).run()
    assert [round(x, 9) for x in result.records[0].itls[:5]] == [0.011, 0.109, 0.011, 0.093, 0.012]
    assert result.records[1].ttft == pytest.approx(0.269, abs=1e-9)
    assert result.records[0].tpot <= 0.0605


def test_the_ttft_prediction_paces_efficient_chunks_after_banking_decode_steps():
    """With the overhead above and D decoding under a 60.5-ms TPOT SLO (a decode step takes 11 ms), a step
    beside D within 60.5 ms holds 9 prompt tokens, below the efficient 40: the pace gives 40 tokens a step
    (91 ms), each after one decode-only step that banks the 30.5 ms over the SLO (60.5 - 11 = 49.5 ms a
    step), 102 ms in all. A 100-token prompt: two such steps and 20 tokens (71 ms, after one decode step),
    0.286 s."""
    sched = Scheduler(SchedulerConfig(max_num_batched_tokens=100, max_model_len=1024, policy="slo", shed_load=True),
                      CacheConfig(num_blocks=256, block_size=4), StepTimeModel(CHUNK_OVERHEAD, adapt=False))
    sched.add_request(Request("D", [1, 2, 3], SamplingParams(max_tokens=50), 0.0, max_tokens=50,
                              options=RequestOptions(slo_tpot=0.0605)))
    sched.update_from_output(sched.schedule(0.0), {"D": SampledToken(5)}, 0.053)
    pace = sched.policy.predict.prefill_pace(sched.running, 0.053)
    assert sched.policy.predict.efficient_chunk(pace.decodes) == 40
    assert (pace.chunk, pace.banked) == (40, [])
    assert sched.policy.predict.first_token_time(100, pace, 0.053) == pytest.approx(0.053 + 2 * 0.102 + 0.082)
    # Without the overhead term nothing changes: 49-token steps within the SLO, as before.
    plain = StepTimeModel(StepCoefficients(0.01, 0.001, 0, 0), adapt=False)
    assert SLOPredictor(plain, 100, 4).efficient_chunk(pace.decodes) == 0


@pytest.mark.parametrize("slo_tpot, case, chunk", [(0.0605, "prompt", 0), (0.011, "prompt", 9),
                                                    (0.0605, "urgent", 9), (0.0605, "recompute", 9)])
def test_a_small_chunk_is_held_back_only_while_decode_steps_bank_time(slo_tpot, case, chunk):
    """A step limit of 60 ms beside one decode leaves 9 prompt tokens (51 + 9 ms), below the efficient 40.
    Under a 60.5-ms TPOT SLO a decode step (11 ms) banks 49.5 ms, so the chunk waits (0); under an 11-ms SLO
    the decode step banks nothing, and holding the chunk back would hold the prompt until the decode ends:
    it gets its 9 tokens. Nor is an urgent prompt held (its pace, the borrowed one, is a chunk every step;
    here the borrowed limit is the plain one), nor a request recomputing tokens it streamed before a
    preemption (its own allowance does not grow while it waits)."""
    policy = SLOPolicy(StepTimeModel(CHUNK_OVERHEAD, adapt=False), 100, 4)
    req = Request("r", [1, 2], SamplingParams(max_tokens=50), 0.0, max_tokens=50,
                  options=RequestOptions(slo_tpot=slo_tpot))
    req.first_token_time = 0.0
    req.append_output_token(7)
    req.num_computed_tokens = req.num_tokens - 1  # decoding
    triage = Triage(urgent=frozenset({"p"} if case == "urgent" else ()))
    plan = dataclasses.replace(policy.plan([req], 0.01, triage), tpot_limit=0.060, borrow_limit=0.060)
    prompt = Request("p", list(range(100)), SamplingParams(max_tokens=2), 0.0, max_tokens=2)
    if case == "recompute":
        prompt.append_output_token(7)
    assert policy.chunk_size(plan, plan.tally(), prompt, 0, 99, False) == chunk


def test_a_held_chunk_is_not_held_again_once_the_decode_beside_it_is_preempted():
    """A review's reproduction: R, preempted after streaming, recomputes beside D (no SLO) in a full pool, and
    D's block allocation fails, so D preempts itself. With R's chunk held back and the second pass of the
    running requests still counting D's decode, the step was empty and the engine raised "requests are
    pending but the scheduler scheduled nothing". A recomputing request is not held back, and the second
    pass rebuilds the policy's figures without the preempted decode: every step schedules something."""
    sched = Scheduler(SchedulerConfig(max_num_batched_tokens=100, max_model_len=4000, policy="slo"),
                      CacheConfig(num_blocks=350, block_size=4, enable_prefix_caching=False),
                      StepTimeModel(CHUNK_OVERHEAD, adapt=False))
    sched.add_request(Request("D", [1, 2, 3], SamplingParams(max_tokens=1300), 0.0, max_tokens=1300))
    sched.add_request(Request("R", list(range(10, 410)), SamplingParams(max_tokens=1000), 0.0, max_tokens=1000,
                              options=RequestOptions(slo_tpot=0.0605)))
    now = 0.0

    def step(now: float) -> float:
        out = sched.schedule(now)
        assert not out.is_empty
        shape = StepShape.of(out)
        t = CHUNK_OVERHEAD.predict(shape.num_tokens, shape.num_sampled, shape.attention_pairs)
        sched.observe_step_time(out, t)
        sched.update_from_output(out, {s.request_id: SampledToken(5) for s in out.sampling()}, now + t)
        return now + t

    for _ in range(3):
        now = step(now)
    sched.add_request(Request("W", list(range(10, 1010)), SamplingParams(max_tokens=2), now, max_tokens=2))
    for _ in range(41):
        now = step(now)
    sched._preempt(sched._requests["R"], SchedulerOutput())
    sched.finish_requests(["W"], RequestStatus.FINISHED_ABORTED)
    while "R" in sched._requests and sched._requests["R"].num_computed_tokens < sched._requests["R"].num_tokens - 1:
        now = step(now)
    assert sched.num_preemptions_total >= 2


def _interactive_beside_batch(batch_tpot: float, batch_forced: bool, shed_load: bool = True):
    """I (TPOT SLO 60.5 ms, may stop at any token) and four batch requests B0-B3 decode; a step costs 10 ms,
    1 ms per computed token and 5 ms per sampled token. All five got their first token at 0.05 s."""
    sched = Scheduler(SchedulerConfig(max_num_batched_tokens=100, max_model_len=1024, policy="slo",
                                      shed_load=shed_load), CacheConfig(num_blocks=256, block_size=4),
                      StepTimeModel(StepCoefficients(0.01, 0.001, 0.005, 0), adapt=False))
    sched.add_request(Request("I", [1, 2, 3], SamplingParams(max_tokens=50), 0.0, max_tokens=50,
                              options=RequestOptions(slo_tpot=0.0605)))
    for i in range(4):
        sched.add_request(Request(f"B{i}", [1, 2, 3], SamplingParams(max_tokens=50, ignore_eos=batch_forced), 0.0,
                                  max_tokens=50, options=RequestOptions(slo_tpot=batch_tpot)))
    step = sched.schedule(0.0)
    assert step.total_num_scheduled_tokens == 15
    sched.update_from_output(step, {r: SampledToken(5) for r in ("I", "B0", "B1", "B2", "B3")}, 0.05)
    return sched


def test_decodes_with_slack_sit_out_steps_for_a_prompt_that_needs_the_room():
    """Rule 6 (the two-class mix where slo lost the interactive class, BENCHMARKS.md v8). Beside the five
    decodes a step holds 15 prompt tokens within I's 60.5 ms (45 + 15 ms), so the 78-token prompt P (TTFT SLO
    0.2 s) would get its first token after 5 such steps and one of 3 tokens: 0.348 s. The batch requests
    (forced to 50 tokens, TPOT SLO 0.3 s) can spare seconds, so they sit out P's steps: beside I alone a step
    holds 39 prompt tokens (10 + 40 + 10 ms: a chunk is sized as if it sampled), then the last 39 and P's first
    token, TTFT 0.115 s. Then every decode runs again."""
    sched = _interactive_beside_batch(0.3, True)
    sched.add_request(Request("P", list(range(78)), SamplingParams(max_tokens=2), 0.05, max_tokens=2,
                              options=RequestOptions(slo_ttft=0.2, slo_tpot=0.0605)))
    step = sched.schedule(0.05)
    assert sched.plan.deferred == {"B0", "B1", "B2", "B3"}
    assert sorted((s.request_id, s.num_new_tokens) for s in step.scheduled) == [("I", 1), ("P", 39)]
    sched.update_from_output(step, {"I": SampledToken(5)}, 0.105)
    step = sched.schedule(0.105)
    assert sched.plan.deferred == {"B0", "B1", "B2", "B3"}
    assert sorted((s.request_id, s.num_new_tokens) for s in step.scheduled) == [("I", 1), ("P", 39)]
    outs = sched.update_from_output(step, {"I": SampledToken(5), "P": SampledToken(7)}, 0.165)
    assert [o.new_token_ids for o in outs if o.request_id == "P"] == [[7]]  # first token at 0.165: TTFT 0.115 s
    step = sched.schedule(0.165)
    assert not sched.plan.deferred and sched.make_stats().num_deferred_decodes_total == 8
    assert sorted(s.request_id for s in step.scheduled) == ["B0", "B1", "B2", "B3", "I", "P"]


@pytest.mark.parametrize("batch_tpot, forced", [(0.2, False), (0.0605, True)])
def test_decodes_that_cannot_spare_the_time_or_share_the_prompts_slo_do_not_sit_out(batch_tpot, forced):
    """As above, but the other four decodes either may stop at any token with a TPOT SLO of 0.2 s (each can
    spare only its 0.2 s banked, less than P's 0.2 s to its deadline plus a decode step), or have P's own TPOT
    SLO (they could spare the time, but rule 6 lets only a looser class yield). Nothing sits out, and P is
    refused on arrival at the pace beside all five decodes (0.348 s); without shedding it is late and gets the
    15 tokens a step beside them."""
    def prompt():
        return Request("P", list(range(78)), SamplingParams(max_tokens=2), 0.05, max_tokens=2,
                       options=RequestOptions(slo_ttft=0.2, slo_tpot=0.0605))

    sched = _interactive_beside_batch(batch_tpot, forced)
    with pytest.raises(SLOUnattainableError, match="predicted after 348 ms"):
        sched.add_request(prompt())
    sched = _interactive_beside_batch(batch_tpot, forced, shed_load=False)
    p = prompt()
    sched.add_request(p)
    step = sched.schedule(0.05)
    assert p.slo_late and not sched.plan.deferred  # late, it is served behind the others, beside every decode
    assert sorted((s.request_id, s.num_new_tokens) for s in step.scheduled) == \
        [("B0", 1), ("B1", 1), ("B2", 1), ("B3", 1), ("I", 1), ("P", 15)]


def test_decodes_sit_out_for_the_earliest_deadline_they_can_cover():
    """The batch requests may stop at any token (TPOT SLO 0.3 s): each can spare 0.3 s banked less a decode
    step (40 ms), 0.26 s. That covers P's deadline (0.2 s away), not Q's (300 tokens, TTFT SLO 0.5 s). Sitting
    out until P's deadline brings P in time (0.12 s, as above); Q is late at every pace (378 prompt
    tokens at 39 a step take 0.6 s)."""
    sched = _interactive_beside_batch(0.3, False)
    p = Request("P", list(range(78)), SamplingParams(max_tokens=2), 0.05, max_tokens=2,
                options=RequestOptions(slo_ttft=0.2, slo_tpot=0.0605))
    q = Request("Q", list(range(300)), SamplingParams(max_tokens=2), 0.05, max_tokens=2,
                options=RequestOptions(slo_ttft=0.5, slo_tpot=0.0605))
    predict = sched.policy.predict
    figures = predict.pace_figures(sched.running)  # the figures of every decode
    assert predict.spare(sched.running, 0.05, 0.0605, figures) == {f"B{i}": pytest.approx(0.26) for i in range(4)}
    verdict = predict.assess([p, q], sched.running, 0.05)
    assert verdict.late == [q] and verdict.urgent == {"P"} and verdict.deferred == {"B0", "B1", "B2", "B3"}
    paces = verdict.paces
    assert len(paces) == 3
    assert sched.policy.predict.first_token_time(78, paces[2], 0.05) == pytest.approx(0.17)


def test_deferred_decodes_run_when_the_prompt_gets_no_blocks():
    """Rule 6 would have B0-B3 sit out for P, but P's 20 tokens need 5 KV blocks and 2 are free: no prompt
    gets a chunk, so the decodes run in the same step after all and none is counted as deferred."""
    sched = Scheduler(SchedulerConfig(max_num_batched_tokens=100, max_model_len=1024, policy="slo"),
                      CacheConfig(num_blocks=6, block_size=4),
                      StepTimeModel(StepCoefficients(0.01, 0.001, 0.005, 0), adapt=False))
    for i in range(4):
        sched.add_request(Request(f"B{i}", [1, 2, 3], SamplingParams(max_tokens=10, ignore_eos=True), 0.0,
                                  max_tokens=10, options=RequestOptions(slo_tpot=0.3)))
    step = sched.schedule(0.0)
    sched.update_from_output(step, {s.request_id: SampledToken(5) for s in step.scheduled}, 0.05)
    p = Request("P", list(range(20)), SamplingParams(max_tokens=2), 0.05, max_tokens=2,
                options=RequestOptions(slo_ttft=0.055, slo_tpot=0.0605))
    sched.add_request(p)
    assert sched.policy.predict.assess([p], sched.running, 0.05).deferred == {"B0", "B1", "B2", "B3"}
    step = sched.schedule(0.05)
    assert sorted((s.request_id, s.num_new_tokens) for s in step.scheduled) == [(f"B{i}", 1) for i in range(4)]
    assert not sched.plan.deferred and sched.make_stats().num_deferred_decodes_total == 0
    assert sched.waiting.peek() is p


# ------------------------------------------------------------------------------------- step budget
def test_token_budget_from_the_tpot_average_of_a_request_of_known_length():
    """D (10-token prompt, exactly 3 output tokens, as the bench client forces them) has a TPOT SLO of
    52.55 ms; P's 200-token prompt arrives at 15 ms. TPOT is an average: D's first token comes at 0.02 s, so
    its last may come at 0.02 s + 2 x 52.55 ms, and its later step is priced at the recent mean step (20 ms,
    D's own prefill; a decode step alone takes 11 ms). So at 0.02 s the step may take 105.1 - 20 = 85.1 ms,
    which holds 74 of P's tokens (10 + 75 x 1 ms). At 0.105 s D's allowance is what is left, 20.1 ms: 9 more
    of P's tokens. D ends at 0.125 s with a TPOT of 52.5 ms, and P's last 117 tokens run at once. Under fcfs
    P's whole prompt runs in one 211-ms step and D's TPOT is 111.5 ms."""
    reqs = [SimRequest("D", 0.0, 10, 3, slo_tpot=0.05255), SimRequest("P", 0.015, 200, 2)]
    fcfs, slo = run("fcfs", reqs, budget=512)[1], run("slo", reqs, budget=512)[1]
    assert [round(x, 9) for x in slo.records[0].itls] == [0.085, 0.020]
    assert slo.records[1].ttft == pytest.approx(0.125 + 0.127 - 0.015, abs=1e-9)
    assert [round(x, 9) for x in fcfs.records[0].itls] == [0.211, 0.012]
    assert fcfs.records[1].ttft == pytest.approx(0.020 + 0.211 - 0.015, abs=1e-9)


def test_token_budget_from_the_tpot_slo_when_the_length_is_unknown():
    """The same, but D may stop at any token (it asks for up to 8, stops at an EOS after 3): every token must keep
    the TPOT so far within the SLO, so each step ends by D's next deadline, 0.02 s + k x 52.55 ms: P gets 41
    tokens beside the first decode (a 52-ms step) and 42 beside the second (D banked 0.55 ms), and the rest
    once D is done; P's first token comes as early as above."""
    reqs = [SimRequest("D", 0.0, 10, 3, slo_tpot=0.05255, max_tokens=8), SimRequest("P", 0.015, 200, 2)]
    slo = run("slo", reqs, budget=512)[1]
    assert [round(x, 9) for x in slo.records[0].itls] == [0.052, 0.053]
    assert slo.records[1].ttft == pytest.approx(0.125 + 0.127 - 0.015, abs=1e-9)


def _allowance_of_a_decode(policy, now: float, max_tokens: int, ignore_eos: bool, slo_tpot: float
                           ) -> tuple[float, float]:
    """``policy``'s allowance at ``now`` for a lone running request that streamed 2 tokens from t=0, and the
    step's time limit."""
    req = Request("r", [1, 2], SamplingParams(max_tokens=max_tokens, ignore_eos=ignore_eos), 0.0,
                  max_tokens=max_tokens, options=RequestOptions(slo_tpot=slo_tpot))
    req.first_token_time = 0.0
    req.append_output_token(7)
    req.append_output_token(7)
    req.num_computed_tokens = req.num_tokens - 1  # decoding
    plan = policy.plan([req], now)
    return policy.predict.allowance(req, now, plan.figures), plan.tpot_limit


def test_allowance_of_a_request_behind_its_tpot():
    """A request 1 s behind its next token's deadline (2 tokens streamed from t=0, TPOT SLO 0.5 s, now 2 s) and
    a decode step of 0.25 s: if it may stop any time, its TPOT can be met again at its 6th token from now (each
    decode step wins back 0.25 s), so the step may take 0.25 s; if it can stop before that, its TPOT is lost
    (-inf: it does not limit the step); with 10 more tokens certain, the step may take 1.25 s."""
    from goodserve.scheduler.slo import SLOPolicy

    policy = SLOPolicy(StepTimeModel(StepCoefficients(0.25, 0.0, 0.0, 0.0), adapt=False), 64, 4)

    def behind(max_tokens: int, ignore_eos: bool = False) -> tuple[float, float]:
        return _allowance_of_a_decode(policy, 2.0, max_tokens, ignore_eos, slo_tpot=0.5)

    assert behind(100) == (0.25, 0.25)  # (allowance, the step's limit)
    assert behind(6) == (-math.inf, math.inf)
    assert behind(12, ignore_eos=True)[0] == 1.25


def test_allowance_aims_below_the_tpot_slo_by_the_models_margin():
    """Steps run 1.25x their prediction (20 ms predicted, 25 ms measured: margin 1.25, decode step 25 ms with
    it). A request with a TPOT SLO of 100 ms aims at 80 ms: 2 tokens streamed from t=0, at 0.2 s with 10 more
    certain, the step may take 0.16 - 0.2 + 9 x (0.08 - 0.025) = 0.455 s, not the 0.675 s its SLO alone
    would allow. At 0.15 s with its length open, 80 ms is out of reach (0.01 s < a decode step) and the SLO
    itself leaves 0.05 s."""
    from goodserve.scheduler.slo import SLOPolicy

    model = StepTimeModel(StepCoefficients(0.02, 0.0, 0.0, 0.0), adapt=False)
    for _ in range(16):
        model.observe(StepShape(1, 1, 1, 1, 1), 0.025)
    assert model.margin == pytest.approx(1.25)
    policy = SLOPolicy(model, 64, 4)

    assert _allowance_of_a_decode(policy, 0.2, 12, True, slo_tpot=0.1)[0] == pytest.approx(0.455)
    assert _allowance_of_a_decode(policy, 0.15, 100, False, slo_tpot=0.1)[0] == pytest.approx(0.05)


def test_an_urgent_prompt_borrows_against_later_decode_steps():
    """D streams (1 token at t=0 of exactly 20, TPOT SLO 50.5 ms; a decode step takes 11 ms) after a 210-ms
    prefill, so the recent mean step (210 ms) is over its SLO and its allowance is what it banked, 50.5 ms: a
    step may hold 39 prompt tokens beside its decode. At that pace P's 300-token prompt (TTFT SLO 350 ms)
    gets its first token at 7 x 50 ms + 38 ms = 0.388 s, late. Priced as decodes alone, D's next 16 steps
    (BORROW_STEPS: a loan is repaid within them) leave it 16 x 39.5 ms more, 0.6825 s in all, so P is urgent
    rather than late: its whole prompt runs in one 0.311-s step (first token in time), and D's TPOT is still
    (0.311 + 18 x 0.011) / 19 = 26.8 ms. A
    prompt whose TTFT does not need it (Q) keeps the 39-token chunk. Shedding judges by the borrowed pace:
    P is refused only if its TTFT SLO is under 311 ms."""
    from goodserve.scheduler.slo import SLOPolicy

    model = StepTimeModel(StepCoefficients(0.010, 0.001, 0.0, 0.0), adapt=False)
    model.observe(StepShape(200, 1, 0, 200, 1), 0.21)
    assert model.recent_step_s == 0.21
    policy = SLOPolicy(model, 512, 4, shed_load=True)
    d = Request("D", [1, 2], SamplingParams(max_tokens=20, ignore_eos=True), 0.0, max_tokens=20,
                options=RequestOptions(slo_tpot=0.0505))
    d.first_token_time = 0.0
    d.append_output_token(7)
    d.num_computed_tokens = d.num_tokens - 1

    def prompt(rid: str, slo_ttft: float) -> Request:
        return Request(rid, list(range(300)), SamplingParams(max_tokens=4), 0.0, max_tokens=4,
                       options=RequestOptions(slo_ttft=slo_ttft))

    p, q = prompt("P", 0.35), prompt("Q", 10.0)
    predict = policy.predict
    triage = policy.triage([p, q], [d], 0.0)
    assert triage.late == () and triage.urgent == {"P"}
    assert predict.first_token_time(300, predict.prefill_pace([d], 0.0), 0.0) == pytest.approx(0.388)
    assert predict.first_token_time(300, predict.prefill_pace([d], 0.0, borrow=True), 0.0) == pytest.approx(0.311)
    plan = policy.plan([d], 0.0, triage)
    assert plan.tpot_limit == pytest.approx(0.0505) and plan.borrow_limit == pytest.approx(0.6825)
    assert policy.chunk_size(plan, plan.tally(), p, 0, 300, True) == 300
    assert policy.chunk_size(plan, plan.tally(), q, 0, 300, True) == 39
    policy.check_arrival(prompt("P2", 0.312), [], [d], 0.0)  # in time when borrowing: admitted
    with pytest.raises(SLOUnattainableError, match="predicted after 311 ms"):
        policy.check_arrival(prompt("P3", 0.31), [], [d], 0.0)
    # Urgency stretches the plain pace's time to first token by the model's margin: a prompt given just
    # enough would land on its deadline. After 17 decode steps at 1.25x their prediction (margin 1.25: the
    # 0.9 quantile of the 16-step runs, all at 1.25x but the first, 1.11x with the prefill in it; recent mean
    # 24.7 ms, so D has time to lend again), the plain pace gives P4 its first token at 0.322 s: in time
    # for a 0.38-s TTFT SLO, but not stretched (0.4025 s), so P4 is urgent.
    for _ in range(17):
        model.observe(StepShape(1, 1, 1, 1, 1), 0.01375)
    assert model.margin == pytest.approx(1.25)
    slow = prompt("P4", 0.38)
    triage = policy.triage([slow], [d], 0.0)
    assert triage.late == () and triage.urgent == {"P4"}
    assert predict.first_token_time(300, predict.prefill_pace([d], 0.0), 0.0) == pytest.approx(0.322)


def test_a_request_is_late_only_if_both_paces_miss_its_ttft():
    """D may stop at any token (40 streamed from t=0, TPOT SLO 50.5 ms), so it has nothing later to lend: its
    borrowed limit is its plain allowance, 2.02 s, and the borrowed pace, which credits each step only a
    decode step, is the slower one: a 2,167-token prompt gets its first token at 2.233 s at the plain pace,
    2.266 s at the borrowed one. With a 2.25-s TTFT SLO it is in time at the plain pace, so it is neither late
    nor shed."""
    from goodserve.scheduler.slo import SLOPolicy

    policy = SLOPolicy(StepTimeModel(StepCoefficients(0.010, 0.001, 0.0, 0.0), adapt=False), 512, 4, shed_load=True)
    d = Request("D", [1, 2], SamplingParams(max_tokens=1000), 0.0, max_tokens=1000,
                options=RequestOptions(slo_tpot=0.0505))
    d.first_token_time = 0.0
    for _ in range(40):
        d.append_output_token(7)
    d.num_computed_tokens = d.num_tokens - 1
    p = Request("P", list(range(2167)), SamplingParams(max_tokens=4), 0.0, max_tokens=4,
                options=RequestOptions(slo_ttft=2.25))
    predict = policy.predict
    assert predict.first_token_time(2167, predict.prefill_pace([d], 0.0), 0.0) == pytest.approx(2.233)
    assert predict.first_token_time(2167, predict.prefill_pace([d], 0.0, borrow=True), 0.0) == pytest.approx(2.266)
    assert policy.triage([p], [d], 0.0).late == ()
    policy.check_arrival(p, [], [d], 0.0)  # not refused
    plan = policy.plan([d], 0.0)
    assert plan.tpot_limit == plan.borrow_limit == pytest.approx(2.02)


def test_admission_stops_before_a_decode_would_break_the_tightest_tpot():
    """Five 2-token prompts with a TPOT SLO of 13.5 ms: a decode step of k requests takes 10 + k ms, so at
    most three may run at once. fcfs runs all five (15-ms steps: every TPOT missed); slo never more than
    three, and every request meets its TPOT."""
    reqs = [SimRequest(f"r{i}", 0.0, 2, 10, slo_tpot=0.0135) for i in range(5)]
    (fsim, fcfs), (ssim, slo) = run("fcfs", reqs), run("slo", reqs)
    assert fsim.instances[0].max_running == 5 and ssim.instances[0].max_running == 3
    tpot = [(r.e2e - r.ttft) / (r.output_tokens - 1) for r in slo.records]
    assert max(tpot) <= 0.0135 + 1e-12
    assert all((r.e2e - r.ttft) / (r.output_tokens - 1) > 0.0135 for r in fcfs.records)


def test_a_tpot_slo_no_step_can_meet_is_not_protected():
    """A 5-ms TPOT SLO when a one-token step takes 11 ms: nobody can meet it, so slo neither stops admission
    nor cuts chunks for it (it would serve one request at a time for nothing); it schedules as fcfs does."""
    reqs = [SimRequest(f"r{i}", 0.0, 2, 10, slo_tpot=0.005) for i in range(5)]
    (fsim, fcfs), (ssim, slo) = run("fcfs", reqs), run("slo", reqs)
    assert ssim.instances[0].max_running == fsim.instances[0].max_running == 5
    assert [r.e2e for r in slo.records] == [r.e2e for r in fcfs.records]


# -------------------------------------------------------------------------------------- preemption
def _two_decoding(policy: str) -> tuple[Scheduler, list[str]]:
    """B (no SLO) and then A (TPOT SLO 1 s) fill a 4-block pool with their 8-token prompts; their first
    decodes each need a new block. Returns the scheduler and the ids preempted by the decode step."""
    sched = Scheduler(SchedulerConfig(max_num_batched_tokens=64, max_model_len=64, policy=policy),
                      CacheConfig(num_blocks=4, block_size=4), StepTimeModel(DEFAULT_SEED, adapt=False))
    params = SamplingParams(max_tokens=4)
    sched.add_request(Request("B", list(range(8)), params, arrival_time=0.0, max_tokens=4))
    sched.add_request(Request("A", list(range(100, 108)), params, arrival_time=0.001, max_tokens=4,
                              options=RequestOptions(slo_tpot=1.0)))
    first = sched.schedule(0.0)
    assert [s.request_id for s in first.scheduled] == ["B", "A"]
    sched.update_from_output(first, {"A": SampledToken(1), "B": SampledToken(1)}, 0.05)
    return sched, sched.schedule(0.05).preempted_req_ids


def test_preemption_victim_is_the_request_with_the_most_slack():
    assert _two_decoding("fcfs")[1] == ["A"]  # the tail of arrival order
    assert _two_decoding("slo")[1] == ["B"]  # no SLO: infinite slack


# -------------------------------------------------------------------------------- step-time model
def test_step_time_model_learns_a_linear_machine_and_reports_its_error():
    true = StepCoefficients(0.02, 3e-4, 1e-3, 5e-9)
    model = StepTimeModel()  # seeded with the default, far from the truth
    rng = np.random.default_rng(0)
    for _ in range(300):
        b, pre = int(rng.integers(1, 64)), int(rng.choice([0, 0, 256, 512]))
        shape = StepShape(b + pre, b + (pre > 0), b * 300 + pre * (pre + 1) // 2, 0, b)
        model.observe(shape, true.predict(shape.num_tokens, shape.num_sampled, shape.attention_pairs))
    for tokens, sampled, pairs in ((1, 1, 300), (64, 64, 64 * 300), (512 + 16, 17, 16 * 300 + 512 * 513 // 2)):
        assert model.predict(tokens, sampled, pairs) == pytest.approx(true.predict(tokens, sampled, pairs), rel=0.03)
    assert model.num_observed == 300 and 0 < model.mean_abs_relative_error < 0.2


def test_step_coefficients_price_a_step_with_a_prompt_chunk_apart(tmp_path):
    """A step that computes a prompt chunk (more tokens than it samples) pays the two prefill terms; a step
    of decodes alone (tokens == sampled) does not. A profile written before the terms existed reads as 0."""
    c = StepCoefficients(0.010, 1e-3, 2e-3, 1e-6, prefill_overhead_s=0.030, prefill_per_sampled_s=5e-3)
    assert c.predict(4, 4, 1000) == pytest.approx(0.010 + 0.004 + 0.008 + 0.001)
    assert c.predict(68, 4, 1000) == pytest.approx(0.010 + 0.068 + 0.008 + 0.001 + 0.030 + 0.020)
    assert c.predict(64, 0, 0) == pytest.approx(0.010 + 0.064 + 0.030)
    (tmp_path / "old.json").write_text(json.dumps({"coefficients": {"overhead_s": 0.01, "per_token_s": 1e-3,
                                                                    "per_sampled_s": 0, "per_pair_s": 0}}))
    assert StepCoefficients.load(tmp_path / "old.json") == StepCoefficients(0.01, 1e-3, 0.0, 0.0, 0.0, 0.0)


def test_step_time_model_learns_a_machine_whose_decode_steps_run_another_path():
    """An engine runs decode-only steps down their own path (the CPU engine's one-call decode step, CUDA
    graphs on a GPU): here 10 ms + 3.7 ms a row, and a step with a prompt chunk 40 ms + 0.6 ms a token + 5.1
    ms a sampled row, the figures fitted to an azure-code run at 1.2 req/s (BENCHMARKS.md, issue 14). Fed
    such steps, the model prices both kinds within 3%; one line through both (the form before the prefill
    terms) put a 4-row decode step at 43.9 ms where it took 24.9."""
    true = StepCoefficients(0.010, 6e-4, 3.1e-3, 0.0, prefill_overhead_s=0.030, prefill_per_sampled_s=2e-3)
    model = StepTimeModel()
    rng = np.random.default_rng(0)
    for _ in range(300):
        b, pre = int(rng.integers(1, 17)), int(rng.choice([0, 0, 0, 64, 300, 1024]))
        shape = StepShape(b + pre, b + (pre > 0), b * 700 + pre * (pre + 1) // 2, 0, b)
        model.observe(shape, true.predict(shape.num_tokens, shape.num_sampled, shape.attention_pairs))
    for tokens, sampled, pairs in ((1, 1, 700), (4, 4, 2800), (8, 8, 5600), (4 + 300, 5, 2800 + 300 * 301 // 2)):
        assert model.predict(tokens, sampled, pairs) == pytest.approx(true.predict(tokens, sampled, pairs), rel=0.03)


def test_step_time_model_keeps_the_seed_in_directions_the_load_never_excites():
    """Pure decode (tokens == sampled) cannot separate per-token from per-sampled costs: the prior keeps the
    prefill prediction near the seed's instead of drifting (no wind-up)."""
    seed = StepCoefficients(0.01, 4e-4, 5e-4, 2e-8)
    model = StepTimeModel(seed)
    for b in range(1, 400):
        n = 1 + b % 48
        model.observe(StepShape(n, n, n * 500, 0, n), seed.predict(n, n, n * 500))
    assert model.predict(512, 1, 512 * 513 // 2) == pytest.approx(seed.predict(512, 1, 512 * 513 // 2), rel=1e-6)


def test_step_time_model_margin_is_a_quantile_over_runs_of_16_steps():
    """The margin the policy stretches predictions by: 1 until 16 steps were seen, then the 0.9 quantile,
    over every run of 16 consecutive steps, of the run's measured over predicted time, never below 1. Step
    ``i`` runs ``1 + i / 100`` times its prediction, so the run from step ``j`` runs ``1.075 + j / 100``
    times: after 20 steps the five runs give 1.075 .. 1.115, quantile 1.111 (linear interpolation), where
    the steps' own quantile is 1.171."""
    m = StepTimeModel(StepCoefficients(0.1, 0.0, 0.0, 0.0), adapt=False)
    shape = StepShape(1, 1, 1, 1, 1)
    for i in range(20):
        runs = [1.075 + j / 100 for j in range(i - 15)]
        assert m.margin == (1.0 if i < 16 else pytest.approx(np.quantile(runs, 0.9)))
        m.observe(shape, 0.1 * (1 + i / 100))
    assert m.margin == pytest.approx(1.111)
    # A lone slow step moves a run's ratio by its excess over 16: 15 steps on time and one at 2.6x give 1.1.
    spike = StepTimeModel(StepCoefficients(0.1, 0.0, 0.0, 0.0), adapt=False)
    for i in range(16):
        spike.observe(shape, 0.26 if i == 7 else 0.1)
    assert spike.margin == pytest.approx(1.1)
    assert m.recent_step_s == pytest.approx(0.1 * (1 + 0.095))  # the plain mean of the first 32 steps
    for _ in range(32):
        m.observe(shape, 0.2)
    assert m.recent_step_s == pytest.approx(0.2 - (0.2 - 0.1 * 1.095) * (20 / 32) * (31 / 32) ** 20)
    fast = StepTimeModel(StepCoefficients(0.1, 0.0, 0.0, 0.0), adapt=False)
    for _ in range(20):
        fast.observe(shape, 0.05)
    assert fast.margin == 1.0


def test_the_engine_does_not_teach_the_model_its_cold_first_step(tiny_model):
    """The first step pays for cold caches and kernels built on first use (4.1 s for a 1,024-token prefill
    on this CPU, then 0.45 s): it is not observed. Four steps (a prefill and three decodes): the second and
    third are observed when the next one starts, the fourth waits for a next step."""
    from goodserve.engine.engine import Engine

    eng = Engine(_engine_args(tiny_model, scheduling_policy="slo"))
    eng.add_request([1, 2, 3, 4, 5], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))
    steps = 0
    while eng.has_unfinished_requests():
        eng.step()
        steps += 1
    assert steps == 4 and eng.make_stats().num_steps_observed == 2


def test_step_time_model_rejects_bad_input(tmp_path):
    with pytest.raises(ValueError, match="finite"):
        StepTimeModel().observe(StepShape(1, 1, 1, 1, 1), math.nan)
    with pytest.raises(ValueError, match=">= 0"):
        StepTimeModel(StepCoefficients(-1.0, 0, 0, 0))
    (tmp_path / "p.json").write_text('{"coefficients": {"overhead_s": 0.01}}')
    with pytest.raises(ValueError, match="cannot read step-time coefficients"):
        StepCoefficients.load(tmp_path / "p.json")


def test_simulated_scheduler_model_matches_the_cost_model():
    """The simulator seeds each scheduler's model from its cost model and feeds it the priced steps: a
    linear cost model is reproduced, so predictions are exact."""
    reqs = [SimRequest(f"q{i}", 0.01 * i, 20 + i, 5) for i in range(10)]
    sim, _ = run("slo", reqs)
    stats = sim.instances[0].scheduler.make_stats()
    assert stats.num_steps_observed == sim.instances[0].num_steps
    assert stats.step_time_abs_error_s_total == pytest.approx(0.0, abs=1e-9)


def test_config_errors():
    with pytest.raises(ValueError, match="needs scheduler mode 'chunked'"):
        SchedulerConfig(policy="slo", mode="static")
    with pytest.raises(ValueError, match="shed_load needs policy 'slo'"):
        SchedulerConfig(shed_load=True)
    with pytest.raises(ValueError, match="slo_ttft must be a positive"):
        Request("x", [1], SamplingParams(max_tokens=1), 0.0, options=RequestOptions(slo_ttft=0.0))
    sched = Scheduler(SchedulerConfig(policy="slo", shed_load=True), CacheConfig(num_blocks=16, block_size=4))
    with pytest.raises(SLOUnattainableError):  # no prefill takes under a microsecond
        sched.add_request(Request("x", [1, 2], SamplingParams(max_tokens=1), 0.0, max_tokens=1,
                                  options=RequestOptions(slo_ttft=1e-6)))
    assert not sched.has_unfinished_requests() and sched.make_stats().num_shed_total == 1


# ------------------------------------------------------------------------------ engine and server
@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory):
    from tiny_models import make_tiny_hf_model

    return make_tiny_hf_model(tmp_path_factory.mktemp("tiny"), "llama")


def _engine_args(model: str, **kw):
    from goodserve.engine.args import EngineArgs

    return EngineArgs(model=model, dtype="float32", num_blocks=128, block_size=4, max_num_batched_tokens=64,
                      max_model_len=256, log_stats_interval=0, **kw)


def test_slo_policy_generates_the_same_tokens(tiny_model):
    """The policy changes when tokens are computed, never which: greedy outputs equal fcfs's."""
    from goodserve.llm import LLM

    prompts = [[1 + (7 * i + j) % 50 for j in range(5 + 3 * i)] for i in range(6)]
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    ref = [o.token_ids for o in LLM(**vars(_engine_args(tiny_model))).generate(prompts, params)]
    slo = LLM(**vars(_engine_args(tiny_model, scheduling_policy="slo", slo_ttft=5.0, slo_tpot=0.5)))
    assert [o.token_ids for o in slo.generate(prompts, params)] == ref
    stats = slo.engine.make_stats()
    assert stats.num_steps_observed > 0 and stats.step_time_actual_s_total > 0


def test_server_sheds_with_429_and_keeps_serving(tiny_model):
    """--shed-load: a request whose TTFT SLO no prefill can meet (1 microsecond) is refused at once with
    429 ``slo_unattainable`` and ``Retry-After``, counted; others, with SLOs they can meet, are served."""
    import httpx

    from goodserve.engine.async_engine import AsyncEngine
    from goodserve.engine.engine import Engine
    from goodserve.server.app import build_app
    from server_fixtures import ServerThread, metric_samples, wait_idle

    eng = AsyncEngine(Engine(_engine_args(tiny_model, scheduling_policy="slo", shed_load=True, slo_ttft=60.0)))
    try:
        with ServerThread(build_app(eng, served_model_name="tiny")) as srv, \
                httpx.Client(base_url=srv.base_url, timeout=60) as http:
            body = {"model": "tiny", "prompt": [1, 2, 3, 4], "max_tokens": 3}
            for stream in (False, True):
                r = http.post("/v1/completions", json={**body, "stream": stream, "slo_ttft_ms": 0.001})
                assert r.status_code == 429 and r.headers["retry-after"] == "1"
                err = r.json()["error"]
                assert err["code"] == "slo_unattainable" and "TTFT SLO of 0 ms" in err["message"]
            ok = http.post("/v1/completions", json=body)
            assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] == 3
            wait_idle(eng)
            m = metric_samples(http)
            assert m[("goodserve:num_requests_shed_total", frozenset())] == 2
            assert m[("goodserve:api_requests_rejected_total",
                      frozenset({("endpoint", "/v1/completions"), ("reason", "slo_unattainable")}))] == 2
            assert m[("goodserve:request_slo_attained_total", frozenset({("slo_class", "default")}))] == 1
            r = http.post("/v1/completions", json={**body, "slo_tpot_ms": -1})
            assert r.status_code == 400 and r.json()["error"]["param"] == "slo_tpot_ms"
    finally:
        eng.shutdown()


def test_the_refit_keeps_the_window_sums_as_a_fresh_fit_would():
    """The step-time model keeps X^T X and X^T y of its window as steps enter and leave: after 700 steps
    through a window of 50 (the sums also recomputed every 50 steps), its coefficients are the least-squares
    fit over the prior and the last 50 steps, computed here from scratch."""
    from goodserve.scheduler.step_time import _SCALE, _features

    rng = random.Random(5)
    model = StepTimeModel(window=50)
    steps = []
    for _ in range(700):
        tokens = rng.choice([1, 4, 16, 300])
        shape = StepShape(tokens, min(tokens, rng.randint(1, 8)), tokens * 50, tokens * 50, 4)
        seconds = 0.002 + 1e-4 * tokens + rng.random() * 1e-3
        model.observe(shape, seconds)
        steps.append((shape, seconds))
    xs = np.array([_features(s) for s, _ in steps[-50:]])
    ys = np.array([t for _, t in steps[-50:]])
    want = np.linalg.solve(model._prior_xtx + xs.T @ xs, model._prior_xty + xs.T @ ys) * _SCALE
    got = np.array(list(model.coefficients.to_dict().values()))
    assert np.allclose(got, np.clip(want, 0.0, None), rtol=1e-9, atol=1e-15)
