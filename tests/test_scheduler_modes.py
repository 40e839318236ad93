"""The baseline batching modes of the real scheduler: ``reserve`` (Orca-style max reservation) and ``paged``
(vLLM v0: prefill-first, unchunked). ``chunked`` and ``static`` are covered in test_scheduler.py."""

from __future__ import annotations

import pytest

from factories import create_requests, create_scheduler, fake_step, run_to_completion
from goodserve.config import SCHEDULING_MODES, SchedulerConfig


def _max_running(sched, steps_budget: int = 10_000) -> int:
    most = 0
    for step in range(steps_budget):
        if not sched.has_unfinished_requests():
            return most
        fake_step(sched, float(step))
        most = max(most, sched.make_stats().num_running)
        sched.kv_cache_manager.check_integrity()
    raise AssertionError("did not finish")


def test_modes_are_known_to_the_config():
    assert {"chunked", "static", "reserve", "prefill-first"} <= set(SCHEDULING_MODES)
    with pytest.raises(ValueError, match="mode must be one of"):
        SchedulerConfig(mode="orca")


@pytest.mark.parametrize("mode", SCHEDULING_MODES)
def test_every_mode_finishes_a_mixed_workload_without_leaking_blocks(mode):
    sched = create_scheduler(num_blocks=40, max_num_batched_tokens=16, max_num_seqs=4, mode=mode,
                             enable_prefix_caching=False)
    reqs = create_requests(6, prompt_len=10, max_tokens=5) + create_requests(3, prompt_len=30, max_tokens=3,
                                                                             start=6)
    for r in reqs:
        sched.add_request(r)
    run_to_completion(sched)
    assert all(r.num_output_tokens == r.max_tokens for r in reqs)
    assert sched.kv_cache_manager.num_free_blocks == 40


# ---------------------------------------------------------------------------------------------- reserve
def test_reserve_allocates_prompt_plus_max_tokens_at_admission():
    sched = create_scheduler(block_size=4, num_blocks=64, mode="reserve")
    (req,) = create_requests(1, prompt_len=6, max_tokens=11)  # 17 slots -> 5 blocks
    sched.add_request(req)
    out, _ = fake_step(sched, 0.0)
    assert out.scheduled[0].num_new_tokens == 6
    assert len(sched.kv_cache_manager.get_block_ids(req.request_id)) == 5
    run_to_completion(sched)  # no block is ever added afterwards, and all come back
    assert sched.kv_cache_manager.num_free_blocks == 64


def test_reserve_turns_prefix_caching_off():
    sched = create_scheduler(mode="reserve", enable_prefix_caching=True)
    assert not sched.kv_cache_manager.enable_prefix_caching


def test_reserve_never_preempts_and_admits_fewer_than_chunked_on_the_same_pool():
    def run(mode):
        sched = create_scheduler(block_size=4, num_blocks=32, max_num_batched_tokens=64, max_num_seqs=16,
                                 mode=mode, enable_prefix_caching=False)
        for r in create_requests(8, prompt_len=8, max_tokens=24):  # 32 slots = 8 blocks each at the end
            sched.add_request(r)
        return _max_running(sched), sched.num_preemptions_total

    reserve_concurrency, reserve_preemptions = run("reserve")
    chunked_concurrency, _ = run("chunked")
    assert reserve_preemptions == 0
    assert reserve_concurrency == 4  # 32 blocks / 8 reserved each
    assert chunked_concurrency > reserve_concurrency


def test_reserve_admission_waits_for_the_full_reservation():
    sched = create_scheduler(block_size=4, num_blocks=10, mode="reserve")
    a, b = create_requests(2, prompt_len=4, max_tokens=20)  # 24 slots = 6 blocks each
    sched.add_request(a)
    sched.add_request(b)
    out, _ = fake_step(sched, 0.0)
    assert [s.request_id for s in out.scheduled] == ["r0"] and sched.make_stats().num_waiting == 1
    assert sched.kv_cache_manager.num_free_blocks == 4


# ------------------------------------------------------------------------------------------------ paged
def test_paged_never_mixes_prefills_and_decodes_and_never_chunks():
    sched = create_scheduler(block_size=4, num_blocks=64, max_num_batched_tokens=24, max_num_seqs=8,
                             mode="prefill-first", enable_prefix_caching=False)
    reqs = create_requests(6, prompt_len=10, max_tokens=4)
    for r in reqs[:3]:
        sched.add_request(r)
    steps = []
    for step in range(200):
        if step == 2:
            for r in reqs[3:]:
                sched.add_request(r)
        if not sched.has_unfinished_requests():
            break
        out, _ = fake_step(sched, float(step))
        steps.append(out)
    kinds = [{s.is_decode for s in out.scheduled} for out in steps]
    assert all(len(k) == 1 for k in kinds), kinds  # prefill-only or decode-only steps
    prefill_chunks = [s.num_new_tokens for out in steps for s in out.scheduled if not s.is_decode]
    assert prefill_chunks == [10] * 6  # whole prompts, two per step under a budget of 24
    assert [len(out.scheduled) for out in steps][:3] == [2, 1, 2]  # r0+r1, r2 alone, then decodes
    assert sched.kv_cache_manager.num_free_blocks == 64


def test_paged_runs_a_prompt_longer_than_the_budget_whole_and_alone():
    sched = create_scheduler(block_size=4, num_blocks=64, max_num_batched_tokens=16, mode="prefill-first")
    long_, short = create_requests(2, prompt_len=40, max_tokens=2)
    short.prompt_token_ids = short.prompt_token_ids[:4]
    short.all_token_ids = list(short.prompt_token_ids)
    sched.add_request(long_)
    sched.add_request(short)
    out, _ = fake_step(sched, 0.0)
    assert [(s.request_id, s.num_new_tokens) for s in out.scheduled] == [("r0", 40)]
    out, _ = fake_step(sched, 1.0)
    assert [(s.request_id, s.num_new_tokens) for s in out.scheduled] == [("r1", 4)]  # decodes wait
    out, _ = fake_step(sched, 2.0)
    assert sorted(s.request_id for s in out.scheduled) == ["r0", "r1"] and out.num_decode_tokens == 2


def test_paged_admits_a_preempted_request_back_as_one_whole_recompute():
    sched = create_scheduler(block_size=4, num_blocks=6, max_num_batched_tokens=64, max_num_seqs=4,
                             mode="prefill-first", enable_prefix_caching=False)
    reqs = create_requests(2, prompt_len=8, max_tokens=8)  # 16 slots = 4 blocks each at the end
    for r in reqs:
        sched.add_request(r)
    steps = run_to_completion(sched)
    assert sched.num_preemptions_total >= 1
    assert all(len({s.is_decode for s in out.scheduled}) == 1 for out in steps)
    recomputes = [s.num_new_tokens for out in steps for s in out.scheduled
                  if not s.is_decode and s.num_new_tokens > 8]
    assert recomputes  # prompt + generated tokens recomputed in one piece
    assert all(r.num_output_tokens == 8 for r in reqs)
