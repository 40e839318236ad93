"""``goodserve router``: the OpenAI-compatible router in front of replicas or P/D pools, on uvicorn."""

from __future__ import annotations

import argparse
import logging

from goodserve.router.policies import POLICIES


def add_router_parser(subparsers) -> argparse.ArgumentParser:
    """Register the ``router`` sub-command."""
    p = subparsers.add_parser("router", help="route OpenAI requests across replicas or prefill/decode pools")
    g = p.add_argument_group("backends (either --replica, or --prefill and --decode)")
    g.add_argument("--replica", action="extend", nargs="+", default=[], metavar="URL",
                   help="base URL of a colocated replica, e.g. http://127.0.0.1:8001 (repeatable)")
    g.add_argument("--prefill", action="extend", nargs="+", default=[], metavar="URL",
                   help="base URL of a prefill instance (P/D mode; least queued prefill tokens)")
    g.add_argument("--decode", action="extend", nargs="+", default=[], metavar="URL",
                   help="base URL of a decode instance (P/D mode; least KV usage, then outstanding tokens)")
    g = p.add_argument_group("routing")
    g.add_argument("--routing", "--policy", dest="routing", choices=sorted(POLICIES), default="round-robin",
                   help="replicas' routing policy (as on serve --ray; --policy is an alias)")
    g.add_argument("--prefix-block-size", type=int, default=16, help="prefix-affinity: tokens per hashed block")
    g.add_argument("--prefix-block-bytes", type=int, default=64,
                   help="prefix-affinity: UTF-8 bytes per hashed block of a text prompt")
    g.add_argument("--balance-slack", type=float, default=0.5,
                   help="prefix-affinity: leave a backend over (1 + slack) * mean outstanding tokens + abs")
    g.add_argument("--min-match-tokens", type=int, default=32,
                   help="kv-aware: a prefix hit shorter than this on every backend is ignored (least loaded wins)")
    g.add_argument("--tokenizer", default=None, metavar="MODEL",
                   help="kv-aware: the served model (GGUF file or HF directory) whose tokenizer turns text and chat "
                        "prompts into the token ids the backends hash (default: only token-id prompts)")
    g.add_argument("--balance-abs-tokens", type=int, default=1024, help="prefix-affinity: the bound's abs term")
    g = p.add_argument_group("server")
    g.add_argument("--host", default="127.0.0.1")
    g.add_argument("--port", type=int, default=8000)
    g.add_argument("--connect-timeout", type=float, default=1.0,
                   help="seconds to connect to a backend before it counts as down")
    g.add_argument("--health-interval", type=float, default=1.0, help="seconds between /health probes")
    p.set_defaults(func=run_router)
    return p


def run_router(args: argparse.Namespace) -> int:
    """Serve the router until interrupted.

    Raises:
        ValueError: for an invalid combination of backends, a bad URL or a bad policy parameter.
    """
    import uvicorn

    from goodserve.router.app import Router, build_router_app
    from goodserve.router.policies import make_policy
    from goodserve.router.tokenize import PromptTokenizer

    kwargs = {}
    if args.routing == "prefix-affinity":
        kwargs = dict(block_size=args.prefix_block_size, block_bytes=args.prefix_block_bytes,
                      balance_slack=args.balance_slack, balance_abs_tokens=args.balance_abs_tokens)
    elif args.routing == "kv-aware":
        kwargs = dict(min_match_tokens=args.min_match_tokens)
    if not (args.connect_timeout > 0 and args.health_interval > 0):
        raise ValueError("--connect-timeout and --health-interval must be > 0")
    tokenizer = PromptTokenizer.load(args.tokenizer) if args.tokenizer else None
    router = Router(args.replica, args.prefill, args.decode, make_policy(args.routing, **kwargs),
                    connect_timeout=args.connect_timeout, health_interval=args.health_interval, tokenizer=tokenizer)
    logging.getLogger(__name__).info("routing on http://%s:%d/v1 to %s", args.host, args.port,
                                     ", ".join(f"{b.role} {b.url}" for b in router.backends))
    uvicorn.run(build_router_app(router), host=args.host, port=args.port,
                log_level=logging.getLevelName(logging.getLogger().getEffectiveLevel()).lower())
    return 0
