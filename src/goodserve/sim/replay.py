"""Replay a measured benchmark in the simulator and compare: the fidelity check of a cost model.

``goodserve simulate --replay BENCH.json`` reads a ``goodserve bench serve|sweep`` result, rebuilds each
run's workload from its per-request records (send time, prompt length, the ``max_tokens`` asked for), so
the simulated requests are exactly the measured ones, and prints the simulated latencies beside the
measured ones with their relative error (``simulated / measured - 1``).

Only open-loop runs replay (a run with ``--max-concurrency`` timed each request from a send time the file
does not hold). Failed requests are left out, as the measured latencies leave them out.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Union

from goodserve.sim.spec import SimRequest
from goodserve.workload.report import rate_str

# (summary key, statistic): the figures compared, latencies first; the first four are the fidelity target.
COMPARED = (("ttft", "median"), ("ttft", "p90"), ("tpot", "median"), ("tpot", "p90"), ("itl", "median"),
            ("itl", "p90"), ("e2el", "median"), ("e2el", "p90"))
TARGET = COMPARED[:4]


@dataclass(frozen=True)
class MeasuredRun:
    """One run of a benchmark result file.

    Attributes:
        label: The server's label in the benchmark.
        rate: Its request rate (requests/s; ``inf`` or ``nan`` for all-at-once or the trace's clock).
        requests: Its successful requests, as the simulator's workload.
        summary: The measured summary, as saved (latencies in seconds).
        num_failed: Requests of the run that failed (not replayed).
    """

    label: str
    rate: float
    requests: list[SimRequest]
    summary: dict
    num_failed: int = 0


def load_bench_runs(path: Union[str, Path]) -> list[MeasuredRun]:
    """Read the runs of a ``goodserve bench`` JSON result.

    Raises:
        ValueError: if the file is unreadable or not a benchmark result, a run has no successful request, or
            a run was closed-loop (``--max-concurrency``).
    """
    try:
        data = json.loads(Path(path).read_text())
        runs = []
        for run in data["runs"]:
            if run.get("config", {}).get("max_concurrency"):
                raise ValueError(f"run {run['label']!r} was closed-loop (max_concurrency "
                                 f"{run['config']['max_concurrency']}); only open-loop runs replay")
            for metric, stat in COMPARED:
                float(run["summary"][metric][stat])
            ok = [r for r in run["requests"] if r["success"]]
            requests = [SimRequest(f"req-{i}", float(r["arrival"]), int(r["prompt_tokens"]), n, n)
                        for i, r in enumerate(ok) for n in [int(r.get("expected_output_tokens") or r["output_tokens"])]]
            if not requests:
                raise ValueError(f"run {run['label']!r} has no successful request")
            runs.append(MeasuredRun(str(run["label"]), float(run["rate"]), requests, run["summary"],
                                    len(run["requests"]) - len(ok)))
    except (OSError, json.JSONDecodeError, KeyError, TypeError, ValueError) as exc:
        raise ValueError(f"{path} is not a replayable `goodserve bench` result: {exc}") from None
    if not runs:
        raise ValueError(f"{path} holds no runs")
    return runs


def relative_error(simulated: float, measured: float) -> float:
    """``simulated / measured - 1`` (``nan`` when either is missing or ``measured`` is 0)."""
    if math.isnan(simulated) or math.isnan(measured) or measured == 0:
        return math.nan
    return simulated / measured - 1


def compare(measured: dict, simulated: dict) -> list[tuple[str, float, float, float]]:
    """``(name, measured_s, simulated_s, relative_error)`` for every figure in :data:`COMPARED`."""
    rows = []
    for metric, stat in COMPARED:
        m, s = float(measured[metric][stat]), float(simulated[metric][stat])
        rows.append((f"{stat if stat != 'median' else 'p50'} {metric.upper()}", m, s, relative_error(s, m)))
    return rows


def format_comparison(label: str, rate: float, rows: list[tuple[str, float, float, float]]) -> str:
    """A table of :func:`compare` rows (milliseconds) and the largest error on the fidelity target."""
    lines = [f"{label} @ {rate_str(rate)} req/s: simulated vs measured",
             f"{'':<10}{'measured ms':>13}{'simulated ms':>14}{'error':>9}"]
    for name, m, s, err in rows:
        lines.append(f"{name:<10}{m * 1e3:>13,.1f}{s * 1e3:>14,.1f}{err:>+9.1%}")
    worst = max((abs(err) for _, _, _, err in rows[:len(TARGET)] if not math.isnan(err)), default=math.nan)
    lines.append(f"largest |error| on p50/p90 TTFT and TPOT: {worst:.1%}")
    return "\n".join(lines)
