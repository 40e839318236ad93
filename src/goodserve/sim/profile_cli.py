"""``goodserve profile``: time a grid of steps (or read step traces), fit the cost model, report and save it.

The measuring and fitting are in :mod:`goodserve.sim.profile`; this module is the command around them.
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import time
from pathlib import Path
from typing import Optional, TextIO

from goodserve.engine.args import resolve_dtype
from goodserve.engine.step_trace import read_step_trace
from goodserve.sim.profile import fit_linear, profile


def add_profile_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=None, help="GGUF file or HF model directory (default: the default model)")
    p.add_argument("--dtype", default="auto", choices=["auto", "bfloat16", "float32"],
                   help="the engine's --dtype (auto: bfloat16 where the CPU has a fast path, else float32)")
    p.add_argument("--batch-sizes", default="1,8,32", help="comma-separated decode batch sizes")
    p.add_argument("--contexts", default="64,512,1024", help="comma-separated prompt lengths (tokens)")
    p.add_argument("--decode-steps", type=int, default=8, help="tokens each request decodes")
    p.add_argument("--max-num-batched-tokens", type=int, default=512, help="token budget (prefill chunk size)")
    p.add_argument("--output", default="cpu-local-cost-model.json", help="where to write the fit (JSON)")
    p.add_argument("--from-step-trace", nargs="+", default=None, metavar="FILE",
                   help="fit to the steps of `goodserve serve --step-trace` files instead of timing a grid "
                        "(each step's whole serving-loop cycle, so the fit includes the server's overhead)")


def run_profile(args: argparse.Namespace, out: Optional[TextIO] = None) -> int:
    """Execute ``goodserve profile``: measure, fit, print the fit's error and write the JSON."""
    out = out or sys.stdout
    batches = [int(x) for x in args.batch_sizes.split(",")]
    contexts = [int(x) for x in args.contexts.split(",")]
    t0 = time.perf_counter()
    if args.from_step_trace:
        samples = [(step.shape, step.cycle_s) for path in args.from_step_trace for step in read_step_trace(path)]
        grid = {"step_traces": list(args.from_step_trace)}
    else:
        samples = profile(args.model, args.dtype, batches, contexts, args.decode_steps, args.max_num_batched_tokens)
        grid = {"batch_sizes": batches, "contexts": contexts, "decode_steps": args.decode_steps,
                "max_num_batched_tokens": args.max_num_batched_tokens}
    shapes, seconds = [s for s, _ in samples], [t for _, t in samples]
    fit = fit_linear(shapes, seconds)
    errors = sorted(abs(fit.predict(s) / t - 1) for s, t in samples)
    report = {
        "kind": "linear", "machine": platform.machine(),
        "model": None if args.from_step_trace else args.model or "default",
        "dtype": None if args.from_step_trace else resolve_dtype(args.dtype, "cpu"),
        "coefficients": fit.to_dict(),
        "fit": {"num_steps": len(samples), "median_abs_rel_error": errors[len(errors) // 2],
                "p90_abs_rel_error": errors[int(0.9 * (len(errors) - 1))], "max_abs_rel_error": errors[-1],
                "profile_wall_s": time.perf_counter() - t0},
        "grid": grid,
        "samples": [{"tokens": s.num_tokens, "sampled": s.num_sampled, "attention_pairs": s.attention_pairs,
                     "seconds": t, "predicted": fit.predict(s)} for s, t in samples],
    }
    Path(args.output).parent.mkdir(parents=True, exist_ok=True)
    Path(args.output).write_text(json.dumps(report, indent=1))
    c = report["coefficients"]
    source = "read from step traces" if args.from_step_trace else \
        f"timed in {report['fit']['profile_wall_s']:.0f} s"
    print(f"{len(samples)} steps {source}\n"
          f"step_s = {c['overhead_s'] * 1e3:.3f} ms + {c['per_token_s'] * 1e6:.2f} us/token "
          f"+ {c['per_sampled_s'] * 1e6:.2f} us/sampled token + {c['per_pair_s'] * 1e9:.3f} ns/attention pair\n"
          f"  + with a prompt chunk: {c['prefill_overhead_s'] * 1e3:.3f} ms "
          f"+ {c['prefill_per_sampled_s'] * 1e6:.2f} us/sampled token\n"
          f"relative error: median {report['fit']['median_abs_rel_error']:.1%}, "
          f"p90 {report['fit']['p90_abs_rel_error']:.1%}, max {report['fit']['max_abs_rel_error']:.1%}\n"
          f"wrote {args.output}", file=out)
    return 0
