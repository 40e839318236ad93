"""``goodserve serve --ray``: engine instances as Ray actors behind the router, one OpenAI ingress."""

from __future__ import annotations

import argparse
import logging

from goodserve.router.policies import POLICIES

logger = logging.getLogger(__name__)


def add_ray_args(p: argparse.ArgumentParser) -> None:
    """Add the ``--ray`` flags to ``serve``'s parser."""
    g = p.add_argument_group("ray (scale out: instances as Ray actors behind the router on --host/--port)")
    g.add_argument("--ray", action="store_true", help="run instances as Ray actors and route across them")
    g.add_argument("--ray-address", default=None, metavar="ADDR",
                   help="join this Ray cluster (e.g. HEAD_IP:6379); default: start a local Ray on 127.0.0.1")
    g.add_argument("--replicas", type=int, default=None, help="colocated replicas")
    g.add_argument("--prefill-replicas", type=int, default=None, help="prefill instances (kv_role producer)")
    g.add_argument("--decode-replicas", type=int, default=None, help="decode instances (kv_role consumer)")
    g.add_argument("--num-cpus-per-replica", type=float, default=1.0,
                   help="Ray CPUs each instance reserves; also its torch threads unless --num-threads (default 1)")
    g.add_argument("--num-gpus-per-replica", type=float, default=0.0, help="Ray GPUs each instance reserves")
    g.add_argument("--max-restarts", type=int, default=-1,
                   help="times Ray restarts a dead instance (-1: without limit)")
    g.add_argument("--routing", choices=sorted(POLICIES), default="round-robin",
                   help="replicas' routing policy (P/D pools: least queued prefill tokens / least KV usage)")
    g.add_argument("--ucx-net-devices", default="lo",
                   help="UCX_NET_DEVICES of P/D KV transfers: lo (one node) or e.g. all / mlx5_0:1 across nodes")
    g.add_argument("--instance-ports", type=int, nargs="+", default=None, metavar="PORT",
                   help="the instances' ports (replicas, or prefill then decode); default: free ports here")
    g.add_argument("--health-interval", type=float, default=1.0, help="seconds between /health probes")


def check_ray_args(args: argparse.Namespace) -> None:
    """Check the ``--ray`` flags before anything starts: instance counts need ``--ray``, and ``--ray`` needs
    either ``--replicas`` or both P/D counts (each >= 1), no ``--kv-role``, and positive resources.

    Raises:
        ValueError: naming the flags.
    """
    counts = (args.replicas, args.prefill_replicas, args.decode_replicas)
    if not args.ray and (any(c is not None for c in counts) or args.ray_address):
        raise ValueError("--replicas, --prefill-replicas, --decode-replicas and --ray-address need --ray")
    if not args.ray:
        return
    replicas, prefill, decode = counts
    if (replicas is None) == (prefill is None and decode is None) or (prefill is None) != (decode is None):
        raise ValueError("--ray needs either --replicas N, or both --prefill-replicas P and --decode-replicas D")
    if any(c is not None and c < 1 for c in counts):
        raise ValueError(f"instance counts must be >= 1, got {[c for c in counts if c is not None]}")
    if args.kv_role is not None:
        raise ValueError("--kv-role is set per pool on Ray (prefill: producer, decode: consumer); drop it")
    if not (args.num_cpus_per_replica > 0 and args.num_gpus_per_replica >= 0 and args.health_interval > 0):
        raise ValueError("--num-cpus-per-replica and --health-interval must be > 0, --num-gpus-per-replica >= 0")


def run_ray_serve(args: argparse.Namespace) -> int:
    """Start (or join) Ray, start the instance actors, and serve the router on ``--host``/``--port`` until
    interrupted; then kill the actors.

    Raises:
        ValueError: on invalid flags (see :class:`goodserve.cluster.ray_instances.RayInstances`).
        RuntimeError: if an instance fails to start.
    """
    import uvicorn

    from goodserve.cluster.ray_instances import RayInstances, init_ray
    from goodserve.engine.args import EngineArgs
    from goodserve.router.app import build_router_app
    from goodserve.router.policies import make_policy

    check_ray_args(args)
    n = sum(c or 0 for c in (args.replicas, args.prefill_replicas, args.decode_replicas))
    init_ray(args.ray_address, num_cpus=max(1, round(n * args.num_cpus_per_replica)),
             num_gpus=round(n * args.num_gpus_per_replica) or None)
    instances = RayInstances(EngineArgs.from_cli_args(args), replicas=args.replicas or 0,
                             prefill=args.prefill_replicas or 0, decode=args.decode_replicas or 0,
                             num_cpus_per_replica=args.num_cpus_per_replica,
                             num_gpus_per_replica=args.num_gpus_per_replica, max_restarts=args.max_restarts,
                             served_model_name=args.served_model_name, ucx_net_devices=args.ucx_net_devices,
                             ports=args.instance_ports)
    try:
        tokenizer = None
        if args.routing == "kv-aware":  # text and chat prompts hashed as the instances will
            from goodserve.models.loader import default_model_path
            from goodserve.router.tokenize import PromptTokenizer

            tokenizer = PromptTokenizer.load(args.model or default_model_path())
        router = instances.router(policy=make_policy(args.routing), health_interval=args.health_interval,
                                  tokenizer=tokenizer)
        logger.info("routing on http://%s:%d/v1 to %s", args.host, args.port,
                    ", ".join(f"{b.role} {b.url}" for b in router.backends))
        uvicorn.run(build_router_app(router), host=args.host, port=args.port,
                    log_level=logging.getLevelName(logging.getLogger().getEffectiveLevel()).lower())
    finally:
        instances.shutdown()
    return 0
