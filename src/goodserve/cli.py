"""``goodserve`` command line: generate, chat (and the server, benchmark and planner commands)."""

from __future__ import annotations

import argparse
import logging
import os
import sys
from typing import Optional, Sequence

from goodserve.engine.args import EngineArgs

# Pool of the one-shot commands per prompt when --max-model-len is not given: 8,192 tokens (the default
# model's context), 188 MiB of bfloat16 KV on SmolLM2-135M, of which only the used blocks become resident.
ONE_SHOT_MAX_MODEL_LEN = 8192


def _add_sampling_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("sampling")
    g.add_argument("--max-tokens", type=int, default=256)
    g.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    g.add_argument("--top-p", type=float, default=1.0)
    g.add_argument("--top-k", type=int, default=0)
    g.add_argument("--min-p", type=float, default=0.0)
    g.add_argument("--sampling-seed", type=int, default=None, help="per-request seed")
    g.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")


def _sampling_params(args: argparse.Namespace):
    from goodserve.sampling_params import SamplingParams

    return SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p,
                          top_k=args.top_k, min_p=args.min_p, seed=args.sampling_seed, stop=args.stop)


def _run_generate(args: argparse.Namespace) -> int:
    from goodserve.llm import LLM

    eargs = EngineArgs.from_cli_args(args)
    if eargs.num_blocks is None and eargs.kv_cache_memory is None:
        # A one-shot command runs these prompts and nothing else: at most one full-length sequence each,
        # not the server's default pool (whose pages would be mapped but, being zeroed lazily, untouched).
        eargs.max_num_seqs = min(eargs.max_num_seqs, len(args.prompts))
        eargs.num_blocks = len(args.prompts) * -(-(eargs.max_model_len or ONE_SHOT_MAX_MODEL_LEN) // eargs.block_size)
    llm = LLM(**vars(eargs))
    params = _sampling_params(args)
    if args.command == "chat":
        outputs = llm.chat([[{"role": "user", "content": m}] for m in args.prompts], params, use_tqdm=False)
    else:
        outputs = llm.generate(args.prompts, params, use_tqdm=len(args.prompts) > 1)
    for prompt, out in zip(args.prompts, outputs):
        if len(args.prompts) > 1:
            print(f"### {prompt}")
        print(out.text)
        m = out.metrics
        logging.getLogger("goodserve").info(
            "%d prompt + %d output tokens, finish_reason=%s, TTFT %.3f s, TPOT %s", len(out.prompt_token_ids),
            len(out.token_ids), out.finish_reason, m.ttft or 0.0, f"{m.tpot * 1000:.1f} ms" if m.tpot else "n/a")
    return 0


ONE_SHOT_COMMANDS = ("generate", "chat")


def build_parser(one_shot_only: bool = False) -> argparse.ArgumentParser:
    """The ``goodserve`` parser; with ``one_shot_only``, only ``generate`` and ``chat`` (whose start then
    imports none of the bench, server, simulator and router command modules)."""
    parser = argparse.ArgumentParser(prog="goodserve", description="LLM serving engine built for goodput.")
    parser.add_argument("--log-level", default="INFO")
    sub = parser.add_subparsers(dest="command", required=True)
    for name, help_ in (("generate", "complete prompts with the model"),
                        ("chat", "answer messages with the model's chat template")):
        p = sub.add_parser(name, help=help_)
        p.add_argument("prompts", nargs="+", help="one or more prompts / messages")
        EngineArgs.add_cli_args(p)
        _add_sampling_args(p)
        p.set_defaults(func=_run_generate)
    if one_shot_only:
        return parser
    from goodserve.bench.cli import add_bench_parser
    from goodserve.sim.plan_cli import add_plan_parser

    add_bench_parser(sub)
    add_plan_parser(sub)
    from goodserve.server.serve_cli import add_serve_parser; add_serve_parser(sub)
    from goodserve.sim.simulate_cli import add_simulate_parser; add_simulate_parser(sub)
    from goodserve.sim.simulate_cli import add_profile_parser; add_profile_parser(sub)
    from goodserve.router.cli import add_router_parser; add_router_parser(sub)
    return parser


def _command(argv: Sequence[str]) -> Optional[str]:
    """The subcommand named in ``argv`` (the first word that is not ``--log-level`` or its value)."""
    words = iter(argv)
    for word in words:
        if word == "--log-level":
            next(words, None)
        elif not word.startswith("-"):
            return word
    return None


def main(argv: Optional[Sequence[str]] = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    parser = build_parser(one_shot_only=_command(argv) in ONE_SHOT_COMMANDS)
    args = parser.parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        return args.func(args)
    except (ValueError, FileNotFoundError) as e:
        print(f"goodserve: error: {e}", file=sys.stderr)
        return 2


def run() -> None:
    """The process entry point (the ``goodserve`` script and ``python -m goodserve.cli``): :func:`main`, then
    exit with its code.

    A one-shot command (``generate``, ``chat``) ends the process with ``os._exit`` once its output and logs
    are flushed: an interpreter's ordinary exit then tears down torch and the model object by object, ~0.3 s
    of a ~3 s command on the project's 2-core machine (issue 15, part 5), and an exiting process needs none
    of it (nor do atexit hooks run: ``python -m cProfile`` or coverage around it then write nothing; call
    :func:`main` for those). Other commands exit normally (servers have shutdown work of their own).
    """
    argv = sys.argv[1:]
    code = main(argv)
    if _command(argv) in ONE_SHOT_COMMANDS:
        logging.shutdown()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    sys.exit(code)


if __name__ == "__main__":
    run()
