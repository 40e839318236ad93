#!/usr/bin/env python
"""Steps of decode rows verifying drafts: the one-call decode step against the layer-by-layer path.

The default model (its GGUF as a server loads it: batch-invariant where the CPU grants AMX, else the file's blocks
with their dense copies made), its runner's KV caches and attention backend. Each shape is ``B`` requests of ``C``
tokens of context, each verifying ``k`` drafts (``B (k + 1)`` rows; ``k = 0``: plain decodes), beside a prompt
chunk of ``P`` tokens after ``P0`` cached ones (``P = 0``: none), timed as the median of ``--repeats`` runs after one
warm-up, both ways on the same metadata one after the other. The caches hold whatever they hold: the time of a step
does not depend on the values.

Usage: flock /tmp/goodserve-bench.lock scripts/bench_one_call_rows.py [--no-batch-invariant] [--out result.json]
"""

from __future__ import annotations

import argparse
import json
import time

import torch

from goodserve.engine.args import batch_invariant_is_cheap
from goodserve.llm import LLM
from goodserve.models.attention import AttentionMetadata
from goodserve.models.loader import default_model_path
from goodserve.models.quant import make_dense_copies

SHAPES = [(1, 8, 1000, 0, 0), (8, 4, 1000, 0, 0), (20, 4, 1000, 0, 0), (40, 0, 1000, 0, 0), (40, 4, 1000, 0, 0),
          (60, 4, 1000, 0, 0), (100, 4, 1000, 0, 0), (128, 3, 500, 0, 0), (128, 7, 200, 0, 0), (256, 0, 500, 0, 0),
          (0, 0, 0, 1024, 0), (0, 0, 0, 512, 512), (40, 0, 1000, 600, 0), (40, 4, 1000, 400, 300)]  # (B, k, C, P, P0)


def step(block_size: int, per_row: bool, b: int, k: int, c: int, p: int, p0: int):
    """``(input_ids, positions, metadata)`` of ``b`` requests of ``c`` tokens each verifying ``k`` drafts, then a
    prompt chunk of ``p`` tokens after ``p0``."""
    per = -(-(c + k + 1) // block_size)
    tables = [list(range(i * per, (i + 1) * per)) for i in range(b)]
    rows = [(i, c + j) for i in range(b) for j in range(k + 1)]
    chunks = [] if k == 0 else [(c, k + 1, t) for t in tables]
    if p:
        tables.append(list(range(b * per, b * per + -(-(p0 + p) // block_size))))
        chunks.append((p0, p, tables[-1]))
        rows += [(b, p0 + j) for j in range(p)]
    slots = torch.tensor([tables[i][q // block_size] * block_size + q % block_size for i, q in rows])
    decodes = (tables[:b], [c + 1] * b) if k == 0 else ([], [])
    meta = AttentionMetadata.build(block_size, *decodes, chunks, slots, torch.device("cpu"), decode_groups=False,
                                   per_row=per_row)
    return torch.randint(0, 1000, (len(rows),)), torch.tensor([q for _, q in rows]), meta


def median_ms(fn, repeats: int) -> float:
    fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return sorted(times)[len(times) // 2] * 1e3


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batch-invariant", action=argparse.BooleanOptionalAction, default=None,
                    help="default: as a server decides (on where AMX is granted)")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--out", help="write the results as JSON here")
    ap.add_argument("--shapes", help="B:k:C:P:P0 shapes, comma-separated (default: the built-in list)")
    args = ap.parse_args()
    try:
        shapes = SHAPES if not args.shapes else [tuple(int(v) for v in s.split(":")) for s in args.shapes.split(",")]
    except ValueError:
        ap.error(f"--shapes: expected B:k:C:P:P0 integers, comma-separated, got {args.shapes!r}")
    if any(len(s) != 5 or min(s) < 0 for s in shapes):
        ap.error(f"--shapes: expected five non-negative integers B:k:C:P:P0 each, got {args.shapes!r}")
    blocks = max(-(-(c + k + 1) // 16) * b + -(-(p + p0) // 16) for b, k, c, p, p0 in shapes)
    invariant = args.batch_invariant
    if invariant is None:
        invariant = batch_invariant_is_cheap("cpu", "bfloat16", "auto")
    llm = LLM(default_model_path(), batch_invariant=invariant, log_stats_interval=0, num_blocks=blocks,
              block_size=16)
    runner = llm.engine.core.runner
    model, attn, kv = runner.model, runner.attn, runner.kv_caches
    make_dense_copies(model)  # as a server does before its first step
    per_row = getattr(attn, "uses_row_tables", False)
    results = []
    with torch.inference_mode():
        for b, k, c, p, p0 in shapes:
            ids, positions, meta = step(16, per_row, b, k, c, p, p0)
            one = None
            if model.can_decode_in_one_call(len(ids), meta, attn):
                one = median_ms(lambda: model.decode_in_one_call(ids, positions, kv, meta, attn), args.repeats)
            layers = median_ms(lambda: model(ids, positions, kv, meta, attn), args.repeats)
            results.append(dict(requests=b, drafts=k, context=c, prompt_chunk=p, chunk_context=p0, rows=len(ids),
                                one_call_ms=one, layers_ms=layers))
            ratio = f"x{one / layers:.2f}" if one else "-"
            print(f"B={b:4d} k={k} C={c:5d} P={p:5d} P0={p0:4d} rows={len(ids):5d}  "
                  f"one call {one or float('nan'):8.1f} ms  layer by layer {layers:8.1f} ms  {ratio}", flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(dict(batch_invariant=model.batch_invariant, results=results), f, indent=1)


if __name__ == "__main__":
    main()
