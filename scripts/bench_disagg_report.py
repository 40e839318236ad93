"""The table of scripts/bench_disagg.sh: per configuration and rate, TTFT/TPOT p50/p99, ITL p99 and goodput at
two SLO pairs, recomputed from the saved per-request records with the benchmark's own summary code.

Usage: python scripts/bench_disagg_report.py OUT_DIR [--slo TTFT_MS:TPOT_MS ...]
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from goodserve.workload.metrics import RequestRecord, summarize


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("out_dir")
    p.add_argument("--slo", action="append", default=None, help="TTFT_MS:TPOT_MS (repeatable)")
    args = p.parse_args()
    slos = [tuple(float(x) / 1000 for x in s.split(":")) for s in (args.slo or ["2000:100", "5000:200"])]
    head = ["config", "rate", "TTFT p50", "TTFT p99", "TPOT p50", "TPOT p99", "ITL p99"]
    head += [f"goodput @{t * 1000:g}/{o * 1000:g} ms" for t, o in slos]
    print("| " + " | ".join(head) + " |")
    print("|" + "---|" * len(head))
    for name in ("pd", "colocated", "replicas"):
        path = Path(args.out_dir) / f"{name}.json"
        if not path.exists():
            continue
        for run in json.loads(path.read_text())["runs"]:
            records = [RequestRecord(**{k: v for k, v in r.items() if k != "tpot"}) for r in run["requests"]]
            duration = run["summary"]["duration"]
            base = summarize(records, duration)
            row = [name, f"{run['rate']:g}"]
            row += [f"{base.ttft.median * 1000:.0f}", f"{base.ttft.p99 * 1000:.0f}",
                    f"{base.tpot.median * 1000:.1f}", f"{base.tpot.p99 * 1000:.1f}",
                    f"{base.itl.p99 * 1000:.1f}"]
            for t, o in slos:
                s = summarize(records, duration, {"ttft": t, "tpot": o})
                row.append(f"{s.goodput:.2f} ({s.attainment * 100:.0f}%)")
            print("| " + " | ".join(row) + " |")


if __name__ == "__main__":
    main()
