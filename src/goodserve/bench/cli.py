"""``goodserve bench {offline, micro}``."""

from __future__ import annotations

from goodserve.bench.micro import add_micro_parser
from goodserve.bench.offline import add_offline_parser


def add_bench_parser(sub) -> None:
    """Register ``bench`` and its subcommands on the top-level subparsers object."""
    p = sub.add_parser("bench", help="benchmarks: offline throughput, micro (step time vs hardware limits)")
    bench_sub = p.add_subparsers(dest="bench_command", required=True)
    add_offline_parser(bench_sub)
    add_micro_parser(bench_sub)
