"""``goodserve simulate``: serve a workload on simulated hardware with the engine's real scheduler.

``goodserve profile`` (in :mod:`goodserve.sim.profile_cli`) measures this machine's step times and fits the
cost model that ``simulate --hardware cpu-local --cost-model FILE`` uses.

The output is the serving benchmark's (:mod:`goodserve.workload.report`): the same summary table, sweep table,
JSON result and plots, so a simulated run reads like a measured one.
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import math
import sys
import time
from typing import Any, Optional, TextIO

from goodserve.config import SCHEDULING_MODES, SCHEDULING_POLICIES, CacheConfig, SchedulerConfig
from goodserve.config_flags import add_scheduler_flags, split_choices
from goodserve.spec.config import SpeculativeConfig
from goodserve.sim.cost_model import CostModel, LinearCostModel, NoisyCostModel, RooflineCostModel
from goodserve.sim.hardware import HARDWARE, get_hardware
from goodserve.kv_cache.layout import longest_request, uniform_layout
from goodserve.sim.model_size import DTYPE_BYTES, kv_bytes_per_token, kv_cache_layout, kv_page_bytes, parse_dtype
from goodserve.sim.plan_cli import add_kv_cache_dtype_argument
from goodserve.sim.planner import plan_memory
from goodserve.sim.presets import PRESETS, ArchSpec, load_arch
from goodserve.sim.replay import MeasuredRun, compare, format_comparison, load_bench_runs
from goodserve.sim.simulator import Simulator
from goodserve.sim.spec import ROUTING_POLICIES, ClusterConfig, Disaggregation, SimRequest
from goodserve.workload.arrivals import poisson_arrivals
from goodserve.workload.datasets import (AZURE_FILES, MOONCAKE_BLOCK, RequestSpec, clip_specs, load_azure,
                                         load_mooncake, prefix_repetition, random_lengths,
                                         synthesise_shared_prompts)
from goodserve.workload.report import (RunResult, class_results, format_classes, format_summary, format_sweep,
                                       max_rate_meeting, plot, rate_str, save_json)
from goodserve.workload.slo import assign_slo_classes, parse_slo_class_mix, parse_slos

logger = logging.getLogger(__name__)

DATASETS = (*AZURE_FILES, "mooncake", "prefix-repetition", "random")
# Vocabulary of the synthesised Mooncake prompts: only equality of ids matters to the simulated prefix cache.
SIM_VOCAB = 1 << 20
#: Datasets whose prompts are token ids that share prefixes (the others' ids are private to each request).
SHARED_PREFIX_DATASETS = ("mooncake", "prefix-repetition")
MAX_TOKENS_POLICIES = ("exact", "pow2", "max")


def add_simulate_parser(subparsers: Any) -> argparse.ArgumentParser:
    """Add the ``simulate`` subcommand; its ``func`` default is :func:`run_simulate`."""
    presets = ", ".join(spec.name for spec in PRESETS.values())
    p = subparsers.add_parser(
        "simulate", help="discrete-event simulation of serving on a GPU/CPU model, with the real scheduler",
        description="Simulate serving a workload: the engine's Scheduler decides every step, a roofline (or "
                    "fitted) cost model times it. Prints the serving benchmark's metrics.")
    p.add_argument("--model", required=True, help=f"preset ({presets}), a config.json, or a HF model directory")
    p.add_argument("--hardware", default="h100", choices=list(HARDWARE), help="accelerator (default: h100)")
    p.add_argument("--dtype", default="bfloat16", type=parse_dtype, choices=list(DTYPE_BYTES),
                   help="weights/KV dtype (default: bfloat16; bf16, fp8, fp32 also accepted)")
    add_kv_cache_dtype_argument(p)
    p.add_argument("--tp", type=int, default=1, help="tensor-parallel degree per instance (default: 1)")
    p.add_argument("--cost-model", default=None,
                   help="JSON from `goodserve profile`: fitted step times instead of the roofline")
    p.add_argument("--step-noise", type=float, default=0.0, metavar="SIGMA",
                   help="scatter each step's time by a lognormal factor of this log-space sigma (a shared "
                        "machine; 0.2 puts the 0.9 quantile at 1.29x the cost model)")
    p.add_argument("--step-drift", type=float, default=0.0, metavar="SIGMA",
                   help="and by a slow drift of the machine's speed: an AR(1) log-factor of this sigma")
    p.add_argument("--step-drift-steps", type=float, default=500.0, metavar="N",
                   help="the drift's correlation length in steps (default: 500)")
    p.add_argument("--step-stall", default=None, metavar="P:SECONDS",
                   help="and stall a step by SECONDS with probability P (e.g. 0.001:2)")
    w = p.add_argument_group("workload")
    w.add_argument("--dataset", default="azure-conv", choices=DATASETS)
    w.add_argument("--num-prompts", type=int, default=200)
    w.add_argument("--request-rate", default="inf",
                   help="requests/s (Poisson), 'inf' (all at 0) or 'trace' (the Azure or Mooncake trace's own clock)")
    w.add_argument("--length-scale", type=float, default=1.0,
                   help="mooncake: multiply prompt and output lengths (and the 512-token shared blocks) by this")
    w.add_argument("--random-input-len", type=int, default=1024)
    w.add_argument("--random-output-len", type=int, default=128, help="random and prefix-repetition: output tokens")
    w.add_argument("--prefix-len", type=int, default=256, help="prefix-repetition: tokens of each shared prefix")
    w.add_argument("--suffix-len", type=int, default=32, help="prefix-repetition: tokens of each request's suffix")
    w.add_argument("--num-prefixes", type=int, default=4, help="prefix-repetition: distinct shared prefixes")
    w.add_argument("--random-range-ratio", type=float, default=0.0)
    w.add_argument("--max-input-len", type=int, default=None, help="clip prompts to this many tokens")
    w.add_argument("--max-output-len", type=int, default=None, help="clip outputs to this many tokens")
    w.add_argument("--trace-start", type=int, default=0, help="first row of an Azure or Mooncake trace (>= 0)")
    w.add_argument("--seed", type=int, default=0, help="seed of arrivals and random lengths")
    w.add_argument("--max-tokens", default="exact", choices=MAX_TOKENS_POLICIES,
                   help="max_tokens each client asks for: exact (the output length, an oracle), pow2 (next power "
                        "of two) or max (what the context leaves); matters to --scheduler reserve")
    w.add_argument("--replay", default=None, metavar="BENCH_JSON",
                   help="simulate the requests of a `goodserve bench` result (each run's send times and lengths) "
                        "and print simulated against measured latencies; replaces the workload flags")
    w.add_argument("--sweep", default=None, help="comma-separated request rates; reports the highest rate "
                                                 "with >= 90%% SLO attainment")
    w.add_argument("--goodput", nargs="+", default=None, metavar="NAME:MS",
                   help="SLOs in ms, e.g. ttft:500 tpot:50 (names: ttft, tpot, e2el)")
    w.add_argument("--slo-class", action="append", default=None, metavar="NAME:TTFT_MS:TPOT_MS:SHARE",
                   help="mixed SLO classes (repeatable; shares sum to 1): each request is drawn into one (seeded) "
                        "and carries its SLOs; attainment and goodput are also reported per class")
    s = p.add_argument_group("engine (the flags of serve; --num-blocks default: the planner's pool for the "
                             "hardware)")
    add_scheduler_flags(s, compare=True)
    s.add_argument("--gpu-memory-utilization", type=float, default=0.9)
    s.add_argument("--speculative-config", default=None,
                   help='speculative decoding as on serve, e.g. \'{"method": "ngram", "num_speculative_tokens": 4}\'')
    s.add_argument("--speculative-length", default=None, help="auto (default) or a fixed number of draft tokens")
    s.add_argument("--spec-acceptance", default="0.7", metavar="RATE[,RATE...]",
                   help="each draft's acceptance rate by position (the last repeats), e.g. measured on a server's "
                        "/metrics (spec_decode_num_accepted_tokens_per_pos); default 0.7")
    c = p.add_argument_group("cluster")
    c.add_argument("--replicas", type=int, default=1, help="colocated instances behind the router")
    c.add_argument("--routing", default="least-outstanding-tokens", choices=list(ROUTING_POLICIES),
                   help="the replicas' policy, the HTTP router's own (goodserve.router.policies); prefix-affinity "
                        "routes by the prompt's token ids (shared prefixes only exist with --dataset mooncake); "
                        "least-loaded is an alias of least-outstanding-tokens")
    c.add_argument("--disaggregate", default=None, metavar="P:D", help="P prefill and D decode instances")
    c.add_argument("--link-bandwidth", type=float, default=50.0,
                   help="GB/s of each prefill instance's KV link (default: 50)")
    o = p.add_argument_group("output")
    o.add_argument("--save-result", default=None, help="write the runs (summary + per-request records) as JSON")
    o.add_argument("--plot", default=None, help="write TTFT/TPOT CDFs (and goodput vs rate on a sweep) as PNG")
    p.set_defaults(func=run_simulate)
    return p


def add_profile_parser(subparsers: Any) -> argparse.ArgumentParser:
    """Add the ``profile`` subcommand (see :mod:`goodserve.sim.profile`)."""
    from goodserve.sim.profile_cli import add_profile_arguments, run_profile

    p = subparsers.add_parser(
        "profile", help="measure this machine's step times and fit the simulator's cpu-local cost model",
        description="Run the real engine over a small grid of batch shapes and fit "
                    "overhead + per-token + per-sampled-token + per-attention-pair step costs.")
    add_profile_arguments(p)
    p.set_defaults(func=run_profile)
    return p


# ----------------------------------------------------------------------------------------- building
def parse_acceptance(text: str) -> tuple[float, ...]:
    """``"0.8,0.6"`` -> ``(0.8, 0.6)``.

    Raises:
        ValueError: naming ``--spec-acceptance`` on anything else.
    """
    try:
        return tuple(float(x) for x in text.split(","))
    except ValueError:
        raise ValueError(f"--spec-acceptance: expected comma-separated rates, got {text!r}") from None


def parse_disaggregate(text: str) -> tuple[int, int]:
    """``"2:1"`` -> ``(2, 1)``.

    Raises:
        ValueError: for anything but two positive integers around a colon.
    """
    try:
        p, d = (int(x) for x in text.split(":"))
    except ValueError:
        raise ValueError(f"--disaggregate expects P:D (e.g. 1:1), got {text!r}") from None
    if p < 1 or d < 1:
        raise ValueError(f"--disaggregate needs at least one prefill and one decode instance, got {text!r}")
    return p, d


def parse_rates(text: str) -> list[float]:
    """``"1,2,inf"`` -> ``[1.0, 2.0, inf]``; ``"trace"`` -> ``[nan]`` (the trace's clock).

    Raises:
        ValueError: for a non-positive or unparsable rate.
    """
    rates = []
    for item in text.split(","):
        item = item.strip().lower()
        if item == "trace":
            rates.append(math.nan)
            continue
        try:
            rate = float(item)
        except ValueError:
            raise ValueError(f"bad request rate {item!r}") from None
        if not rate > 0:
            raise ValueError(f"request rate must be > 0, inf or trace, got {item!r}")
        rates.append(rate)
    return rates


def build_workload(args: argparse.Namespace, rate: float, max_model_len: int) -> list[SimRequest]:
    """The requests of one run: the dataset's lengths, clipped as ``goodserve bench`` clips them, with Poisson
    arrivals at ``rate`` (or the trace's). The same flags and seed give ``goodserve bench serve``'s workload.

    Raises:
        ValueError: ``trace`` arrivals asked of the random dataset, or a bad clipping limit.
    """
    if args.dataset == "random":
        specs = random_lengths(args.num_prompts, args.random_input_len, args.random_output_len,
                               args.random_range_ratio, seed=args.seed)
    elif args.dataset == "mooncake":  # as `goodserve bench serve --dataset mooncake` builds it
        rows = load_mooncake(args.num_prompts, args.length_scale, args.trace_start)
        clipped = clip_specs([s for s, _ in rows], max_model_len, args.max_input_len, args.max_output_len)
        block = max(1, round(MOONCAKE_BLOCK * args.length_scale))
        specs = synthesise_shared_prompts(list(zip(clipped, (h for _, h in rows))), SIM_VOCAB, block, args.seed)
    elif args.dataset == "prefix-repetition":  # as `goodserve bench serve --dataset prefix-repetition` builds it
        ids = prefix_repetition(args.num_prompts, args.prefix_len, args.suffix_len, args.num_prefixes,
                                args.random_output_len, SIM_VOCAB, max_model_len, args.seed)
        specs = [RequestSpec(len(p), args.random_output_len, prompt_token_ids=p) for p in ids]
    else:
        specs = load_azure(args.dataset, args.num_prompts, max_model_len, args.trace_start)
    if args.dataset != "mooncake":
        specs = clip_specs(specs, max_model_len, args.max_input_len, args.max_output_len)
    if math.isnan(rate):
        if args.dataset in ("random", "prefix-repetition"):
            raise ValueError("--request-rate trace needs an Azure or the Mooncake dataset")
        arrivals = [s.arrival for s in specs]
    else:
        arrivals = poisson_arrivals(len(specs), rate, seed=args.seed)
    requests = []
    for i, (s, t) in enumerate(zip(specs, arrivals)):
        cap = {"exact": s.output_len, "pow2": 1 << (s.output_len - 1).bit_length(),
               "max": max_model_len - s.prompt_len}[args.max_tokens]
        requests.append(SimRequest(f"req-{i}", t, s.prompt_len, s.output_len, min(cap, max_model_len - s.prompt_len),
                                   prompt_token_ids=s.prompt_token_ids if args.dataset in SHARED_PREFIX_DATASETS else None))
    return requests


def parse_stall(text: Optional[str]) -> tuple[float, float]:
    """``P:SECONDS`` of ``--step-stall`` as (probability, seconds); ``(0, 0)`` for none.

    Raises:
        ValueError: if it is not two numbers separated by a colon.
    """
    if not text:
        return 0.0, 0.0
    try:
        p, s = text.split(":")
        return float(p), float(s)
    except ValueError:
        raise ValueError(f"--step-stall takes P:SECONDS (e.g. 0.001:2), got {text!r}") from None


def build_cost_model(args: argparse.Namespace, arch: ArchSpec) -> CostModel:
    """The flags' cost model, wrapped in the step-time noise they ask for (seeded by ``--seed``, anew for every
    run, so the runs of a comparison see the same factors step by step)."""
    if args.cost_model:
        model: CostModel = LinearCostModel.load(args.cost_model)
    else:
        model = RooflineCostModel(arch, get_hardware(args.hardware), args.dtype, args.tp,
                                  kv_dtype=getattr(args, "kv_cache_dtype", None))
    noise, drift = getattr(args, "step_noise", 0.0), getattr(args, "step_drift", 0.0)
    stall_p, stall_s = parse_stall(getattr(args, "step_stall", None))
    if noise or drift or stall_p:
        model = NoisyCostModel(model, noise, drift, getattr(args, "step_drift_steps", 500.0), stall_p, stall_s,
                               args.seed)
    return model


def build_cluster(args: argparse.Namespace, arch: ArchSpec, mode: str, policy: str = "fcfs") -> ClusterConfig:
    """Scheduler, KV pool and instances of one run from the flags (pool from the planner by default).

    Raises:
        ValueError: bad flags, or weights that leave no KV pool (from the planner).
    """
    max_model_len = args.max_model_len or arch.max_position_embeddings
    kv_dtype = getattr(args, "kv_cache_dtype", None) or args.dtype
    # The engine's layout: a mixed model's local groups free their blocks before the window; KV transfer takes one
    # full group.
    layout = uniform_layout(arch.num_hidden_layers) if args.disaggregate else kv_cache_layout(arch)
    if args.num_blocks is not None:
        num_blocks = args.num_blocks
    else:
        pool = plan_memory(arch, get_hardware(args.hardware), args.dtype, args.tp, context=max_model_len,
                           gpu_memory_utilization=args.gpu_memory_utilization,
                           block_size=args.block_size, kv_cache_dtype=kv_dtype).pool_bytes
        num_blocks = pool // kv_page_bytes(arch, kv_dtype, args.block_size, args.tp, layout)
    max_model_len = longest_request(layout.group_windows, args.block_size, num_blocks, max_model_len,
                                    args.max_num_batched_tokens if mode == "chunked" else None)
    disagg = None
    if args.disaggregate:
        p, d = parse_disaggregate(args.disaggregate)
        if args.replicas != 1:
            raise ValueError("--replicas applies to colocated serving; with --disaggregate give P:D instead")
        disagg = Disaggregation(p, d, args.link_bandwidth * 1e9,
                                kv_bytes_per_token(arch, kv_dtype, args.tp))
    return ClusterConfig(
        scheduler=SchedulerConfig(max_num_batched_tokens=args.max_num_batched_tokens,
                                  max_num_seqs=args.max_num_seqs, max_model_len=max_model_len,
                                  policy=policy, mode=mode, shed_load=args.shed_load and policy == "slo"),
        cache=CacheConfig(num_blocks=num_blocks, block_size=args.block_size, layout=layout),
        enable_prefix_caching=args.enable_prefix_caching, num_replicas=args.replicas, routing=args.routing,
        disaggregation=disagg,
        speculative=SpeculativeConfig.from_cli(args.speculative_config, args.speculative_length),
        spec_acceptance=parse_acceptance(args.spec_acceptance))


def simulate_once(args: argparse.Namespace, arch: ArchSpec, mode: str, rate: float,
                  slos: dict[str, float], requests: Optional[list[SimRequest]] = None,
                  policy: str = "fcfs", label: Optional[str] = None) -> RunResult:
    """One simulated run with scheduler mode ``mode`` and ``policy``: of ``requests``, or of the flags'
    workload at ``rate``."""
    cluster = build_cluster(args, arch, mode, policy)
    if requests is None:
        requests = build_workload(args, rate, cluster.scheduler.max_model_len)
    classes = parse_slo_class_mix(getattr(args, "slo_class", None))
    assigned = assign_slo_classes(len(requests), classes, args.seed) if classes else []
    requests = [dataclasses.replace(r, slo_ttft=c.slos.get("ttft"), slo_tpot=c.slos.get("tpot"))
                for r, c in zip(requests, assigned)] or requests
    result = Simulator(cluster, build_cost_model(args, arch), requests, slos).run()
    config = {"mode": mode, "policy": policy, "instances": result.instances, "num_instances": cluster.num_instances,
              "num_blocks": cluster.cache.num_blocks, "num_preemptions": result.num_preemptions,
              "mean_kv_transfer_s": result.mean_kv_transfer_s, "routing": cluster.routing,
              "prefix_cache_hit_rate": result.prefix_cache_hit_rate}
    if assigned:
        config["slo_classes"] = class_results(result.records, assigned, result.summary.duration)
    label = label or mode
    return RunResult(label=label if not cluster.disaggregation else f"{label}-disagg", rate=rate,
                     summary=result.summary, records=result.records, config=config)


# ------------------------------------------------------------------------------------------- command
def run_simulate(args: argparse.Namespace, out: Optional[TextIO] = None) -> int:
    """Execute ``goodserve simulate``.

    Returns:
        0 on success, 2 on bad input (the reason on stderr).
    """
    # Preemptions are counted in the report; one warning line each would drown it in a saturated sweep.
    sched_logger = logging.getLogger("goodserve.scheduler.scheduler")
    level = sched_logger.level
    if sched_logger.getEffectiveLevel() >= logging.WARNING:
        sched_logger.setLevel(logging.ERROR)
    try:
        return _run_simulate(args, out or sys.stdout)
    finally:
        sched_logger.setLevel(level)


def _run_simulate(args: argparse.Namespace, out: TextIO) -> int:
    try:
        arch = load_arch(args.model)
        modes = split_choices(args.scheduler, "--scheduler", SCHEDULING_MODES)
        policies = split_choices(args.scheduling_policy, "--scheduling-policy", SCHEDULING_POLICIES)
        if args.shed_load and "slo" not in policies:
            raise ValueError("--shed-load needs --scheduling-policy slo")
        variants = [(m, p, m if len(policies) == 1 else (p if len(modes) == 1 else f"{m}/{p}"))
                    for m in modes for p in policies]
        slos = parse_slos(args.goodput)
        jobs: list[tuple[float, Optional[MeasuredRun]]]
        if args.replay:
            if args.sweep:
                raise ValueError("--replay takes its rates from the benchmark result; drop --sweep")
            measured = load_bench_runs(args.replay)
            jobs = [(run.rate, run) for run in measured]
            slos = slos or {k: float(v) for k, v in measured[0].summary.get("slos", {}).items()}
            several_labels = len({run.label for run in measured}) > 1
        else:
            jobs = [(rate, None) for rate in parse_rates(args.sweep or args.request_rate)]
        results, comparisons = [], []
        for mode, policy, name in variants:
            for rate, run in jobs:
                t0 = time.perf_counter()
                result = simulate_once(args, arch, mode, rate, slos, run.requests if run else None, policy, name)
                if run is not None:
                    result.label = f"{name}/{run.label}" if several_labels else name
                    rows = compare(run.summary, result.summary.to_dict())
                    result.config["replay"] = {
                        "measured_label": run.label, "num_failed_not_replayed": run.num_failed,
                        "comparison": [{"figure": name, "measured_s": m, "simulated_s": sim, "relative_error": err}
                                       for name, m, sim, err in rows]}
                    comparisons.append(format_comparison(f"{result.label} (measured: {run.label})", rate, rows))
                results.append(result)
                logger.info("simulated %s at rate %s in %.1f s", name, rate_str(rate), time.perf_counter() - t0)
    except ValueError as exc:
        print(f"goodserve simulate: error: {exc}", file=sys.stderr)
        return 2
    _report(args, arch, results, comparisons, slos, out)
    return 0


def _report(args: argparse.Namespace, arch: ArchSpec, results: list[RunResult], comparisons: list[str],
            slos: dict[str, float], out: TextIO) -> None:
    """Print the runs (summary or sweep table, instance counters, goodput, replay comparisons) and write
    the JSON result and plot the flags ask for."""
    hw = "fitted " + args.cost_model if args.cost_model else args.hardware
    title = f"{arch.name} on {hw} x{results[0].config['num_instances']}, {args.replay or args.dataset}"
    if len(results) == 1:
        print(format_summary(results[0].summary, title), file=out)
    else:
        print(title, file=out)
        print(format_sweep(results), file=out)
    for r in results:
        c = r.config
        print(f"{r.label} @ {rate_str(r.rate)}: {c['num_instances']} instance(s) of {c['num_blocks']} KV blocks, "
              f"{c['num_preemptions']} preemptions, max running "
              f"{max(i['max_running'] for i in c['instances'])}, prefix-cache hit rate "
              f"{c['prefix_cache_hit_rate']:.1%}" + (f" ({c['routing']} routing)" if c["num_instances"] > 1 else "")
              + (f", mean KV transfer {c['mean_kv_transfer_s'] * 1e3:.2f} ms" if c["mean_kv_transfer_s"] else ""),
              file=out)
    if slos and len({r.rate for r in results if math.isfinite(r.rate)}) > 1:
        for label in dict.fromkeys(r.label for r in results):
            best = max_rate_meeting(results, label)
            n = next(r.config["num_instances"] for r in results if r.label == label)
            if best is not None:
                print(f"{label}: goodput {best:g} req/s at >= 90% attainment = {best / n:g} req/s per instance",
                      file=out)
    if any(r.config.get("slo_classes") for r in results):
        print(format_classes(results), file=out)
    for text in comparisons:
        print(text, file=out)
    meta = {"model": arch.name, "hardware": args.hardware, "cost_model": args.cost_model, "dtype": args.dtype,
            "kv_cache_dtype": getattr(args, "kv_cache_dtype", None) or args.dtype, "tp": args.tp, "replay": args.replay, "dataset": None if args.replay else args.dataset,
            "num_prompts": None if args.replay else args.num_prompts, "seed": None if args.replay else args.seed,
            "slos": slos, "argv": sys.argv[1:]}
    if args.save_result:
        save_json(args.save_result, results, meta)
        print(f"wrote {args.save_result}", file=out)
    if args.plot:
        plot(args.plot, results, title)
        print(f"wrote {args.plot}", file=out)
