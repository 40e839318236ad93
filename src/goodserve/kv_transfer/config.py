"""An instance's part in disaggregated serving (``serve --kv-role``, ``--kv-transfer-config``)."""

from __future__ import annotations

import uuid
from dataclasses import dataclass, field
from typing import Optional

from goodserve.json_flag import parse_json_object

KV_ROLES = ("producer", "consumer", "both")


@dataclass(frozen=True)
class KVTransferConfig:
    """Settings of an instance's KV connector.

    Attributes:
        role: ``"producer"`` (prefills and holds blocks for pulls), ``"consumer"`` (pulls and decodes) or
            ``"both"``.
        engine_id: This instance's id in handles and its NIXL agent name (unique per instance).
        host: Address the side channel binds to and that handles publish (``127.0.0.1`` by default; give a
            routable address on a multi-node deployment).
        port: Side-channel TCP port; ``0`` picks a free one.
        timeout: Seconds a producer holds a request's blocks for a pull, and a consumer waits for one.
        ucx_net_devices: ``UCX_NET_DEVICES`` for NIXL's UCX backend, unless the environment sets it: ``"lo"``
            keeps every transfer on loopback; ``"all"`` (or a NIC name) for multi-node.
        backends: NIXL backends to create.
        connector: The transport (:mod:`goodserve.kv_transfer.factory`): a registered name (``"nixl"``) or
            ``"package.module:Class"`` naming a :class:`~goodserve.kv_transfer.base.KVConnectorWorker`.
    """

    role: str
    engine_id: str = field(default_factory=lambda: f"goodserve-{uuid.uuid4().hex[:12]}")
    host: str = "127.0.0.1"
    port: int = 0
    timeout: float = 30.0
    ucx_net_devices: str = "lo"
    backends: tuple[str, ...] = ("UCX",)
    connector: str = "nixl"

    def __post_init__(self) -> None:
        if self.role not in KV_ROLES:
            raise ValueError(f"kv role must be one of {KV_ROLES}, got {self.role!r}")
        if not 0 <= self.port < 65536:
            raise ValueError(f"kv transfer port must be in [0, 65535], got {self.port}")
        if not self.timeout > 0:
            raise ValueError(f"kv transfer timeout must be > 0 seconds, got {self.timeout}")
        if not isinstance(self.connector, str) or not self.connector:
            raise ValueError(f"kv connector must be a non-empty name, got {self.connector!r}")

    @property
    def is_producer(self) -> bool:
        return self.role in ("producer", "both")

    @property
    def is_consumer(self) -> bool:
        return self.role in ("consumer", "both")

    @classmethod
    def from_cli(cls, role: str, config_json: Optional[str], timeout: Optional[float]) -> "KVTransferConfig":
        """Build from ``--kv-role``, ``--kv-transfer-config`` (a JSON object with any of ``engine_id``,
        ``host``, ``port``, ``timeout``, ``ucx_net_devices``, ``backends``, ``connector``) and ``--kv-transfer-timeout``.

        Raises:
            ValueError: on malformed JSON, an unknown key, or a bad value.
        """
        extra = parse_json_object("--kv-transfer-config", config_json, (
            "engine_id", "host", "port", "timeout", "ucx_net_devices", "backends", "connector")) if config_json else {}
        if "backends" in extra:
            extra["backends"] = tuple(extra["backends"])
        if timeout is not None:
            extra["timeout"] = timeout
        return cls(role=role, **extra)
