"""Tabulate a `scripts/compare_llama_cpp.sh` report: per GGUF file, llama.cpp's figures beside goodserve's
(`bench micro --quantization auto` JSONs written next to the report) and the ratios, and the interleaved
batch-1 rounds with their median ratio.

Usage: python scripts/compare_llama_cpp_summary.py OUT_DIR/report.txt
"""

from __future__ import annotations

import json
import re
import statistics
import sys
from pathlib import Path


def _tps(cell: str) -> float:
    """``"104.12 ± 0.50"`` -> 104.12."""
    return float(cell.split("±")[0])


def parse(report: str) -> dict[str, dict]:
    """Per model name: llama-bench's pp512/tg128 t/s, llama-batched-bench's S_TG t/s per batch, and the
    rounds' tg128 t/s in order."""
    models: dict[str, dict] = {}
    cur = None
    in_rounds = False
    for line in report.splitlines():
        m = re.match(r"== model: (.+)$", line)
        if m:
            cur = models.setdefault(Path(m.group(1)).stem, {"batched": {}, "rounds": []})
            in_rounds = False
            continue
        in_rounds = in_rounds or line.startswith("== round")
        if cur is None or not line.startswith("|"):
            continue
        cells = [c.strip() for c in line.strip("|").split("|")]
        if "pp512" in cells:
            cur["pp512"] = _tps(cells[-1])
        elif "tg128" in cells:
            if in_rounds:
                cur["rounds"].append(_tps(cells[-1]))
            else:
                cur["tg128"] = _tps(cells[-1])
        elif len(cells) == 10 and cells[0].isdigit():  # PP | TG | B | N_KV | T_PP | S_PP | T_TG | S_TG | T | S
            cur["batched"][int(cells[2])] = float(cells[7])
    return models


def main(path: str) -> None:
    out = Path(path).parent
    report = Path(path).read_text()
    for name, m in parse(report).items():
        micro_path = out / f"micro_{name}_auto.json"
        if not micro_path.exists():
            continue
        micro = json.loads(micro_path.read_text())
        print(f"\n{name}")
        print(f"{'shape':<34}{'llama.cpp':>12}{'goodserve':>12}{'ratio':>9}")
        for d in micro["decode"]:
            b = d["batch"]
            ref = m["batched"].get(b)
            if ref:
                print(f"{'decode batch %d, tok/s (128->256)' % b:<34}{ref:>12.1f}{d['mean_tok_s']:>12.1f}"
                      f"{d['mean_tok_s'] / ref:>8.2f}x")
        if "pp512" in m:
            got = micro["prefill"]["tok_s"]
            print(f"{'prefill 512, tok/s':<34}{m['pp512']:>12.1f}{got:>12.1f}{got / m['pp512']:>8.2f}x")
        ratios = []
        for r, tg in enumerate(m["rounds"], 1):
            rp = out / f"round_{name}_{r}.json"
            if not rp.exists():
                continue
            step = json.loads(rp.read_text())["decode"][0]["mean_step_ms"]
            ratios.append(step / (1e3 / tg))
            print(f"round {r}: llama.cpp tg128 {1e3 / tg:.2f} ms/token, goodserve batch 1 {step:.2f} ms/step, "
                  f"time ratio {ratios[-1]:.2f}x")
        if ratios:
            print(f"batch 1, median time ratio over {len(ratios)} rounds: {statistics.median(ratios):.2f}x "
                  f"(goodserve / llama.cpp; below 1 is faster)")


if __name__ == "__main__":
    main(sys.argv[1])
