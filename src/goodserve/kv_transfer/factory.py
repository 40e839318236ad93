"""Builds a KV connector's two halves from a :class:`KVTransferConfig`, so that the engine core and the scheduler
name no transport.

A transport is one file: a :class:`~goodserve.kv_transfer.base.KVConnectorWorker` subclass whose constructor
takes ``(config, kv_caches, leases)`` and binds its side channel (its ``port``). Register it in
:data:`TRANSPORTS`, or name it in the config as ``"package.module:Class"`` (``--kv-transfer-config
'{"connector": "mypkg.rdma:RdmaConnector"}'``). Its scheduler half is :class:`PullConnectorScheduler`, shared
by every transport in which the consumer pulls from a producer that holds blocks under a lease.
"""

from __future__ import annotations

import dataclasses
import importlib
from typing import Any, Optional

from goodserve.kv_transfer.base import KVConnectorScheduler, KVConnectorWorker
from goodserve.kv_transfer.config import KVTransferConfig
from goodserve.kv_transfer.lease import LeaseTable
from goodserve.kv_transfer.pull_scheduler import PullConnectorScheduler

#: Registered transports: name -> ``"module:Class"`` of their worker half (imported only when chosen).
TRANSPORTS = {"nixl": "goodserve.kv_transfer.nixl_connector:NixlConnector"}


def worker_class(name: str) -> type:
    """The worker class a connector name (or ``"module:Class"`` path) stands for.

    Raises:
        ValueError: for an unknown name, or a path that is not a :class:`KVConnectorWorker` subclass.
        ImportError: if its module (or the transport library it needs) cannot be imported.
    """
    path = TRANSPORTS.get(name, name)
    if ":" not in path:
        raise ValueError(f"unknown kv connector {name!r}; known: {sorted(TRANSPORTS)} or 'package.module:Class'")
    module, _, attr = path.partition(":")
    cls = getattr(importlib.import_module(module), attr, None)
    if not (isinstance(cls, type) and issubclass(cls, KVConnectorWorker)):
        raise ValueError(f"kv connector {name!r}: {path} is not a KVConnectorWorker subclass")
    return cls


def create_connector_scheduler(config: KVTransferConfig, block_size: int,
                               leases: Optional[LeaseTable] = None) -> KVConnectorScheduler:
    """The scheduler half alone (torch-free): the simulator and scheduler tests, which move no bytes."""
    return PullConnectorScheduler(config, block_size, leases)


def create_kv_connector(config: KVTransferConfig, block_size: int,
                        kv_caches: Any) -> tuple[KVConnectorScheduler, KVConnectorWorker]:
    """Both halves of the instance's connector, sharing the producer's lease table.

    Args:
        config: The transfer settings (``port`` 0: the worker picks a free one, which the handles publish).
        block_size: Tokens per KV block.
        kv_caches: The runner's cache, per layer ``(K, V)`` (the worker registers it with its transport).

    Returns:
        ``(scheduler half, worker half)``.

    Raises:
        ValueError: for an MLA model's cache (``(latent, None)`` per layer), before any transport is imported.
        ValueError, ImportError: as :func:`worker_class`, or whatever the worker refuses.
    """
    if any(kv[1] is None for kv in kv_caches):
        raise ValueError("KV transfer of a multi-head latent attention cache (DeepSeek-V2: one latent tensor per "
                         "layer, no V) is not implemented; the connectors move per-layer K and V tensors")
    leases = LeaseTable(config.timeout) if config.is_producer else None
    worker = worker_class(config.connector)(config, kv_caches, leases)
    bound = dataclasses.replace(config, port=worker.port)
    return create_connector_scheduler(bound, block_size, leases), worker
