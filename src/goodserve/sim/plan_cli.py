"""``goodserve plan``: how many requests a model serves on a GPU, and how fast it decodes them.

Register with :func:`add_plan_parser` on the top-level CLI's subparsers; the parsed namespace goes to
:func:`run_plan`.
"""

from __future__ import annotations

import argparse
import logging
import sys
from typing import Any, Optional, TextIO

from goodserve.kv_cache.spec import KV_DTYPE_BYTES
from goodserve.sim.hardware import GIB, HARDWARE, get_hardware
from goodserve.sim.model_size import DTYPE_BYTES, parse_dtype
from goodserve.sim.planner import PlanReport, make_plan
from goodserve.sim.presets import PRESETS, load_arch

logger = logging.getLogger(__name__)


def add_plan_parser(subparsers: Any) -> argparse.ArgumentParser:
    """Add the ``plan`` subcommand to ``subparsers`` (from ``ArgumentParser.add_subparsers``).

    Returns:
        The new sub-parser; its ``func`` default is :func:`run_plan`.
    """
    presets = ", ".join(spec.name for spec in PRESETS.values())
    p = subparsers.add_parser(
        "plan", help="KV-cache capacity and decode roofline for a model on a GPU",
        description="Print weights and KV memory, KV pool size, max concurrency and a decode roofline.",
    )
    p.add_argument("--model", required=True, help=f"preset ({presets}), a config.json, or a HF model directory")
    p.add_argument("--hardware", default="h100", choices=list(HARDWARE), help="accelerator (default: h100)")
    p.add_argument("--dtype", default="bfloat16", type=parse_dtype, choices=list(DTYPE_BYTES),
                   help="weights and KV dtype (default: bfloat16; bf16, fp8, fp32 also accepted)")
    add_kv_cache_dtype_argument(p)
    p.add_argument("--tp", type=int, default=1, help="tensor-parallel degree (default: 1)")
    p.add_argument("--context", type=int, default=4096, help="tokens per request, prompt + output (default: 4096)")
    p.add_argument("--gpu-memory-utilization", type=float, default=0.9,
                   help="share of GPU memory to use (default: 0.9)")
    p.add_argument("--tpot-budget-ms", type=float, default=50.0,
                   help="time-per-output-token budget in ms (default: 50)")
    p.add_argument("--activation-reserve-gib", type=float, default=1.0,
                   help="memory kept from the KV pool for activations, GiB per GPU (default: 1)")
    p.add_argument("--block-size", type=int, default=16, help="tokens per KV block (default: 16)")
    p.add_argument("--plot-dir", default=None, help="write PNG plots here (needs matplotlib)")
    p.set_defaults(func=run_plan)
    return p


def add_kv_cache_dtype_argument(p: argparse.ArgumentParser) -> None:
    """Add ``--kv-cache-dtype`` (shared by ``plan`` and ``simulate``): the dtype of every cached element, a key
    of :data:`~goodserve.kv_cache.spec.KV_DTYPE_BYTES`; ``None`` (the default) means ``--dtype``."""
    p.add_argument("--kv-cache-dtype", default=None, type=parse_dtype, choices=list(KV_DTYPE_BYTES),
                   help="dtype of the cached K/V elements; int8 rows carry a float32 scale per token and head "
                        "(default: --dtype)")


def _gib(n: float) -> str:
    return f"{n / GIB:,.2f} GiB"


def _table(header: list[str], rows: list[list[str]]) -> str:
    widths = [max(len(r[i]) for r in [header, *rows]) for i in range(len(header))]
    line = lambda cells: "  ".join(c.rjust(w) for c, w in zip(cells, widths))  # noqa: E731
    return "\n".join([line(header), line(["-" * w for w in widths]), *map(line, rows)])


def format_report(r: PlanReport) -> str:
    """The plan as readable text: model and memory summary, then the decode roofline table."""
    a, m, hw = r.arch, r.memory, r.hw
    params = f"{r.params.total:,} ({r.params.total / 1e9:.2f} B)"
    if r.params.active != r.params.total:
        params += f"; active per token {r.params.active:,} ({r.params.active / 1e9:.2f} B, MoE)"
    summary = [
        ("model", f"{a.name}  (L={a.num_hidden_layers}, H={a.hidden_size}, heads={a.num_attention_heads}, "
                  f"kv_heads={a.num_key_value_heads}, head_dim={a.head_dim})"),
        ("hardware", f"{hw.description or hw.name}  x{r.tp} (TP), {r.dtype}, KV cache {r.kv_cache_dtype}"),
        ("parameters", params),
        ("weights", f"{_gib(m.weights * r.tp)} total, {_gib(m.weights)} per GPU"),
        ("KV bytes / token", f"{m.kv_bytes_per_token:,} per GPU  [{m.kv_spec.describe()}]"),
        ("GPU memory", f"{_gib(m.capacity)} x {m.usable / m.capacity:.2f} = {_gib(m.usable)} usable"),
        ("activation reserve", _gib(m.activation_reserve)),
        ("KV pool", f"{_gib(m.pool_bytes)} = {m.num_blocks:,} blocks x {m.block_size} = {m.pool_tokens:,} tokens"
                    + (" of every layer" if len(m.kv_spec.groups) > 1 else "")),
        ("KV / request", f"{m.kv_bytes_per_request:,} B ({_gib(m.kv_bytes_per_request)}) at context {m.context:,}"
                         + (", windows applied" if any(g.window for g in m.kv_spec.groups) else "")),
        ("max concurrency", f"{m.max_concurrency:,} requests of {m.context:,} tokens"),
    ]
    width = max(len(k) for k, _ in summary)
    out = [f"{k.ljust(width)}  {v}" for k, v in summary]
    if m.max_concurrency == 0:
        out.append(f"WARNING: not one {m.context}-token request fits the KV pool; lower --context or raise --tp")
    if m.context > a.max_position_embeddings:
        out.append(f"WARNING: context {m.context} exceeds the model's {a.max_position_embeddings} positions")
    out += ["", f"decode roofline (every request at context {m.context:,}; peak "
                f"{hw.peak_flops(r.dtype) / 1e12:,.0f} TFLOP/s, {hw.mem_bandwidth / 1e12:,.2f} TB/s, "
                f"+{hw.step_overhead_s * 1e3:.2f} ms/step)"]
    rows = [[f"{p.batch}", f"{p.flops / 1e12:.3f}", f"{p.bytes / 1e9:.2f}", f"{p.arithmetic_intensity:.1f}",
             f"{p.compute_s * 1e3:.3f}", f"{p.memory_s * 1e3:.3f}", f"{p.step_s * 1e3:.3f}", p.bound,
             f"{p.tokens_per_s:,.0f}", f"{p.tpot_s * 1e3:.2f}"] for p in r.roofline]
    out.append(_table(["batch", "TFLOP", "GB read", "FLOP/B", "compute ms", "memory ms", "step ms", "bound",
                       "tok/s", "TPOT ms"], rows))
    budget = r.tpot_budget_s * 1e3
    if r.max_batch_within_tpot:
        capped = " (capped by the KV pool's concurrency, not by TPOT)" if r.max_batch_within_tpot == m.max_concurrency else ""
        out.append(f"\nlargest batch within TPOT {budget:g} ms: {r.max_batch_within_tpot}{capped}")
    else:
        out.append(f"\nno batch meets TPOT {budget:g} ms (batch 1 takes {r.roofline[0].step_s * 1e3:.2f} ms)")
    return "\n".join(out)


def run_plan(args: argparse.Namespace, out: Optional[TextIO] = None) -> int:
    """Execute ``goodserve plan`` from parsed arguments.

    Returns:
        0 on success, 2 on bad input (the reason goes to stderr).
    """
    out = out or sys.stdout
    try:
        arch = load_arch(args.model)
        report = make_plan(
            arch, get_hardware(args.hardware), dtype=args.dtype, tp=args.tp, context=args.context,
            gpu_memory_utilization=args.gpu_memory_utilization, tpot_budget_s=args.tpot_budget_ms / 1e3,
            activation_reserve_bytes=int(args.activation_reserve_gib * GIB), block_size=args.block_size,
            kv_cache_dtype=args.kv_cache_dtype,
        )
    except ValueError as exc:
        print(f"goodserve plan: error: {exc}", file=sys.stderr)
        return 2
    print(format_report(report), file=out)
    if args.plot_dir:
        from goodserve.sim.plots import write_plan_plots

        for path in write_plan_plots(report, args.plot_dir):
            print(f"wrote {path}", file=out)
    return 0
