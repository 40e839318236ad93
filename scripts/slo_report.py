"""Markdown tables of a `goodserve bench compare` result of the slo policy against fcfs (issue 14).

Usage: python scripts/slo_report.py RESULT.json [RESULT.json ...]

For each file: fcfs's knee (its highest rate with >= 90% attainment), then per rate the goodput of both, the
ratio, attainment, requests shed (refused or shed by slo), TTFT p50 and TPOT p50; with SLO classes, the
attainment of each class for both policies. With SLO classes, goodput, attainment and the knee judge each
request by its own class's SLOs (the "all" row of the run's class results), not by the run's --goodput.
"""

from __future__ import annotations

import json
import sys


def _runs(path: str) -> dict:
    runs: dict = {}
    for r in json.load(open(path))["runs"]:
        runs.setdefault(r["label"], {})[r["rate"]] = r
    return runs


def _judged(run: dict) -> dict:
    """The run's summary, with goodput and attainment by each request's own class when it has classes."""
    s = dict(run["summary"])
    classes = run["config"].get("slo_classes")
    if classes:
        s.update(goodput=classes["all"]["goodput"], attainment=classes["all"]["attainment"])
    return s


def report(path: str) -> str:
    runs = _runs(path)
    slo, fcfs = runs["slo"], runs["fcfs"]
    rates = sorted(fcfs)
    ok = [r for r in rates if _judged(fcfs[r])["attainment"] >= 0.9]
    knee = max(ok) if ok else None
    lines = [f"`{path}`: fcfs's knee is {knee} req/s" if knee else f"`{path}`: fcfs has no rate at >= 90%", "",
             "| rate (× knee) | fcfs goodput (attain.) | slo goodput (attain.) | **ratio** | shed | "
             "TTFT p50 fcfs / slo (ms) | TPOT p50 fcfs / slo (ms) |", "|---|---|---|---|---|---|---|"]
    for rate in rates:
        f, s = _judged(fcfs[rate]), _judged(slo[rate])
        ratio = f"×{s['goodput'] / f['goodput']:.2f}" if f["goodput"] > 0 else "– (fcfs 0)"
        x = f" ({rate / knee:.2g}×)" if knee else ""
        lines.append(f"| {rate}{x} | {f['goodput']:.3f} ({f['attainment']:.1%}) | {s['goodput']:.3f} "
                     f"({s['attainment']:.1%}) | **{ratio}** | {s['failed']} | {f['ttft']['median'] * 1e3:.0f} / "
                     f"{s['ttft']['median'] * 1e3:.0f} | {f['tpot']['median'] * 1e3:.1f} / {s['tpot']['median'] * 1e3:.1f} |")
    classes = slo[rates[0]]["config"].get("slo_classes")
    if classes:
        names = [n for n in classes if n != "all"]
        lines += ["", "| rate | " + " | ".join(f"slo {n} | fcfs {n}" for n in names) + " |",
                  "|---|" + "---|---|" * len(names)]
        for rate in rates:
            cs, cf = slo[rate]["config"]["slo_classes"], fcfs[rate]["config"]["slo_classes"]
            lines.append(f"| {rate} | " + " | ".join(f"{cs[n]['attainment']:.1%} | {cf[n]['attainment']:.1%}"
                                                      for n in names) + " |")
    return "\n".join(lines)


if __name__ == "__main__":
    print("\n\n".join(report(p) for p in sys.argv[1:]))
