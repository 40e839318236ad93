"""Engine instances as Ray actors, behind the router (``goodserve serve --ray``).

Each instance is one Ray actor (:class:`InstanceServer`) that reserves ``num_cpus`` (and ``num_gpus``) so Ray
places it on a node with room, builds the engine from the same :class:`~goodserve.engine.args.EngineArgs` as
``goodserve serve`` and runs the normal OpenAI server (:func:`goodserve.server.app.build_app` on uvicorn) on
its node's IP address, at a port the driver chose. Ray restarts a dead actor (``max_restarts``) with the same
constructor arguments, so it comes back at the same URL, where the router's health probe finds it again.
The driver runs the router (:class:`goodserve.router.app.Router`) as the single OpenAI ingress: replicas
with a routing policy, or a prefill pool (``kv_role`` producer) and a decode pool (``kv_role`` consumer)
whose KV connector publishes the producer's node IP in its handles (:mod:`goodserve.kv_transfer`).

Loopback: without an address, :func:`init_ray` starts a local Ray whose node (and so every actor, server and
KV side channel) is at 127.0.0.1, with no dashboard and no usage statistics.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import socket
import threading
import time
from dataclasses import dataclass
from typing import Any, Optional

from goodserve.engine.args import EngineArgs

logger = logging.getLogger(__name__)

ROLES = {"replica": None, "prefill": "producer", "decode": "consumer"}  # instance role -> kv_role
LOCAL_NODE_IP = "127.0.0.1"


def _import_ray():
    """The ``ray`` module.

    Raises:
        ImportError: naming the extra to install.
    """
    try:
        import ray
    except ImportError as e:
        raise ImportError("goodserve serve --ray needs Ray: pip install 'goodserve[ray]' (ray==2.60.0)") from e
    return ray


def init_ray(address: Optional[str] = None, num_cpus: Optional[int] = None, num_gpus: Optional[int] = None,
             object_store_memory: int = 256 << 20) -> None:
    """Connect to Ray: join the cluster at ``address``, or start a local one on 127.0.0.1.

    A local Ray gets ``num_cpus``/``num_gpus`` logical resources, no dashboard and a small object store
    (``object_store_memory`` bytes: instances pass nothing through it), and its node address is 127.0.0.1:
    Ray turns a loopback ``_node_ip_address`` into the host's routable address unless
    ``RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0`` (its single-machine mode) is set before ``ray`` is imported, which
    this function does. Usage statistics are off unless the environment sets ``RAY_USAGE_STATS_ENABLED``.
    Does nothing if Ray is already initialised.

    Args:
        address: A Ray cluster's address (``HEAD_IP:6379`` or ``ray://...``); ``None`` starts a local Ray.
        num_cpus: Logical CPUs of a local Ray (``None``: Ray counts the cores).
        num_gpus: Logical GPUs of a local Ray.
        object_store_memory: Bytes of a local Ray's object store.

    Raises:
        ImportError: without Ray.
        ConnectionError: if ``address`` cannot be reached (from Ray).
        RuntimeError: if a local Ray's node did not come up at 127.0.0.1 (``ray`` was imported before this
            call without ``RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0``); Ray is shut down again.
    """
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    if not address:
        os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"
    ray = _import_ray()
    if ray.is_initialized():
        return
    if address:
        ray.init(address=address, logging_level=logging.WARNING)
        return
    ray.init(address="local", num_cpus=num_cpus, num_gpus=num_gpus, _node_ip_address=LOCAL_NODE_IP,
             include_dashboard=False, object_store_memory=object_store_memory, logging_level=logging.WARNING)
    addresses = sorted({n["NodeManagerAddress"] for n in ray.nodes()})
    if addresses != [LOCAL_NODE_IP]:
        ray.shutdown()
        raise RuntimeError(f"the local Ray came up at {addresses}, not {LOCAL_NODE_IP}: set "
                           "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0 before anything imports ray")


def node_ip_address(ray) -> str:
    """The IP address Ray registered for the node this process runs on (``ray start --node-ip-address``;
    127.0.0.1 for a local Ray from :func:`init_ray`), not the address of the host's default route.

    Raises:
        RuntimeError: if the node is not among ``ray.nodes()``.
    """
    node_id = ray.get_runtime_context().get_node_id()
    for node in ray.nodes():
        if node["NodeID"] == node_id:
            return node["NodeManagerAddress"]
    raise RuntimeError(f"this process's Ray node {node_id} is not in ray.nodes()")


def free_port(host: str = LOCAL_NODE_IP) -> int:
    """A TCP port free right now on ``host`` (the OS picks it)."""
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


@dataclass(frozen=True)
class InstanceSpec:
    """What one instance actor is built from (also its arguments on a restart).

    Attributes:
        role: ``"replica"``, ``"prefill"`` or ``"decode"``.
        index: Its number within the role.
        port: TCP port of its OpenAI server on its node.
        engine_kwargs: :class:`EngineArgs` fields (``kv_role`` and the KV side channel's ``host`` are set
            from ``role`` and the node).
        served_model_name: The model name clients use (``None``: the model's file name).
        ucx_net_devices: ``UCX_NET_DEVICES`` of a P/D instance's KV transfers (``"lo"``: loopback only;
            ``"all"`` or a NIC name between nodes).
    """

    role: str
    index: int
    port: int
    engine_kwargs: dict
    served_model_name: Optional[str] = None
    ucx_net_devices: str = "lo"

    def __post_init__(self) -> None:
        if self.role not in ROLES:
            raise ValueError(f"instance role must be one of {sorted(ROLES)}, got {self.role!r}")


class InstanceServer:
    """A Ray actor: one engine and its OpenAI server (uvicorn in a thread of the actor's process).

    The constructor returns at once; the model loads and the server starts in the background
    (:meth:`wait_ready`). If the engine loop dies, the process exits with status 1 so that Ray restarts the
    actor. The server binds to the node's IP address as the Ray cluster knows it (:func:`node_ip_address`:
    127.0.0.1 on a local Ray) at ``spec.port``.

    Args:
        spec: The instance.
    """

    def __init__(self, spec: InstanceSpec) -> None:
        import ray

        self.spec = spec
        self.host = node_ip_address(ray)
        self.url = f"http://{self.host}:{spec.port}"
        self._server: Any = None
        self._error: Optional[BaseException] = None
        self._thread = threading.Thread(target=self._serve, name=f"goodserve-{spec.role}{spec.index}", daemon=True)
        self._thread.start()

    def _engine_args(self) -> EngineArgs:
        kw = dict(self.spec.engine_kwargs)
        kv_role = ROLES[self.spec.role]
        if kv_role is not None:
            extra = json.loads(kw.get("kv_transfer_config") or "{}")
            extra.update(host=self.host, ucx_net_devices=self.spec.ucx_net_devices)
            kw.update(kv_role=kv_role, kv_transfer_config=json.dumps(extra))
        if not kw.get("kv_events_config"):  # every instance publishes its KV events for the router (free ports)
            kw["kv_events_config"] = json.dumps({"endpoint": f"tcp://{self.host}:*",
                                                 "replay_endpoint": f"tcp://{self.host}:*"})
        return EngineArgs(**{**kw, "serving": True})

    def _serve(self) -> None:
        import uvicorn

        from goodserve.engine.async_engine import AsyncEngine
        from goodserve.server.app import build_app

        def on_dead(error: BaseException) -> None:
            logger.critical("%s: the engine loop died (%s); exiting for Ray to restart the instance", self.url, error)
            os._exit(1)

        try:
            engine = AsyncEngine.from_engine_args(self._engine_args(), on_dead=on_dead)
            app = build_app(engine, served_model_name=self.spec.served_model_name)
            config = uvicorn.Config(app, host=self.host, port=self.spec.port, log_level="warning")
            self._server = uvicorn.Server(config)
            self._server.run()
        except BaseException as e:  # noqa: BLE001 - reported by wait_ready
            self._error = e
            logger.exception("%s: the instance failed", self.url)

    def wait_ready(self, timeout: float = 300.0) -> str:
        """Wait until the server accepts requests.

        Returns:
            Its base URL, ``http://NODE_IP:PORT``.

        Raises:
            RuntimeError: if building the engine or starting the server failed (with the cause), or it did
                not start within ``timeout`` seconds.
        """
        deadline = time.monotonic() + timeout
        while not (self._server is not None and self._server.started):
            if self._error is not None or not self._thread.is_alive():
                raise RuntimeError(f"instance {self.spec.role}{self.spec.index} at {self.url} failed to start: "
                                   f"{self._error!r}") from self._error
            if time.monotonic() > deadline:
                raise RuntimeError(f"instance {self.spec.role}{self.spec.index} at {self.url} did not start "
                                   f"within {timeout} s")
            time.sleep(0.05)
        return self.url

    def pid(self) -> int:
        """The actor's process id (a restarted actor has a new one)."""
        return os.getpid()


class RayInstances:
    """Instance actors started on Ray: ``urls`` and ``actors`` per role, in order.

    Args:
        engine_args: The engine flags every instance uses (``kv_role`` must be unset: P/D roles come from
            the pools; ``num_threads`` defaults to ``num_cpus_per_replica``).
        replicas: Colocated replicas (replicas mode).
        prefill: Prefill instances (P/D mode, with ``decode``).
        decode: Decode instances.
        num_cpus_per_replica: Ray CPUs each instance reserves (also its torch threads unless
            ``engine_args.num_threads`` is set).
        num_gpus_per_replica: Ray GPUs each instance reserves.
        max_restarts: Times Ray restarts a dead instance (``-1``: without limit).
        served_model_name: The model name clients use.
        ucx_net_devices: UCX devices of P/D KV transfers (``"lo"`` on one node, e.g. ``"all"`` across nodes).
        ports: A port per instance (replicas, or prefill then decode); ``None``: free ports of 127.0.0.1
            (right on a local Ray; across nodes give ports free on every node).

    Raises:
        ValueError: for neither or both modes, a count below 1, ``kv_role`` in ``engine_args``, resources
            below their minimum, or the wrong number of ports.
        RuntimeError: if an instance fails to start (:meth:`wait_ready`).
    """

    def __init__(self, engine_args: EngineArgs, replicas: int = 0, prefill: int = 0, decode: int = 0,
                 num_cpus_per_replica: float = 1, num_gpus_per_replica: float = 0, max_restarts: int = -1,
                 served_model_name: Optional[str] = None, ucx_net_devices: str = "lo",
                 ports: Optional[list[int]] = None) -> None:
        ray = _import_ray()
        if bool(replicas) == bool(prefill or decode) or bool(prefill) != bool(decode):
            raise ValueError("give either --replicas N, or both --prefill-replicas P and --decode-replicas D")
        if min(n for n in (replicas, prefill, decode) if n) < 1:
            raise ValueError("instance counts must be >= 1")
        if engine_args.kv_role is not None:
            raise ValueError("--kv-role is set per pool on Ray (prefill: producer, decode: consumer); drop it")
        if not num_cpus_per_replica > 0 or num_gpus_per_replica < 0:
            raise ValueError("--num-cpus-per-replica must be > 0 and --num-gpus-per-replica >= 0")
        if max_restarts < -1:
            raise ValueError(f"--max-restarts must be >= -1 (-1: without limit), got {max_restarts}")
        kw = dataclasses.asdict(engine_args)
        if kw["num_threads"] is None:
            kw["num_threads"] = max(1, int(num_cpus_per_replica))
        roles = [("replica", replicas), ("prefill", prefill), ("decode", decode)]
        specs_roles = [(role, i) for role, n in roles for i in range(n)]
        if ports is None:
            ports = [free_port() for _ in specs_roles]
        if len(ports) != len(specs_roles):
            raise ValueError(f"{len(specs_roles)} instances need as many ports, got {len(ports)}")
        actor_cls = ray.remote(InstanceServer).options(
            num_cpus=num_cpus_per_replica, num_gpus=num_gpus_per_replica, max_restarts=max_restarts,
            max_task_retries=0)
        self.specs = [InstanceSpec(role, i, port, kw, served_model_name, ucx_net_devices)
                      for (role, i), port in zip(specs_roles, ports)]
        self.actors = [actor_cls.remote(spec) for spec in self.specs]
        self.urls: dict[str, list[str]] = {role: [] for role, n in roles if n}
        try:
            for spec, url in zip(self.specs, ray.get([a.wait_ready.remote() for a in self.actors])):
                self.urls[spec.role].append(url)
        except Exception:
            self.shutdown()
            raise

    def actor(self, role: str, index: int):
        """The actor handle of instance ``index`` of ``role``."""
        return next(a for a, s in zip(self.actors, self.specs) if (s.role, s.index) == (role, index))

    def router(self, **kwargs: Any):
        """A :class:`goodserve.router.app.Router` over these instances (``kwargs``: its other arguments)."""
        from goodserve.router.app import Router

        return Router(replicas=self.urls.get("replica", ()), prefill=self.urls.get("prefill", ()),
                      decode=self.urls.get("decode", ()), **kwargs)

    def shutdown(self) -> None:
        """Kill every instance actor, without restarts."""
        ray = _import_ray()
        for a in self.actors:
            ray.kill(a, no_restart=True)
