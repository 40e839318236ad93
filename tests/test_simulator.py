"""The discrete-event simulator: it drives the engine's own Scheduler, keeps exact time, is deterministic,
and reproduces the baselines' defining behaviours (fast: constant or roofline cost, tiny workloads)."""

from __future__ import annotations

import ast
import json
import math
import re
from pathlib import Path

import pytest

import goodserve.sim
from goodserve.cli import build_parser
from goodserve.config import SCHEDULING_MODES, CacheConfig, SchedulerConfig
from goodserve.engine.step_trace import TracedStep
from goodserve.scheduler.output import ScheduledRequest, SchedulerOutput
from goodserve.scheduler.scheduler import Scheduler
from goodserve.scheduler.step_time import StepCoefficients
from goodserve.sim import simulator as simulator_module
from goodserve.sim.cost_model import (ConstantCostModel, LinearCostModel, NoisyCostModel, RooflineCostModel,
                                      StepShape)
from goodserve.sim.hardware import get_hardware
from goodserve.sim.presets import load_arch
from goodserve.sim.profile import fit_linear
from goodserve.sim.replay import load_bench_runs
from goodserve.sim.roofline import decode_step
from goodserve.sim.simulate_cli import build_workload, parse_disaggregate, parse_rates, parse_stall
from goodserve.sim.simulator import Simulator
from goodserve.sim.spec import ClusterConfig, Disaggregation, SimRequest

STEP = 0.1  # seconds per step under the constant cost model


def cluster(mode: str = "chunked", num_blocks: int = 64, block_size: int = 4, budget: int = 64,
            max_num_seqs: int = 16, **kw) -> ClusterConfig:
    return ClusterConfig(SchedulerConfig(max_num_batched_tokens=budget, max_num_seqs=max_num_seqs,
                                         max_model_len=1024, mode=mode),
                         CacheConfig(block_size=block_size, num_blocks=num_blocks), **kw)


def simulate(config: ClusterConfig, requests: list[SimRequest], step_s: float = STEP, slos=None):
    sim = Simulator(config, ConstantCostModel(step_s), requests, slos)
    return sim, sim.run()


def mixed_workload(n: int = 24) -> list[SimRequest]:
    """Staggered arrivals, prompts of 5..40 tokens and outputs of 2..12 (deterministic)."""
    return [SimRequest(f"q{i}", 0.05 * i, 5 + (7 * i) % 36, 2 + (5 * i) % 11) for i in range(n)]


def assert_no_leak(sim: Simulator) -> None:
    for inst in sim.instances:
        kv = inst.scheduler.kv_cache_manager
        kv.check_integrity()
        assert kv.num_free_blocks == kv.num_blocks, inst.name
        assert not inst.scheduler.has_unfinished_requests()


# ----------------------------------------------------------------------------------------- structure
def test_the_simulator_drives_the_engines_scheduler_and_defines_none_of_its_own():
    assert simulator_module.Scheduler is Scheduler
    sim_dir = Path(goodserve.sim.__file__).parent
    own = [(f.name, node.name) for f in sim_dir.rglob("*.py")
           for node in ast.walk(ast.parse(f.read_text())) if isinstance(node, ast.ClassDef)
           and node.name.endswith("Scheduler")]
    assert own == [], f"a simulator-only scheduler appeared: {own}"
    sim = Simulator(cluster(), ConstantCostModel(STEP), [])
    assert all(type(inst.scheduler) is Scheduler for inst in sim.instances)


# --------------------------------------------------------------------------------------------- timing
def test_exact_times_for_two_requests_that_do_not_overlap():
    sim, res = simulate(cluster(), [SimRequest("a", 0.0, 4, 3), SimRequest("b", 0.5, 4, 3)])
    a, b = res.records
    assert a.ttft == pytest.approx(0.1) and a.e2e == pytest.approx(0.3)
    assert a.itls == pytest.approx([0.1, 0.1])
    assert b.ttft == pytest.approx(0.1) and b.e2e == pytest.approx(0.3)
    assert res.summary.duration == pytest.approx(0.8)
    assert sim.instances[0].num_steps == 6 and sim.instances[0].busy_s == pytest.approx(0.6)
    assert_no_leak(sim)


def test_a_request_arriving_mid_step_waits_for_the_next_step():
    # a: prefill [0, .1], decodes [.1, .2], [.2, .3]. b arrives at .15, joins the step starting at .2.
    sim, res = simulate(cluster(), [SimRequest("a", 0.0, 4, 3), SimRequest("b", 0.15, 4, 3)])
    a, b = res.records
    assert a.e2e == pytest.approx(0.3)
    assert b.ttft == pytest.approx(0.3 - 0.15) and b.e2e == pytest.approx(0.5 - 0.15)
    assert sim.instances[0].num_steps == 5  # a's third step carries b's prefill


def test_simultaneous_arrival_and_step_end_share_the_next_step():
    """Events of one instant are all applied before any step starts."""
    sim, res = simulate(cluster(), [SimRequest("a", 0.0, 4, 2), SimRequest("b", 0.1, 4, 2)])
    a, b = res.records
    assert b.ttft == pytest.approx(0.1)  # its prefill rides with a's decode at t=0.1
    assert sim.instances[0].num_steps == 3


def test_ttft_includes_queueing_behind_a_full_batch():
    sim, res = simulate(cluster(max_num_seqs=1), [SimRequest("a", 0.0, 4, 3), SimRequest("b", 0.0, 4, 3)])
    assert [r.ttft for r in res.records] == pytest.approx([0.1, 0.4])


def test_runs_are_deterministic_for_a_seed(tmp_path):
    paths = []
    for run in range(2):
        path = tmp_path / f"run{run}.json"
        args = build_parser().parse_args([
            "simulate", "--model", "SmolLM2-135M", "--hardware", "h100", "--dataset", "random",
            "--num-prompts", "30", "--random-input-len", "200", "--random-output-len", "20",
            "--random-range-ratio", "0.5", "--request-rate", "50", "--seed", "3", "--num-blocks", "200",
            "--scheduler", "chunked,prefill-first", "--goodput", "ttft:50", "tpot:5", "--save-result", str(path)])
        assert args.func(args) == 0
        paths.append(path)
    assert paths[0].read_bytes() == paths[1].read_bytes()
    runs = json.loads(paths[0].read_text())["runs"]
    assert [r["label"] for r in runs] == ["chunked", "prefill-first"]
    assert all(len(r["requests"]) == 30 for r in runs)


# ---------------------------------------------------------------------------------------------- modes
@pytest.mark.parametrize("mode", SCHEDULING_MODES)
def test_every_mode_finishes_the_workload_without_leaking_blocks(mode):
    reqs = mixed_workload()
    sim, res = simulate(cluster(mode, num_blocks=40, budget=32, max_num_seqs=8), reqs)
    assert res.summary.completed == len(reqs)
    assert [r.output_tokens for r in res.records] == [q.output_len for q in reqs]
    assert_no_leak(sim)


def test_reserve_never_preempts_and_runs_fewer_requests_at_once_than_chunked():
    reqs = [SimRequest(f"q{i}", 0.0, 8, 40) for i in range(12)]  # 48 slots = 12 blocks each at the end
    runs = {mode: simulate(cluster(mode, num_blocks=48, budget=64), reqs) for mode in ("reserve", "chunked")}
    (reserve, r_res), (chunked, c_res) = runs["reserve"], runs["chunked"]
    assert r_res.num_preemptions == 0
    assert reserve.instances[0].max_running == 4  # 48 blocks / 12 reserved each
    assert chunked.instances[0].max_running > reserve.instances[0].max_running
    assert r_res.summary.completed == c_res.summary.completed == 12


def test_a_larger_max_tokens_cap_only_shrinks_reserves_batch():
    """Requests stop at their output length (EOS) whatever the cap; only ``reserve`` reserves the cap."""
    def run(mode, cap):
        reqs = [SimRequest(f"q{i}", 0.0, 8, 8, max_tokens=cap) for i in range(8)]
        sim, res = simulate(cluster(mode, num_blocks=64, budget=64), reqs)
        assert [r.output_tokens for r in res.records] == [8] * 8
        assert_no_leak(sim)
        return sim.instances[0].max_running

    assert run("reserve", 8) == 8 and run("reserve", 56) == 4  # 16 vs 64 slots reserved per request
    assert run("chunked", 8) == run("chunked", 56) == 8


def test_paged_never_mixes_prefills_and_decodes_in_a_step():
    reqs = mixed_workload()
    paged, _ = simulate(cluster("prefill-first", num_blocks=64, budget=48), reqs)
    chunked, _ = simulate(cluster("chunked", num_blocks=64, budget=48), reqs)
    assert paged.instances[0].num_mixed_steps == 0
    assert chunked.instances[0].num_mixed_steps > 0


# ------------------------------------------------------------------------------- cluster and transfer
def test_disaggregation_adds_exactly_the_pull_and_one_step_before_the_first_token():
    """The engine's hand-off, simulated: the producer prefills (its token is not the client's), the consumer
    pulls the prompt but its last token (9 tokens · 50 B / 1000 B/s = 0.45 s) and computes that token, which
    samples the first output token; from there the decode runs as colocated."""
    req = [SimRequest("a", 0.0, 10, 4)]
    _, colocated = simulate(cluster(), req)
    d = Disaggregation(1, 1, link_bandwidth=1000.0, kv_bytes_per_token=50)
    sim, disagg = simulate(cluster(disaggregation=d), req)
    (c,), (g,) = colocated.records, disagg.records
    assert g.ttft == pytest.approx(c.ttft + 0.45 + STEP)
    assert g.itls == pytest.approx(c.itls)
    assert g.output_tokens == 4 and disagg.mean_kv_transfer_s == pytest.approx(0.45)
    prefill, decode = sim.instances
    assert (prefill.role, decode.role) == ("prefill", "decode")
    assert (prefill.num_steps, decode.num_steps) == (1, 4)  # the prompt once; then last token + 3 decodes
    assert_no_leak(sim)


def test_pulls_queue_on_a_prefill_instances_link():
    d = Disaggregation(1, 2, link_bandwidth=1000.0, kv_bytes_per_token=50)
    reqs = [SimRequest("a", 0.0, 10, 3), SimRequest("b", 0.0, 10, 3)]  # prefilled together, pulled in turn
    sim, res = simulate(cluster(disaggregation=d), reqs)
    a, b = res.records
    assert b.ttft - a.ttft == pytest.approx(0.45)
    assert [inst.num_steps > 0 for inst in sim.instances] == [True, True, True]  # least-loaded spreads
    assert_no_leak(sim)


def test_the_producer_holds_the_blocks_until_the_pull_lands():
    d = Disaggregation(1, 1, link_bandwidth=1000.0, kv_bytes_per_token=50)
    sim = Simulator(cluster(disaggregation=d), ConstantCostModel(STEP), [SimRequest("a", 0.0, 10, 4)])
    held = []
    real = sim.on_kv_transfer_done

    def spy(ev):
        held.append(sim.instances[0].scheduler.make_stats().num_blocks_held_for_pull)
        real(ev)
        held.append(sim.instances[0].scheduler.make_stats().num_blocks_held_for_pull)

    sim.on_kv_transfer_done = spy
    sim.run()
    assert held == [3, 0]  # 10 tokens in blocks of 4, held until the pull lands at 0.55 s


@pytest.mark.parametrize("mode", SCHEDULING_MODES)
def test_disaggregation_runs_under_every_scheduler_mode(mode):
    d = Disaggregation(1, 2, link_bandwidth=1000.0, kv_bytes_per_token=50)
    sim, res = simulate(cluster(mode, disaggregation=d), mixed_workload(12))
    assert res.summary.completed == 12
    assert_no_leak(sim)


@pytest.mark.parametrize("routing", ["round-robin", "least-loaded"])
def test_replicas_share_the_load(routing):
    reqs = [SimRequest(f"q{i}", 0.0, 8, 4) for i in range(6)]
    sim, res = simulate(cluster(num_replicas=3, routing=routing), reqs)
    assert [inst.num_steps for inst in sim.instances] == [4, 4, 4]
    assert res.summary.completed == 6
    assert_no_leak(sim)


def shared_prefix_workload() -> list[SimRequest]:
    """4 rounds of 4 requests; each prompt is one of 4 groups' 32-token prefix + 4 private tokens. Within a
    round the groups come in a rotated order (group (j + k) % 4 is j-th in round k, 10 ms apart), so that
    round-robin over 4 replicas sends every group to every replica once; rounds are 1 s apart (all idle)."""
    out = []
    for k in range(4):
        for j in range(4):
            g = (j + k) % 4
            ids = tuple(1000 * (g + 1) + t for t in range(32)) + tuple(50_000 + 10 * (4 * k + j) + t for t in range(4))
            out.append(SimRequest(f"r{k}g{g}", k + 0.01 * j, 36, 2, prompt_token_ids=ids))
    return out


def test_prefix_affinity_beats_round_robin_on_shared_prefixes_with_the_routers_own_policies():
    """The simulator routes with goodserve.router.policies. Round-robin shows every group to every replica
    once: no hit. Prefix affinity spreads the first round (least outstanding tokens: 4 concurrent requests
    on 4 replicas) and sends each later request of a group where its prefix is: 12 requests x 32 cached
    tokens of 16 x 36 looked up. The router's counters return to zero."""
    from goodserve.router.policies import PrefixAffinity, RoundRobin

    results = {}
    for routing in ("round-robin", "prefix-affinity"):
        sim, res = simulate(cluster(num_replicas=4, routing=routing, num_blocks=128), shared_prefix_workload())
        assert res.summary.completed == 16
        assert [(s.outstanding_requests, s.outstanding_tokens, s.queued_prefill_tokens)
                for s in sim.backend_states.values()] == [(0, 0, 0)] * 4
        assert_no_leak(sim)
        results[routing] = (sim, res)
    rr, pa = results["round-robin"], results["prefix-affinity"]
    assert type(rr[0]._policies["front"]) is RoundRobin and type(pa[0]._policies["front"]) is PrefixAffinity
    assert rr[1].prefix_cache_hit_rate == 0.0
    assert pa[1].prefix_cache_hit_rate == pytest.approx(12 * 32 / (16 * 36))
    assert [i["prefix_cache_hit_rate"] for i in pa[1].instances] == pytest.approx([3 * 32 / (4 * 36)] * 4)
    assert [inst.num_steps for inst in pa[0].instances] == [inst.num_steps for inst in rr[0].instances]


def test_least_loaded_is_an_alias_and_unknown_routing_is_refused():
    from goodserve.router.policies import LeastLoaded

    sim = Simulator(cluster(num_replicas=2, routing="least-loaded"), ConstantCostModel(STEP), [])
    assert type(sim._policies["front"]) is LeastLoaded and sim._policies["front"].metric == "outstanding_tokens"
    with pytest.raises(ValueError, match="routing must be one of"):
        cluster(num_replicas=2, routing="random")
    with pytest.raises(ValueError, match="2 prompt_token_ids for prompt_len 3"):
        SimRequest("x", 0.0, 3, 1, prompt_token_ids=(300, 301))


def test_a_request_too_large_for_the_pool_fails_and_is_counted():
    sim, res = simulate(cluster(num_blocks=4), [SimRequest("big", 0.0, 30, 4), SimRequest("ok", 0.0, 4, 2)])
    assert [r.success for r in res.records] == [False, True]
    assert "KV blocks" in res.records[0].error
    assert res.summary.failed == 1 and res.summary.attainment == 0.5


# ---------------------------------------------------------------------------------------- cost models
def _step(*shapes: tuple[int, int, bool]) -> SchedulerOutput:
    out = SchedulerOutput()
    for i, (computed, new, sample) in enumerate(shapes):
        out.scheduled.append(ScheduledRequest(f"s{i}", computed, new, sample))
    return out


def test_roofline_decode_step_matches_the_planners_decode_roofline():
    arch, hw = load_arch("Llama-3-8B"), get_hardware("h100")
    model = RooflineCostModel(arch, hw)
    batch, context = 16, 2048
    ours = model.step_time(_step(*[(context - 1, 1, True)] * batch))
    assert ours == pytest.approx(decode_step(arch, hw, batch, context).step_s, rel=0.01)


def test_roofline_prefill_is_compute_bound_and_attention_is_causal():
    arch, hw = load_arch("Llama-3-8B"), get_hardware("h100")
    model = RooflineCostModel(arch, hw)
    shape = StepShape.of(_step((0, 2048, True)))
    assert shape.attention_pairs == 2048 * 2049 // 2
    gemm = model.gemm_time(shape)
    assert gemm == pytest.approx(2 * 6.98e9 * 2048 / 989.4e12, rel=0.05)  # ~7B non-embedding GEMM params
    # the weights are read once per step: doubling a decode batch costs far less than double
    one = model.step_time(_step((1000, 1, True)))
    two = model.step_time(_step((1000, 1, True), (1000, 1, True)))
    assert two < 1.1 * one


# Decode-only steps (tokens == sampled) and steps with a prompt chunk, so all six coefficients are identified.
TRUTH = LinearCostModel(StepCoefficients(2e-3, 5e-5, 3e-4, 1e-9, prefill_overhead_s=4e-3, prefill_per_sampled_s=2e-4))
FIT_SHAPES = [(1, 1, 100), (8, 8, 4000), (32, 32, 30000), (512, 1, 131328), (512, 0, 400000), (64, 60, 80000),
              (128, 4, 9000)]


def test_linear_fit_recovers_known_coefficients():
    truth = TRUTH
    shapes = [StepShape(t, s, p, 0, s) for t, s, p in FIT_SHAPES]
    fit = fit_linear(shapes, [truth.predict(s) for s in shapes])
    for name, value in truth.to_dict().items():
        assert fit.to_dict()[name] == pytest.approx(value, rel=1e-6)


def test_profile_fits_a_servers_step_trace(tmp_path, capsys):
    """``goodserve profile --from-step-trace`` fits each step's whole serving-loop cycle, not ``step_s``."""
    truth = TRUTH
    shapes = [StepShape(t, s, p, p, s) for t, s, p in FIT_SHAPES]
    trace = tmp_path / "trace.jsonl"
    trace.write_text("".join(TracedStep(0.1 * i, truth.predict(s), truth.predict(s) / 2, False, s).to_json() + "\n"
                             for i, s in enumerate(shapes)))
    out = tmp_path / "fit.json"
    args = build_parser().parse_args(["profile", "--from-step-trace", str(trace), "--output", str(out)])
    assert args.func(args) == 0
    fit = LinearCostModel.load(out)
    for name, value in truth.to_dict().items():
        assert getattr(fit.coefficients, name) == pytest.approx(value, rel=1e-5)
    assert json.loads(out.read_text())["grid"] == {"step_traces": [str(trace)]}
    assert "7 steps" in capsys.readouterr().out


def test_simulate_clips_lengths_and_draws_arrivals_as_the_benchmark_does():
    """The same flags give ``goodserve bench serve`` and ``goodserve simulate`` the same workload."""
    from goodserve.bench import datasets
    from goodserve.workload.arrivals import gamma_arrivals

    args = build_parser().parse_args(["simulate", "--model", "SmolLM2-135M", "--dataset", "azure-conv",
                                      "--num-prompts", "30", "--max-input-len", "512", "--max-output-len", "128",
                                      "--trace-start", "5", "--seed", "3"])
    sim = build_workload(args, 2.0, 8192)
    bench = datasets.build_workload("azure-conv", 30, tokenizer=None, vocab_size=49152, max_model_len=8192,
                                    max_input_len=512, max_output_len=128, start=5, seed=3)
    assert [(r.prompt_len, r.output_len) for r in sim] == [(b.prompt_len, b.output_len) for b in bench]
    assert max(r.prompt_len for r in sim) == 512 and max(r.output_len for r in sim) == 128
    assert [r.arrival for r in sim] == gamma_arrivals(30, 2.0, 1.0, seed=3)


def test_simulate_prefix_repetition_sends_the_benchmarks_shared_prefix_prompts():
    """``--dataset prefix-repetition`` gives the simulator the token-id prompts ``goodserve bench serve`` sends
    (shared prefixes intact), so routing and the prefix cache see the same sharing."""
    from goodserve.workload.datasets import prefix_repetition
    from goodserve.sim.simulate_cli import SIM_VOCAB

    args = build_parser().parse_args(["simulate", "--model", "SmolLM2-135M", "--dataset", "prefix-repetition",
                                      "--num-prompts", "12", "--prefix-len", "40", "--suffix-len", "8",
                                      "--num-prefixes", "3", "--random-output-len", "5", "--seed", "4"])
    sim = build_workload(args, 2.0, 1024)
    prompts = prefix_repetition(12, 40, 8, 3, 5, SIM_VOCAB, 1024, seed=4)
    assert [r.prompt_token_ids for r in sim] == prompts
    assert {r.prompt_len for r in sim} == {48} and {r.output_len for r in sim} == {5}
    assert len({p[:40] for p in prompts}) == 3
    with pytest.raises(ValueError, match="trace"):
        build_workload(args, math.nan, 1024)


def test_replay_simulates_the_measured_requests_and_reports_errors(tmp_path, capsys):
    """Two measured requests (sent at 0 and 0.5 s, 4 prompt and 3 output tokens) replayed with 100 ms steps:
    simulated TTFT 100 ms and TPOT 100 ms exactly, against measured 125 ms and 80 ms."""
    from goodserve.workload.metrics import RequestRecord, summarize
    from goodserve.workload.report import RunResult, save_json

    records = [RequestRecord(arrival=t, ttft=0.125, itls=[0.08, 0.08], e2e=0.285, prompt_tokens=4, output_tokens=3,
                             success=True, expected_output_tokens=3) for t in (0.0, 0.5)]
    bench = tmp_path / "bench.json"
    save_json(str(bench), [RunResult("server", 2.0, summarize(records, 0.785, {"ttft": 0.2}), records)])
    fit = tmp_path / "fit.json"
    fit.write_text(json.dumps({"coefficients": {"overhead_s": STEP, "per_token_s": 0, "per_sampled_s": 0,
                                                "per_pair_s": 0}}))
    args = build_parser().parse_args(["simulate", "--model", "SmolLM2-135M", "--hardware", "cpu-local",
                                      "--cost-model", str(fit), "--replay", str(bench), "--num-blocks", "64",
                                      "--save-result", str(tmp_path / "sim.json")])
    assert args.func(args) == 0
    out = capsys.readouterr().out
    assert "chunked (measured: server) @ 2 req/s" in out
    assert re.search(r"p50 TTFT\s+125\.0\s+100\.0\s+-20\.0%", out)
    assert re.search(r"p90 TPOT\s+80\.0\s+100\.0\s+\+25\.0%", out)
    assert "largest |error| on p50/p90 TTFT and TPOT: 25.0%" in out
    run = json.loads((tmp_path / "sim.json").read_text())["runs"][0]
    assert [r["arrival"] for r in run["requests"]] == [0.0, 0.5]
    assert run["summary"]["slos"] == {"ttft": 0.2} and run["summary"]["attainment"] == 1.0
    with pytest.raises(ValueError, match="not a replayable"):
        load_bench_runs(fit)
    sweep = build_parser().parse_args(["simulate", "--model", "SmolLM2-135M", "--replay", str(bench), "--sweep", "1,2"])
    assert sweep.func(sweep) == 2
    assert "drop --sweep" in capsys.readouterr().err


def test_replay_leaves_out_failed_requests_and_refuses_closed_loop_runs(tmp_path):
    from goodserve.workload.metrics import RequestRecord, summarize
    from goodserve.workload.report import RunResult, save_json

    ok = RequestRecord(arrival=0.0, ttft=0.1, itls=[0.1], e2e=0.2, prompt_tokens=4, output_tokens=2, success=True,
                       expected_output_tokens=2)
    failed = RequestRecord(arrival=0.2, prompt_tokens=4, success=False, error="HTTP 429")
    path = tmp_path / "bench.json"
    save_json(str(path), [RunResult("server", 1.0, summarize([ok, failed], 1.0), [ok, failed])])
    (run,) = load_bench_runs(path)
    assert [(r.arrival, r.prompt_len, r.output_len) for r in run.requests] == [(0.0, 4, 2)]
    assert run.num_failed == 1
    save_json(str(path), [RunResult("server", 1.0, summarize([ok], 1.0), [ok], {"max_concurrency": 4})])
    with pytest.raises(ValueError, match="closed-loop"):
        load_bench_runs(path)


def test_linear_cost_model_loads_a_profile(tmp_path):
    path = tmp_path / "fit.json"
    path.write_text(json.dumps({"coefficients": {"overhead_s": 0.01, "per_token_s": 0.001, "per_sampled_s": 0.0,
                                                 "per_pair_s": 0.0}}))
    model = LinearCostModel.load(path)
    assert model.step_time(_step((0, 10, True))) == pytest.approx(0.02)
    with pytest.raises(ValueError, match="cannot read"):
        LinearCostModel.load(tmp_path / "missing.json")


def test_noisy_cost_model_scatters_drifts_and_stalls_as_asked():
    """A shared machine's step times: the noiseless model unchanged; i.i.d. log-normal scatter of the asked
    sigma around a median of 1; an AR(1) drift with the asked sigma and step-to-step correlation
    exp(-1/steps); stalls that add their seconds to the asked share of steps. The same seed, the same
    factors."""
    import numpy as np

    step = _step((0, 10, True))
    base = ConstantCostModel(0.01)
    quiet = NoisyCostModel(base, 0.0)
    assert [quiet.step_time(step) for _ in range(3)] == [0.01] * 3 and quiet.predict(StepShape(1, 1, 1, 1, 1)) == 0.01
    assert NoisyCostModel(base, 0.2).step_time(SchedulerOutput()) == 0.0

    noisy = NoisyCostModel(base, 0.2, seed=7)
    logs = np.log([noisy.step_time(step) / 0.01 for _ in range(20000)])
    assert abs(logs.mean()) < 0.01 and abs(logs.std() - 0.2) < 0.005
    again = NoisyCostModel(base, 0.2, seed=7)
    assert [again.step_time(step) for _ in range(5)] == pytest.approx(np.exp(logs[:5]) * 0.01, rel=1e-12)

    drift = NoisyCostModel(base, 0.0, drift_sigma=0.3, drift_steps=20, seed=1)
    d = np.log([drift.factor() for _ in range(100000)])
    assert abs(d.std() - 0.3) < 0.02
    assert np.corrcoef(d[:-1], d[1:])[0, 1] == pytest.approx(math.exp(-1 / 20), abs=0.01)

    stalls = NoisyCostModel(base, 0.0, stall_p=0.1, stall_s=2.0, seed=3)
    times = [stalls.step_time(step) for _ in range(10000)]
    assert set(round(t, 12) for t in times) == {0.01, 2.01}
    assert sum(t > 1 for t in times) / len(times) == pytest.approx(0.1, abs=0.01)

    for bad in (dict(noise_sigma=-0.1), dict(noise_sigma=0.1, drift_sigma=-1), dict(noise_sigma=0, drift_steps=0),
                dict(noise_sigma=0, stall_p=1.5), dict(noise_sigma=0, stall_p=0.1, stall_s=-1)):
        with pytest.raises(ValueError):
            NoisyCostModel(base, **bad)
    assert parse_stall("0.001:2") == (0.001, 2.0) and parse_stall(None) == (0.0, 0.0)
    with pytest.raises(ValueError, match="P:SECONDS"):
        parse_stall("0.001")


def test_simulate_with_step_noise_is_seeded_and_slower_than_without(tmp_path):
    """``--step-noise/--step-drift/--step-stall`` wrap the cost model; a run is reproducible for its seed,
    and stalls (here one per step) lengthen it."""
    def run(*noise: str) -> dict:
        path = tmp_path / "run.json"
        args = build_parser().parse_args([
            "simulate", "--model", "SmolLM2-135M", "--hardware", "h100", "--dataset", "random", "--num-prompts", "20",
            "--random-input-len", "100", "--random-output-len", "20", "--request-rate", "inf", "--seed", "3",
            "--num-blocks", "200", "--save-result", str(path), *noise])
        assert args.func(args) == 0
        return json.loads(path.read_text())["runs"][0]["summary"]

    quiet = run()
    noisy = run("--step-noise", "0.2", "--step-drift", "0.2", "--step-stall", "1:0.5")
    assert noisy == run("--step-noise", "0.2", "--step-drift", "0.2", "--step-stall", "1:0.5")
    assert noisy["duration"] > quiet["duration"] + 0.5


# ------------------------------------------------------------------------------------------------ CLI
def test_cli_parsers_and_trace_arrivals():
    assert parse_disaggregate("2:1") == (2, 1)
    with pytest.raises(ValueError):
        parse_disaggregate("2")
    assert parse_rates("1,inf")[1] == math.inf and math.isnan(parse_rates("trace")[0])
    args = build_parser().parse_args(["simulate", "--model", "Llama-3-8B", "--dataset", "azure-code",
                                      "--num-prompts", "5"])
    reqs = build_workload(args, math.nan, 8192)
    assert reqs[0].arrival == 0.0 and [r.arrival for r in reqs] == sorted(r.arrival for r in reqs)


def test_cli_sweep_reports_the_highest_rate_meeting_the_slos(capsys, tmp_path):
    args = build_parser().parse_args([
        "simulate", "--model", "Llama-3-8B", "--hardware", "h100", "--dataset", "random", "--num-prompts", "40",
        "--random-input-len", "512", "--random-output-len", "32", "--sweep", "1,4", "--goodput", "ttft:200",
        "tpot:40", "--disaggregate", "1:1", "--plot", str(tmp_path / "sweep.png")])
    assert args.func(args) == 0
    text = capsys.readouterr().out
    assert "chunked-disagg: goodput 4 req/s" in text and "per instance" in text
    assert (tmp_path / "sweep.png").stat().st_size > 0


def test_kv_aware_routes_on_the_replicas_kv_events_in_simulation():
    """The simulator feeds the kv-aware policy's index the replicas' own KV events (issue 35): on the shared
    prefixes it finds every later request's group where it is cached, as prefix affinity does (12 x 32 hit
    tokens of 16 x 36), and after the run the index equals every replica's prefix cache."""
    from goodserve.kv_events.events import KVEventBatch
    from goodserve.router.policies import KVAware

    sim, res = simulate(cluster(num_replicas=4, routing="kv-aware", num_blocks=128), shared_prefix_workload())
    assert type(sim._policies["front"]) is KVAware and res.summary.completed == 16
    assert res.prefix_cache_hit_rate == pytest.approx(12 * 32 / (16 * 36))
    assert [(s.outstanding_requests, s.outstanding_tokens, s.queued_prefill_tokens, s.queued_prefill_requests)
            for s in sim.backend_states.values()] == [(0, 0, 0, 0)] * 4
    assert_no_leak(sim)
    for inst in sim.instances:
        manager = inst.scheduler.kv_cache_manager
        sim.kv_index.apply(inst.name, KVEventBatch(sim.now, tuple(manager.take_kv_events()), stream_id=inst.name))
        assert sim.kv_index.instances[inst.name].hashes == {h for h, _ in manager.block_pool.cached_items()}
        assert sim.kv_index.instances[inst.name].hashes
