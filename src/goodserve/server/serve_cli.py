"""``goodserve serve``: the OpenAI-compatible server on uvicorn."""

from __future__ import annotations

import argparse
import logging

from goodserve.engine.args import EngineArgs

logger = logging.getLogger(__name__)


def add_serve_parser(subparsers) -> argparse.ArgumentParser:
    """Register the ``serve`` sub-command (engine flags plus the server's own)."""
    p = subparsers.add_parser("serve", help="run the OpenAI-compatible HTTP server")
    EngineArgs.add_cli_args(p)
    g = p.add_argument_group("server")
    g.add_argument("--host", default="127.0.0.1")
    g.add_argument("--port", type=int, default=8000)
    g.add_argument("--served-model-name", default=None, help="model name clients use (default: file name)")
    g.add_argument("--max-waiting-requests", type=int, default=None,
                   help="answer 429 while this many requests wait (default: no limit)")
    g.add_argument("--slo-ttft", type=float, default=None, help="TTFT SLO in seconds, for goodput counters")
    g.add_argument("--slo-tpot", type=float, default=None, help="TPOT SLO in seconds, for goodput counters")
    g.add_argument("--step-trace", default=None, metavar="FILE",
                   help="write one JSON line per engine step (shape and seconds), for `goodserve profile "
                        "--from-step-trace`")
    p.set_defaults(func=run_serve)
    return p


def run_serve(args: argparse.Namespace) -> int:
    """Load the model, start the engine thread and serve until interrupted.

    Raises:
        ValueError: on invalid flags (e.g. a negative ``--max-waiting-requests``).
    """
    import uvicorn

    from goodserve.engine.async_engine import AsyncEngine
    from goodserve.engine.host import freeze_startup_objects, retain_freed_memory
    from goodserve.server.app import build_app

    if args.max_waiting_requests is not None and args.max_waiting_requests < 0:
        raise ValueError(f"--max-waiting-requests must be >= 0, got {args.max_waiting_requests}")
    for name in ("slo_ttft", "slo_tpot"):
        value = getattr(args, name)
        if value is not None and value <= 0:
            raise ValueError(f"--{name.replace('_', '-')} must be > 0 seconds, got {value}")
    retain_freed_memory()
    engine = AsyncEngine.from_engine_args(EngineArgs.from_cli_args(args), step_trace=args.step_trace)
    logger.debug("froze %d startup objects out of the garbage collector", freeze_startup_objects())
    app = build_app(engine, served_model_name=args.served_model_name,
                    max_waiting_requests=args.max_waiting_requests, slo_ttft=args.slo_ttft, slo_tpot=args.slo_tpot)
    logger.info("serving %s on http://%s:%d/v1", app.state.served_model_name, args.host, args.port)
    try:
        uvicorn.run(app, host=args.host, port=args.port, log_level=logging.getLevelName(
            logging.getLogger().getEffectiveLevel()).lower())
    finally:
        engine.shutdown()
    return 0
