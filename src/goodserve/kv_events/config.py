"""``--kv-events-config``: whether and where an instance publishes its KV events (vLLM's ``KVEventsConfig``
shape: ``enable_kv_cache_events``, ``publisher``, ``endpoint``, ``replay_endpoint``, ``buffer_steps``,
``topic``)."""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Optional

from goodserve.json_flag import parse_json_object

PUBLISHERS = ("zmq", "null")


@dataclass(frozen=True)
class KVEventsConfig:
    """Where KV events go.

    Attributes:
        enable_kv_cache_events: Record and publish the prefix cache's changes.
        publisher: ``zmq`` (a PUB socket plus a replay socket) or ``null`` (record nothing).
        endpoint: The PUB socket's ZeroMQ address; port ``*`` binds a free port (reported at
            ``GET /v1/kv_events``). Loopback by default: publish beyond the machine only on purpose.
        replay_endpoint: The replay socket's address (a ROUTER answering "from sequence number N"), ``None``
            for none (a subscriber then cannot recover from a gap).
        buffer_steps: Batches kept for replay; a subscriber asking for an older one gets a snapshot.
        topic: Topic frame of every message.
        load_interval: Seconds between batches that carry only the load (a batch with events always goes).

    Raises:
        ValueError: on an unknown publisher, a non-``tcp://``/``ipc://`` endpoint, or bad numbers.
    """

    enable_kv_cache_events: bool = True
    publisher: str = "zmq"
    endpoint: str = "tcp://127.0.0.1:*"
    replay_endpoint: Optional[str] = "tcp://127.0.0.1:*"
    buffer_steps: int = 10_000
    topic: str = "kv-events"
    load_interval: float = 0.05

    def __post_init__(self) -> None:
        if self.publisher not in PUBLISHERS:
            raise ValueError(f"kv events publisher must be one of {PUBLISHERS}, got {self.publisher!r}")
        for name in ("endpoint", "replay_endpoint"):
            value = getattr(self, name)
            if value is not None and not (isinstance(value, str) and value.startswith(("tcp://", "ipc://"))):
                raise ValueError(f"kv events {name} must be a tcp:// or ipc:// address, got {value!r}")
        if not (isinstance(self.buffer_steps, int) and self.buffer_steps >= 1):
            raise ValueError(f"kv events buffer_steps must be an integer >= 1, got {self.buffer_steps!r}")
        if not self.load_interval >= 0:
            raise ValueError(f"kv events load_interval must be >= 0 seconds, got {self.load_interval!r}")

    @property
    def enabled(self) -> bool:
        """Whether events are recorded and published."""
        return self.enable_kv_cache_events and self.publisher != "null"

    @classmethod
    def from_cli(cls, text: Optional[str]) -> Optional["KVEventsConfig"]:
        """Parse ``--kv-events-config`` (a JSON object of the fields above), ``None`` when not given.

        Raises:
            ValueError: on invalid JSON, unknown keys or bad values.
        """
        if text is None:
            return None
        return cls(**parse_json_object("--kv-events-config", text, [f.name for f in fields(cls)]))
