"""``goodserve bench {offline, micro, serve, sweep, compare}``."""

from __future__ import annotations

from goodserve.bench.micro import add_micro_parser
from goodserve.bench.offline import add_offline_parser
from goodserve.bench.prefix import add_prefix_parser
from goodserve.bench.serve import add_serve_parsers


def add_bench_parser(sub) -> None:
    """Register ``bench`` and its subcommands on the top-level subparsers object."""
    p = sub.add_parser("bench", help="benchmarks: offline throughput, micro (step time vs hardware limits), "
                                     "online serving (serve, sweep, compare: TTFT/TPOT/goodput)")
    bench_sub = p.add_subparsers(dest="bench_command", required=True)
    add_offline_parser(bench_sub)
    add_micro_parser(bench_sub)
    add_prefix_parser(bench_sub)
    add_serve_parsers(bench_sub)
