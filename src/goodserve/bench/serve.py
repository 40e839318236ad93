"""``goodserve bench {serve, sweep, compare}``: online serving benchmark against OpenAI-compatible servers.

* ``serve``: one workload at one arrival process against one server; prints TTFT / TPOT / ITL / E2E
  statistics, throughput, SLO attainment and goodput.
* ``sweep``: the same requests at increasing rates; reports goodput and attainment per rate and the highest
  rate at which attainment is at least ``--min-attainment`` (DistServe's per-device goodput).
* ``compare``: the same as ``sweep`` against two servers, run one after the other (or, with
  ``--interleave``, rate by rate), with ratios.

A server is either given by URL (``--base-url``) or started by the benchmark (``--launch`` with a command
template holding ``{port}``, and ``{python}`` for this interpreter); launched servers run one at a time, so
they never share the CPU while measured.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import functools
import logging
import math
import os
import shlex
import signal
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from typing import Any, Optional

from goodserve.bench.client import Target, run_requests, server_info, server_tokenize, wait_ready
from goodserve.bench.datasets import DATASETS, BenchRequest, build_workload
from goodserve.workload import arrivals as A
from goodserve.workload.metrics import summarize
from goodserve.workload.report import (RunResult, class_results, format_classes, format_ratios, format_summary,
                                       format_sweep, plot, rate_str, save_json)
from goodserve.workload.slo import assign_slo_classes, parse_slo_class_mix, parse_slos

logger = logging.getLogger(__name__)

PROBE_TEXT = "The quick brown fox jumps over the lazy dog; 12 + 30 = 42."


# ------------------------------------------------------------------------------------------------ parsers
def _add_common(p: argparse.ArgumentParser, two_servers: bool) -> None:
    g = p.add_argument_group("server")
    g.add_argument("--base-url", default=None, help="server root, e.g. http://127.0.0.1:8000")
    g.add_argument("--launch", default=None,
                   help='start the server: a command template with {port} (and {python}), e.g. '
                        '"{python} -m goodserve.cli serve --port {port}"')
    g.add_argument("--label", default=None, help="name of this server in tables and plots")
    if two_servers:
        g.add_argument("--baseline-url", default=None, help="a second server to run the same workload against")
        g.add_argument("--baseline-launch", default=None, help="start the baseline server (template as --launch)")
        g.add_argument("--baseline-label", default="baseline")
    g.add_argument("--launch-timeout", type=float, default=600.0, help="seconds to wait for a launched server")
    g.add_argument("--endpoint", default="/v1/completions", choices=["/v1/completions", "/v1/chat/completions"])
    g.add_argument("--model", default=None, help="model name to send (default: the server's first model)")
    g.add_argument("--tokenizer", default=None,
                   help="GGUF file or HF directory (default: the default model's GGUF tokenizer, checked "
                        "against the server's /tokenize)")
    g.add_argument("--max-model-len", type=int, default=None, help="default: the server's /v1/models")
    w = p.add_argument_group("workload")
    w.add_argument("--dataset", default="random", choices=list(DATASETS))
    w.add_argument("--dataset-path", default=None)
    w.add_argument("--num-prompts", type=int, default=100)
    w.add_argument("--input-len", type=int, default=512, help="random dataset: prompt tokens")
    w.add_argument("--output-len", type=int, default=128, help="random and prefix-repetition: output tokens")
    w.add_argument("--prefix-len", type=int, default=256, help="prefix-repetition: tokens of each shared prefix")
    w.add_argument("--suffix-len", type=int, default=32, help="prefix-repetition: tokens of each request's suffix")
    w.add_argument("--num-prefixes", type=int, default=4, help="prefix-repetition: distinct shared prefixes")
    w.add_argument("--range-ratio", type=float, default=0.0, help="random dataset: lengths vary by +-this")
    w.add_argument("--max-input-len", type=int, default=None, help="clip prompts to this many tokens")
    w.add_argument("--max-output-len", type=int, default=None, help="clip outputs to this many tokens")
    w.add_argument("--length-scale", type=float, default=1.0, help="mooncake: multiply lengths by this")
    w.add_argument("--trace-start", type=int, default=0, help="first row of a trace dataset")
    w.add_argument("--burstiness", type=float, default=1.0, help="gamma shape of the gaps; 1 = Poisson")
    w.add_argument("--max-concurrency", type=int, default=None, help="most requests in flight")
    w.add_argument("--num-warmups", type=int, default=4,
                   help="unmeasured requests sent first (8 output tokens; own prompts under --prompts fresh)")
    w.add_argument("--seed", type=int, default=0)
    w.add_argument("--prompts", default="fresh", choices=["fresh", "same"],
                   help="fresh (default): each rate and the warm-up get prompts of their own (seed + 1 + rate "
                        "index), so no rate finds an earlier rate's prompts in a prefix cache; same: the "
                        "--seed prompts at every rate")
    o = p.add_argument_group("metrics and output")
    o.add_argument("--goodput", nargs="+", default=None, metavar="NAME:MS",
                   help="SLOs in ms: ttft:MS tpot:MS e2el:MS")
    o.add_argument("--min-attainment", type=float, default=0.9, help="attainment that counts as meeting SLOs")
    o.add_argument("--slo-class", action="append", default=None, metavar="NAME:TTFT_MS:TPOT_MS:SHARE",
                   help="mixed SLO classes (repeatable; shares sum to 1): each request is drawn into one (seeded) "
                        "and sends slo_class NAME, which the server must know (serve --slo-class "
                        "NAME:TTFT_MS:TPOT_MS); attainment and goodput are also reported per class")
    o.add_argument("--save-result", default=None, help="JSON with every per-request record")
    o.add_argument("--plot", default=None, help="PNG: TTFT/TPOT CDFs (+ goodput/attainment vs rate)")
    o.add_argument("--no-progress", action="store_true")


def add_serve_parsers(bench_sub) -> None:
    """Register ``bench serve``, ``bench sweep`` and ``bench compare``."""
    p = bench_sub.add_parser("serve", help="online serving benchmark against one server (TTFT/TPOT/goodput)")
    _add_common(p, two_servers=False)
    p.add_argument("--request-rate", default="inf", help="requests per second (Poisson/gamma); inf = all at once")
    p.add_argument("--trace-time-scale", type=float, default=None,
                   help="replay the trace's own arrival times multiplied by this (instead of --request-rate)")
    p.set_defaults(func=run_serve_cmd)

    s = bench_sub.add_parser("sweep", help="the same workload at increasing request rates: goodput per rate")
    _add_common(s, two_servers=True)
    s.add_argument("--request-rates", default="0.5,1,2,4", help="comma-separated requests per second")
    s.set_defaults(func=run_sweep_cmd)

    c = bench_sub.add_parser("compare", help="the same workload against two servers, with ratios")
    _add_common(c, two_servers=True)
    c.add_argument("--request-rates", default="inf", help="comma-separated requests per second")
    c.add_argument("--interleave", action="store_true",
                   help="run the two servers back to back at each rate (each launched anew for its rate), "
                        "instead of one server's whole sweep and then the other's: on a machine whose speed "
                        "drifts over minutes, each rate's pair is then measured minutes apart, not a sweep apart")
    c.set_defaults(func=run_compare_cmd)


# --------------------------------------------------------------------------------------------- servers
@dataclass
class ServerSpec:
    """A server to benchmark: an URL, or a command that starts one."""

    label: str
    base_url: Optional[str] = None
    launch: Optional[str] = None


class LaunchedServer:
    """A server subprocess started from a command template on a free port; a context manager."""

    def __init__(self, template: str, timeout_s: float, label: str) -> None:
        import socket

        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
        self.command = template.format(port=self.port, python=shlex.quote(sys.executable))
        self.base_url = f"http://127.0.0.1:{self.port}"
        self.timeout_s = timeout_s
        self.log = tempfile.NamedTemporaryFile("w+", prefix=f"goodserve-bench-{label}-", suffix=".log", delete=False)
        self.proc: Optional[subprocess.Popen] = None

    def __enter__(self) -> "LaunchedServer":
        logger.info("launching: %s (log %s)", self.command, self.log.name)
        self.proc = subprocess.Popen(shlex.split(self.command), stdout=self.log, stderr=subprocess.STDOUT,
                                     start_new_session=True)
        try:
            asyncio.run(wait_ready(self.base_url, self.timeout_s, lambda: self.proc.poll() is None))
        except BaseException:
            self.log.flush()
            with open(self.log.name, errors="replace") as f:
                logger.error("server log tail (%s):\n%s", self.command, f.read()[-3000:])
            self.__exit__()
            raise
        return self

    def __exit__(self, *exc: Any) -> None:
        if self.proc is not None and self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(10)
        self.log.close()


# ---------------------------------------------------------------------------------------------- workload
@functools.lru_cache(maxsize=4)
def load_tokenizer(path: Optional[str]) -> Any:
    """A ``transformers`` tokenizer from a GGUF file or HF directory (default: the default model's GGUF)."""
    if path is None:
        from goodserve.models.loader import default_model_path

        path = default_model_path()
    path = os.path.abspath(path)
    if path.endswith(".gguf"):
        from transformers import PreTrainedTokenizerFast

        return PreTrainedTokenizerFast.from_pretrained(os.path.dirname(path), gguf_file=os.path.basename(path))
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(path)


@dataclass
class Workload:
    """The requests (identical for every server and rate) and how they are sent."""

    requests: list[BenchRequest]
    model: Optional[str]
    max_model_len: int
    config: dict[str, Any]


def build_from_server(args: argparse.Namespace, base_url: str, seed: Optional[int] = None) -> Workload:
    """Resolve tokenizer, model name and context length (from ``base_url`` unless given) and build requests.

    ``seed`` (default ``--seed``) draws the synthetic prompts and lengths: a different seed, other prompts.
    """
    seed = args.seed if seed is None else seed
    info = server_info(base_url)
    model = args.model or info.get("id")
    max_model_len = args.max_model_len or info.get("max_model_len") or (info.get("meta") or {}).get("n_ctx_train")
    if not max_model_len:
        max_model_len = 2048
        logger.warning("the server reports no context length; assuming %d (set --max-model-len)", max_model_len)
    tokenizer = load_tokenizer(args.tokenizer)
    remote = server_tokenize(base_url, PROBE_TEXT, model)
    if remote is not None and remote != list(tokenizer.encode(PROBE_TEXT, add_special_tokens=False)):
        logger.warning("the local tokenizer disagrees with the server's /tokenize; pass --tokenizer with the "
                       "server's model, or prompt lengths will not be exact")
    chat = args.endpoint.endswith("chat/completions")
    requests = build_workload(
        args.dataset, args.num_prompts, tokenizer=tokenizer, vocab_size=len(tokenizer),
        # the chat template adds a few dozen tokens around the message
        max_model_len=int(max_model_len) - (64 if chat else 0), dataset_path=args.dataset_path,
        input_len=args.input_len, output_len=args.output_len, range_ratio=args.range_ratio,
        max_input_len=args.max_input_len, max_output_len=args.max_output_len, length_scale=args.length_scale,
        start=args.trace_start, text_prompts=chat, seed=seed, prefix_len=args.prefix_len,
        suffix_len=args.suffix_len, num_prefixes=args.num_prefixes)
    config = {k: getattr(args, k, None) for k in (
        "endpoint", "dataset", "dataset_path", "num_prompts", "input_len", "output_len", "range_ratio",
        "max_input_len", "max_output_len", "length_scale", "trace_start", "burstiness", "max_concurrency",
        "seed", "tokenizer", "prefix_len", "suffix_len", "num_prefixes")}
    classes = parse_slo_class_mix(args.slo_class)
    if classes:
        assigned = assign_slo_classes(len(requests), classes, args.seed)
        requests = [dataclasses.replace(r, slo_class=c.name) for r, c in zip(requests, assigned)]
        config["slo_class_mix"] = [{"name": c.name, "slos": c.slos, "share": c.share} for c in classes]
    config.update(model=model, max_model_len=int(max_model_len), seed=seed,
                  mean_prompt_len=sum(r.prompt_len for r in requests) / len(requests),
                  mean_output_len=sum(r.output_len for r in requests) / len(requests))
    return Workload(requests, model, int(max_model_len), config)


def arrival_times(args: argparse.Namespace, workload: Workload, rate: float) -> list[float]:
    """Arrival offsets for one run: the trace's clock when ``rate`` is NaN, else gamma/Poisson."""
    if math.isnan(rate):
        return A.trace_arrivals([r.arrival for r in workload.requests], args.trace_time_scale)
    return A.gamma_arrivals(len(workload.requests), rate, args.burstiness, args.seed)


def run_one(args: argparse.Namespace, label: str, base_url: str, workload: Workload, rate: float) -> RunResult:
    """Send the workload at ``rate`` to ``base_url`` and summarise."""
    target = Target(base_url, args.endpoint, workload.model)
    slos = parse_slos(args.goodput)
    times = arrival_times(args, workload, rate)
    bar = None
    if not args.no_progress:
        from tqdm import tqdm

        bar = tqdm(total=len(times), desc=f"{label} @ {rate_str(rate)} req/s", unit="req", leave=False)
    records, duration = asyncio.run(run_requests(target, workload.requests, times, args.max_concurrency,
                                                 on_done=(lambda _r: bar.update(1)) if bar else None))
    if bar is not None:
        bar.close()
    summary = summarize(records, duration, slos)
    config = dict(workload.config, base_url=base_url, request_rate=rate_str(rate),
                  trace_time_scale=getattr(args, "trace_time_scale", None))
    classes = parse_slo_class_mix(args.slo_class)
    if classes:
        by_name = {c.name: c for c in classes}
        config["slo_classes"] = class_results(records, [by_name[r.slo_class] for r in workload.requests], duration)
    return RunResult(label, rate, summary, records, config)


def warm_up(args: argparse.Namespace, base_url: str, workload: Workload) -> None:
    """Send the first ``--num-warmups`` requests of ``workload`` at once, outputs cut to 8 tokens, unmeasured.

    Full-size prompts warm the kernels and allocator for the shapes the benchmark will use; with
    ``--prompts fresh`` the warm-up workload has prompts of its own (no measured prompt is cached by it).

    A warm-up the server refuses by admission control (HTTP 429, or shed by the ``slo`` policy) is not a
    failure: the server answered as designed.

    Raises:
        RuntimeError: if a warm-up request fails otherwise (the server is not usable).
    """
    n = min(args.num_warmups, len(workload.requests))
    if n <= 0:
        return
    reqs = [BenchRequest(r.prompt, r.prompt_len, min(r.output_len, 8)) for r in workload.requests[:n]]
    target = Target(base_url, args.endpoint, workload.model)
    records, _ = asyncio.run(run_requests(target, reqs, [0.0] * n))
    bad = [r.error for r in records if not r.success and not r.error.startswith("HTTP 429")
           and "slo_unattainable" not in r.error and "shed:" not in r.error]
    if bad:
        raise RuntimeError(f"warm-up request failed against {base_url}: {bad[0]}")


#: Seed offset of the warm-up prompts under ``--prompts fresh`` (rate ``i`` uses ``--seed + 1 + i``).
WARMUP_SEED_OFFSET = 1_000_003


def run_servers(args: argparse.Namespace, servers: list[ServerSpec], rates: list[float],
                interleave: bool = False) -> list[RunResult]:
    """Every server (one at a time; launched ones are started and stopped around their runs) x every rate.

    By default each server runs its whole sweep in turn; with ``interleave``, each rate runs on every server
    in turn (a launched server is started and stopped around that one rate, and warmed up each time). The
    results are in the same order either way: by server, then by rate.

    ``--prompts fresh`` (default): rate ``i`` sends prompts drawn with seed ``--seed + 1 + i`` and the warm-up
    prompts of their own, so a server with a prefix cache finds none of a rate's prompts cached by an
    earlier rate or by the warm-up; both servers get the same prompts at the same rate. ``--prompts same``
    sends the ``--seed`` prompts at every rate (and warms up on the first of them), as before. Each result's
    ``config`` records ``prompts`` and ``seed``.
    """
    results: list[RunResult] = []
    workloads: dict[int, Workload] = {}
    fresh = getattr(args, "prompts", "fresh") == "fresh"
    logging.getLogger("httpx").setLevel(max(logging.WARNING, logging.getLogger().getEffectiveLevel()))

    def workload_for(key: int, base_url: str) -> Workload:
        if key not in workloads:
            seed = args.seed if not fresh else args.seed + (WARMUP_SEED_OFFSET if key < 0 else 1 + key)
            workloads[key] = build_from_server(args, base_url, seed)
            workloads[key].config["prompts"] = "fresh per rate" if fresh else "same at every rate"
            logger.info("%d requests (seed %d), mean prompt %.0f, mean output %.0f tokens",
                        len(workloads[key].requests), seed, workloads[key].config["mean_prompt_len"],
                        workloads[key].config["mean_output_len"])
        return workloads[key]

    def run_on(spec: ServerSpec, indexed_rates: list[tuple[int, float]]) -> None:
        launched = LaunchedServer(spec.launch, args.launch_timeout, spec.label) if spec.launch else None
        if launched is not None:
            launched.__enter__()
        try:
            base_url = launched.base_url if launched else spec.base_url
            warm_up(args, base_url, workload_for(-1 if fresh else 0, base_url))
            for i, rate in indexed_rates:
                result = run_one(args, spec.label, base_url, workload_for(i if fresh else 0, base_url), rate)
                if launched is not None:
                    result.config["launch"] = launched.command
                results.append(result)
                logger.info("%s @ %s: goodput %.3f req/s, attainment %.1f%%, %d failed", spec.label,
                            rate_str(rate), result.summary.goodput, result.summary.attainment * 100,
                            result.summary.failed)
        finally:
            if launched is not None:
                launched.__exit__()

    if interleave:
        for i, rate in enumerate(rates):
            for spec in servers:
                run_on(spec, [(i, rate)])
        order = {spec.label: k for k, spec in enumerate(servers)}
        results.sort(key=lambda r: order[r.label])  # stable: by server, then by rate
    else:
        for spec in servers:
            run_on(spec, list(enumerate(rates)))
    return results


def _servers(args: argparse.Namespace, need_baseline: bool) -> list[ServerSpec]:
    if bool(args.base_url) == bool(args.launch):
        raise ValueError("give exactly one of --base-url and --launch")
    out = [ServerSpec(args.label or ("target" if getattr(args, "baseline_url", None) or
                                     getattr(args, "baseline_launch", None) else "server"),
                      args.base_url, args.launch)]
    burl, blaunch = getattr(args, "baseline_url", None), getattr(args, "baseline_launch", None)
    if burl and blaunch:
        raise ValueError("give at most one of --baseline-url and --baseline-launch")
    if burl or blaunch:
        out.append(ServerSpec(args.baseline_label, burl, blaunch))
    elif need_baseline:
        raise ValueError("compare needs --baseline-url or --baseline-launch")
    if len({s.label for s in out}) < len(out):
        raise ValueError("the two servers need different labels (--label, --baseline-label)")
    return out


def _rates(text: str) -> list[float]:
    rates = [A.parse_rate(x) for x in text.split(",") if x.strip()]
    if not rates:
        raise ValueError("give at least one request rate")
    return rates


def _finish(args: argparse.Namespace, results: list[RunResult], servers: list[ServerSpec]) -> int:
    if len(results) > 1:
        print(format_sweep(results, args.min_attainment))
    if len(servers) > 1:
        print(format_ratios(results, servers[0].label, servers[1].label))
    if any(r.config.get("slo_classes") for r in results):
        print(format_classes(results))
    if args.save_result:
        save_json(args.save_result, results, {"argv": sys.argv, "servers": [vars(s) for s in servers]})
        print(f"saved {args.save_result}")
    if args.plot:
        cfg = results[0].config
        plot(args.plot, results, f"{cfg['dataset']}: {len(results[0].records)} requests, mean prompt "
                                  f"{cfg['mean_prompt_len']:.0f} / output {cfg['mean_output_len']:.0f} tokens")
        print(f"saved {args.plot}")
    return 0 if all(r.summary.failed == 0 for r in results) else 1


# ------------------------------------------------------------------------------------------- commands
def run_serve_cmd(args: argparse.Namespace) -> int:
    """``bench serve``."""
    parse_slos(args.goodput)  # fail fast on a bad SLO
    parse_slo_class_mix(args.slo_class)
    if args.trace_time_scale is not None:
        if args.dataset not in ("azure-conv", "azure-code", "mooncake", "jsonl"):
            raise ValueError(f"--trace-time-scale needs a dataset with arrival times, not {args.dataset!r}")
        rates = [math.nan]
    else:
        rates = [A.parse_rate(args.request_rate)]
    servers = _servers(args, need_baseline=False)
    results = run_servers(args, servers, rates)
    for r in results:
        print(format_summary(r.summary, f"{r.label} @ {rate_str(r.rate)} req/s"))
    return _finish(args, results, servers)


def run_sweep_cmd(args: argparse.Namespace) -> int:
    """``bench sweep`` (with ``--baseline-url``/``--baseline-launch``: also the baseline, and ratios)."""
    parse_slos(args.goodput)
    parse_slo_class_mix(args.slo_class)
    args.trace_time_scale = None
    servers = _servers(args, need_baseline=False)
    return _finish(args, run_servers(args, servers, _rates(args.request_rates)), servers)


def run_compare_cmd(args: argparse.Namespace) -> int:
    """``bench compare``: two servers, same workload, ratios."""
    parse_slos(args.goodput)
    parse_slo_class_mix(args.slo_class)
    args.trace_time_scale = None
    servers = _servers(args, need_baseline=True)
    results = run_servers(args, servers, _rates(args.request_rates), interleave=args.interleave)
    if len(results) == 2:
        for r in results:
            print(format_summary(r.summary, f"{r.label} @ {rate_str(r.rate)} req/s"))
    return _finish(args, results, servers)
