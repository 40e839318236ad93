"""A run's output, measured or simulated: the summary table, the JSON result and the PNG plots.

Shared by ``goodserve bench`` and ``goodserve simulate``, so a simulated run reads like a measured one.
matplotlib (Agg) is imported only by :func:`plot`.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from typing import Any, Optional, Sequence

from goodserve.workload.metrics import RequestRecord, Summary


@dataclass
class RunResult:
    """One benchmark run: a workload at one rate against one server.

    Attributes:
        label: Which server / configuration (e.g. ``"chunked"``).
        rate: Request rate in requests per second (``inf``: all at once; ``nan``: the trace's own clock).
        summary: The aggregate metrics.
        records: Every request's record, failed ones included.
        config: What was run (dataset, lengths, SLOs, URL...), for the JSON result.
    """

    label: str
    rate: float
    summary: Summary
    records: list[RequestRecord]
    config: dict[str, Any] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return {"label": self.label, "rate": _num(self.rate), "config": self.config,
                "summary": _clean(self.summary.to_dict()), "requests": [_clean(r.to_dict()) for r in self.records]}


def _num(x: float) -> Any:
    if isinstance(x, float) and (math.isnan(x) or math.isinf(x)):
        return str(x)
    return x


def _clean(obj: Any) -> Any:
    """Replace NaN / inf (not valid JSON) with strings, recursively."""
    if isinstance(obj, dict):
        return {k: _clean(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_clean(v) for v in obj]
    return _num(obj)


def rate_str(rate: float) -> str:
    """``inf`` / ``trace`` / ``2`` / ``0.5``."""
    if math.isnan(rate):
        return "trace"
    if math.isinf(rate):
        return "inf"
    return f"{rate:g}"


def _ms(x: float) -> str:
    return "-" if math.isnan(x) else f"{x * 1000:,.1f}"


def format_summary(s: Summary, title: str = "") -> str:
    """A human-readable table of one run (latencies in ms)."""
    w = 44
    lines = [f"{(' ' + title + ' ') if title else ''}".center(w + 14, "=")]

    def row(name: str, value: str) -> None:
        lines.append(f"{name:<{w}}{value:>14}")

    row("Requests (completed / sent)", f"{s.completed} / {s.num_requests}")
    row("Failed requests", str(s.failed))
    row("Benchmark duration (s)", f"{s.duration:.2f}")
    row("Total input tokens", str(s.total_input_tokens))
    row("Total output tokens", str(s.total_output_tokens))
    row("Request throughput (req/s)", f"{s.request_throughput:.3f}")
    row("Output token throughput (tok/s)", f"{s.output_throughput:.1f}")
    row("Total token throughput (tok/s)", f"{s.total_token_throughput:.1f}")
    if s.slos:
        slo_text = ", ".join(f"{k.upper()} <= {v * 1000:g} ms" for k, v in s.slos.items())
        lines.append(f"SLOs: {slo_text}")
    row("SLO attainment (%)", f"{s.attainment * 100:.1f}")
    row("Goodput (req/s)", f"{s.goodput:.3f}")
    for name, st in (("TTFT", s.ttft), ("TPOT", s.tpot), ("ITL", s.itl), ("E2E latency", s.e2el)):
        lines.append(f"{'-' * 4} {name} (ms) ".ljust(w + 14, "-"))
        row(f"Mean {name}", _ms(st.mean))
        row(f"Median {name}", _ms(st.median))
        row(f"P90 {name}", _ms(st.p90))
        row(f"P99 {name}", _ms(st.p99))
    if s.errors:
        lines.append("First errors:")
        lines.extend(f"  - {e}" for e in s.errors)
    lines.append("=" * (w + 14))
    return "\n".join(lines)


def format_sweep(results: Sequence[RunResult], min_attainment: float = 0.9) -> str:
    """One line per (label, rate): throughput, goodput, attainment and latency medians/p99s."""
    head = (f"{'server':<12}{'rate':>7}{'ok/sent':>10}{'req/s':>8}{'out tok/s':>11}{'goodput':>9}{'attain%':>9}"
            f"{'TTFT p50':>10}{'TTFT p99':>10}{'TPOT p50':>10}{'TPOT p99':>10}")
    lines = [head, "-" * len(head)]
    for r in results:
        s = r.summary
        lines.append(f"{r.label:<12}{rate_str(r.rate):>7}{f'{s.completed}/{s.num_requests}':>10}"
                     f"{s.request_throughput:>8.2f}{s.output_throughput:>11.1f}{s.goodput:>9.3f}"
                     f"{s.attainment * 100:>9.1f}{_ms(s.ttft.median):>10}{_ms(s.ttft.p99):>10}"
                     f"{_ms(s.tpot.median):>10}{_ms(s.tpot.p99):>10}")
    lines.append("(latencies in ms; goodput in requests/s meeting every SLO)")
    prompts = {r.config.get("prompts") for r in results} - {None}
    if prompts:
        lines.append(f"prompts: {', '.join(sorted(prompts))}")
    for label in dict.fromkeys(r.label for r in results):
        best = max_rate_meeting(results, label, min_attainment)
        lines.append(f"{label}: highest rate with attainment >= {min_attainment:.0%}: "
                     f"{rate_str(best) if best is not None else 'none'}")
    return "\n".join(lines)


def max_rate_meeting(results: Sequence[RunResult], label: str, min_attainment: float = 0.9) -> Optional[float]:
    """The highest finite rate of ``label``'s runs whose attainment is at least ``min_attainment``."""
    rates = [r.rate for r in results if r.label == label and not math.isnan(r.rate) and not math.isinf(r.rate)
             and r.summary.attainment >= min_attainment]
    return max(rates) if rates else None


def format_ratios(results: Sequence[RunResult], label: str, baseline: str) -> str:
    """Per rate: ``label`` / ``baseline`` for goodput, throughput and latency medians."""
    by = {(r.label, r.rate): r.summary for r in results}
    rates = [r.rate for r in results if r.label == label]
    lines = [f"{label} / {baseline} ratios (higher is better for goodput and throughput, lower for latency)",
             f"{'rate':>7}{'goodput':>12}{'attain (pts)':>14}{'out tok/s':>11}{'TTFT p50':>10}{'TPOT p50':>10}"]
    for rate in rates:
        a, b = by.get((label, rate)), by.get((baseline, rate))
        if a is None or b is None:
            continue
        lines.append(f"{rate_str(rate):>7}{_ratio(a.goodput, b.goodput):>12}"
                     f"{(a.attainment - b.attainment) * 100:>+14.1f}{_ratio(a.output_throughput, b.output_throughput):>11}"
                     f"{_ratio(a.ttft.median, b.ttft.median):>10}{_ratio(a.tpot.median, b.tpot.median):>10}")
    ga, gb = max_rate_meeting(results, label), max_rate_meeting(results, baseline)
    lines.append(f"highest rate at >= 90% attainment: {label} {rate_str(ga) if ga else 'none'}, "
                 f"{baseline} {rate_str(gb) if gb else 'none'}"
                 + (f" (x{ga / gb:.2f})" if ga and gb else ""))
    return "\n".join(lines)


def _ratio(a: float, b: float) -> str:
    if math.isnan(a) or math.isnan(b):
        return "-"
    if b == 0:
        return "inf" if a > 0 else "-"
    return f"x{a / b:.2f}"


def save_json(path: str, results: Sequence[RunResult], meta: Optional[dict[str, Any]] = None) -> None:
    """Write every run (config, summary, per-request records) as one JSON document."""
    with open(path, "w") as f:
        json.dump({"meta": _clean(meta or {}), "runs": [r.to_dict() for r in results]}, f, indent=1)


def plot(path: str, results: Sequence[RunResult], title: str = "") -> None:
    """TTFT and TPOT CDFs of every run; with several finite rates also goodput and attainment vs rate.

    SLO limits are drawn as dashed vertical lines on the CDFs.
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    swept = len({r.rate for r in results if not math.isnan(r.rate) and not math.isinf(r.rate)}) > 1
    ncols = 4 if swept else 2
    fig, axes = plt.subplots(1, ncols, figsize=(4.6 * ncols, 4.0))
    slos = results[0].summary.slos if results else {}
    for ax, metric, name in ((axes[0], "ttft", "TTFT"), (axes[1], "tpot", "TPOT")):
        for r in results:
            vals = sorted(v * 1000 for v in (getattr(x, metric) for x in r.records if x.success) if v is not None)
            if vals:
                ys = [(i + 1) / len(r.records) for i in range(len(vals))]
                ax.step(vals, ys, where="post", label=f"{r.label} @ {rate_str(r.rate)}")
        if metric in slos:
            ax.axvline(slos[metric] * 1000, color="k", ls="--", lw=1, label="SLO")
        ax.set_xscale("log")
        ax.set_xlabel(f"{name} (ms, log)")
        ax.set_ylabel("fraction of requests")
        ax.set_title(f"{name} CDF")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=6)
    if swept:
        for label in dict.fromkeys(r.label for r in results):
            runs = sorted((r for r in results if r.label == label and not math.isinf(r.rate)
                           and not math.isnan(r.rate)), key=lambda r: r.rate)
            xs = [r.rate for r in runs]
            axes[2].plot(xs, [r.summary.goodput for r in runs], "o-", label=label)
            axes[3].plot(xs, [r.summary.attainment * 100 for r in runs], "o-", label=label)
        axes[2].set_title("goodput vs request rate")
        axes[2].set_ylabel("goodput (req/s meeting all SLOs)")
        axes[3].set_title("SLO attainment vs request rate")
        axes[3].set_ylabel("attainment (%)")
        axes[3].axhline(90, color="k", ls="--", lw=1)
        for ax in axes[2:]:
            ax.set_xlabel("request rate (req/s)")
            ax.grid(alpha=0.3)
            ax.legend(fontsize=7)
    if title:
        fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def class_results(records: Sequence[RequestRecord], classes: Sequence[Any], duration: float) -> dict[str, dict]:
    """Attainment and goodput per SLO class, each request judged by its own class's SLOs.

    Args:
        records: The run's records, in request order.
        classes: Each request's :class:`~goodserve.workload.slo.SLOClass`, in the same order.
        duration: The run's duration in seconds.

    Returns:
        ``{name: {"requests", "attainment", "goodput"}}`` plus ``"all"`` (every request by its own class).
    """
    from goodserve.workload.metrics import summarize

    out: dict[str, dict] = {}
    good = 0.0
    for cls in {c.name: c for c in classes}.values():
        mine = [r for r, c in zip(records, classes) if c.name == cls.name]
        s = summarize(mine, duration, cls.slos)
        out[cls.name] = {"requests": len(mine), "attainment": s.attainment, "goodput": s.goodput}
        good += s.goodput * duration
    out["all"] = {"requests": len(records), "attainment": good / len(records) if records else 0.0,
                  "goodput": good / duration}
    return out


def format_classes(results: Sequence[RunResult]) -> str:
    """One line per run and SLO class: attainment and goodput (runs without classes are skipped)."""
    lines = []
    for r in results:
        for name, c in (r.config.get("slo_classes") or {}).items():
            lines.append(f"{r.label:<12} {rate_str(r.rate):>6} {name:<12} {c['requests']:>5} "
                         f"{c['attainment'] * 100:>7.1f} {c['goodput']:>8.3f}")
    if not lines:
        return ""
    head = f"{'server':<12} {'rate':>6} {'SLO class':<12} {'reqs':>5} {'attain%':>7} {'goodput':>8}"
    return "\n".join([head, "-" * len(head), *lines])
