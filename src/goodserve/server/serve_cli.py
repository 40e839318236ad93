"""``goodserve serve``: the OpenAI-compatible server on uvicorn."""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import logging
import math
import signal
from typing import Optional

from goodserve.engine.args import EngineArgs
from goodserve.server.slo_classes import parse_slo_classes

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
    g.add_argument("--slo-class", action="append", default=None, metavar="NAME:TTFT_MS:TPOT_MS",
                   help="a named SLO class requests may pick with slo_class (repeatable); attainment is counted "
                        "per class on /metrics")
    g.add_argument("--step-trace", default=None, metavar="FILE",
                   help="write one JSON line per engine step (shape and seconds), for `goodserve profile "
                        "--from-step-trace`")
    g.add_argument("--shutdown-timeout", type=float, default=5.0, metavar="SECONDS",
                   help="on SIGTERM/SIGINT (or if the engine dies), let in-flight requests finish for at most "
                        "this long, then abort them and exit (default 5)")
    # Test-only: make engine step N raise, to check that the process exits non-zero (fault-injection soak).
    g.add_argument("--inject-step-fault", type=int, default=None, metavar="N", help=argparse.SUPPRESS)
    from goodserve.cluster.ray_cli import add_ray_args
    add_ray_args(p)
    p.set_defaults(func=run_serve)
    return p


def run_serve(args: argparse.Namespace) -> int:
    """Load the model, start the engine thread and serve until interrupted or until the engine dies.

    SIGTERM and SIGINT stop admitting, give in-flight requests ``--shutdown-timeout`` seconds, abort the
    rest and exit 0. If the engine loop dies, every in-flight request gets an error at once, ``/health``
    answers 503 and the process exits with status 1 within the same timeout, so that a supervisor
    (systemd, Kubernetes, Ray) restarts it. On exit the log states how every API call ended and whether the
    KV cache is intact.

    Returns:
        0 after a requested shutdown, 1 if the engine died.

    Raises:
        ValueError: on invalid flags (e.g. a negative ``--max-waiting-requests``).
    """
    from goodserve.cluster.ray_cli import check_ray_args, run_ray_serve

    check_ray_args(args)
    if args.ray:  # instances as Ray actors, this process routes (goodserve.cluster)
        return run_ray_serve(args)
    import uvicorn

    from goodserve.engine.async_engine import AsyncEngine
    from goodserve.engine.host import freeze_startup_objects, retain_freed_memory
    from goodserve.server.app import build_app

    if args.max_waiting_requests is not None and args.max_waiting_requests < 0:
        raise ValueError(f"--max-waiting-requests must be >= 0, got {args.max_waiting_requests}")
    for name in ("shutdown_timeout",):
        value = getattr(args, name)
        if value is not None and not (math.isfinite(value) and value > 0):
            raise ValueError(f"--{name.replace('_', '-')} must be a finite number of seconds > 0, got {value}")
    retain_freed_memory()
    server: Optional[uvicorn.Server] = None

    def on_dead(error: BaseException) -> None:
        logger.critical("the engine loop died (%s): shutting the server down to exit with status 1", error)
        if server is not None:
            server.should_exit = True

    engine_args = dataclasses.replace(EngineArgs.from_cli_args(args), serving=True)
    engine = AsyncEngine.from_engine_args(engine_args, step_trace=args.step_trace,
                                          on_dead=on_dead, inject_step_fault=args.inject_step_fault)
    logger.debug("froze %d startup objects out of the garbage collector", freeze_startup_objects())
    app = build_app(engine, served_model_name=args.served_model_name,
                    max_waiting_requests=args.max_waiting_requests, slo_classes=parse_slo_classes(args.slo_class))
    # uvicorn's own limit comes later: by then the engine has failed every in-flight request (a 503 body
    # or an error event), so the clients get an answer rather than a cut connection.
    config = uvicorn.Config(app, host=args.host, port=args.port,
                            timeout_graceful_shutdown=args.shutdown_timeout + _GRACE_S,
                            log_level=logging.getLevelName(logging.getLogger().getEffectiveLevel()).lower())
    server = _make_server(config, engine, args.shutdown_timeout)
    if not engine.is_healthy():  # died between start and now: on_dead saw no server to stop
        server.should_exit = True
    logger.info("serving %s on http://%s:%d/v1", app.state.served_model_name, args.host, args.port)
    # uvicorn handles SIGTERM/SIGINT while it runs and re-raises them once it has shut down; with these
    # handlers in place, that re-raise no longer kills the process before the exit log and engine shutdown.
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda signum, frame: None)
    try:
        server.run()
    finally:
        engine.shutdown(timeout=_GRACE_S)  # it was told to stop at --shutdown-timeout already
        _log_exit(app, engine)
    return 0 if engine.error is None else 1


_GRACE_S = 2.0  # after --shutdown-timeout, for the error answers to reach the clients


def _make_server(config, engine, timeout: float):
    """A ``uvicorn.Server`` whose shutdown, ``timeout`` seconds in, stops the engine: every request still in
    flight is aborted and its client answered with a 503 ("the server is stopping")."""
    import uvicorn

    class Server(uvicorn.Server):
        async def shutdown(self, sockets=None) -> None:
            stop = asyncio.get_running_loop().call_later(timeout, lambda: engine.shutdown(timeout=0))
            try:
                await super().shutdown(sockets)
            finally:
                stop.cancel()

    return Server(config)


def _log_exit(app, engine) -> None:
    """Log how every API call ended and, once the engine thread has ended, the KV cache's integrity."""
    o = app.state.metrics.outcomes
    logger.info("API calls: finished %d, aborted %d, rejected %d, failed %d", o["finished"], o["aborted"],
                o["rejected"], o["failed"])
    if engine.error is not None or engine.is_running():
        return  # a dead engine's state is not worth checking; a running one is not ours to touch
    try:
        engine.engine.core.check_integrity()
        usage = engine.engine.make_stats().kv_cache_usage
        logger.info("KV cache: integrity ok, %.1f%% of blocks in use", 100.0 * usage)
    except Exception as e:  # noqa: BLE001 - reported, the process is exiting anyway
        logger.error("KV cache check failed: %s", e)
