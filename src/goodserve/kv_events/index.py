"""The router's view of every instance's prefix cache, built from the instances' KV events (torch-free,
I/O-free: the HTTP router and the simulator feed it the same events).

For each instance the index keeps the set of block hashes its prefix cache holds, applying
:class:`~goodserve.kv_events.events.BlockStored` / ``BlockRemoved`` / ``AllBlocksCleared`` in order, and
the last :class:`~goodserve.kv_events.events.InstanceLoad` it published. A request's prompt is hashed with
the engine's own function (:func:`goodserve.kv_cache.hashing.hash_request_blocks`, ``extra_keys`` =
``(cache_salt,)`` as the KV cache manager does), so :meth:`KVIndex.match` counts exactly the prompt's
leading blocks the instance could reuse. This is the design of llm-d's precise prefix-cache scorer and
NVIDIA Dynamo's KV router (an index of instance -> block hashes fed by vLLM's KV events), in place of a
router that guesses cache contents from what it routed.

Between routing a request and the events of its blocks there is a step and a network hop; a burst of
requests sharing a prefix would all see a miss. :meth:`KVIndex.expect` records the blocks a routed request
will store as *pending* on its instance for ``pending_ttl`` seconds (or until the instance's own events say
otherwise), and :meth:`match` counts them.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional, Sequence

from goodserve.kv_cache.hashing import BlockHash, hash_request_blocks
from goodserve.kv_events.events import AllBlocksCleared, BlockRemoved, BlockStored, InstanceLoad, KVEventBatch


@dataclass
class InstanceCache:
    """What the index knows of one instance.

    Attributes:
        block_size: Tokens per block (from its events; ``None`` until the first store).
        hashes: Hashes of the blocks its prefix cache holds.
        pending: Hashes expected from requests routed there, with their expiry time (seconds, the caller's clock).
        stream_id: The publisher's life this view follows (a new one means a restart: the view starts empty).
        load: The last published load.
    """

    block_size: Optional[int] = None
    hashes: set[bytes] = field(default_factory=set)
    pending: dict[bytes, float] = field(default_factory=dict)
    stream_id: str = ""
    load: Optional[InstanceLoad] = None

    def clear(self) -> None:
        self.hashes.clear()
        self.pending.clear()


class KVIndex:
    """Instance name -> the block hashes of its prefix cache.

    Args:
        default_block_size: Block size assumed for an instance that has stored nothing yet (tokens).
        pending_ttl: Seconds a pending (expected, not yet confirmed) block counts as cached.

    Raises:
        ValueError: if ``default_block_size < 1`` or ``pending_ttl < 0``.
    """

    def __init__(self, default_block_size: int = 16, pending_ttl: float = 10.0) -> None:
        if default_block_size < 1 or pending_ttl < 0:
            raise ValueError("default_block_size must be >= 1 and pending_ttl >= 0")
        self.default_block_size, self.pending_ttl = default_block_size, pending_ttl
        self.instances: dict[str, InstanceCache] = {}

    def instance(self, name: str) -> InstanceCache:
        """The view of ``name`` (created empty on first use)."""
        view = self.instances.get(name)
        if view is None:
            view = self.instances[name] = InstanceCache()
        return view

    def apply(self, name: str, batch: KVEventBatch) -> None:
        """Apply one published batch of instance ``name``, in order. A batch from a new publisher life
        (``stream_id``) or a snapshot starts the view from empty; the load, if any, replaces the last one."""
        view = self.instance(name)
        if batch.snapshot or (batch.stream_id and batch.stream_id != view.stream_id):
            view.clear()
            view.stream_id = batch.stream_id
        for e in batch.events:
            if isinstance(e, BlockStored):
                view.block_size = e.block_size
                view.hashes.update(e.block_hashes)
                for h in e.block_hashes:
                    view.pending.pop(h, None)
            elif isinstance(e, BlockRemoved):
                view.hashes.difference_update(e.block_hashes)
                for h in e.block_hashes:
                    view.pending.pop(h, None)
            elif isinstance(e, AllBlocksCleared):
                view.clear()
        if batch.load is not None:
            view.load = batch.load

    def forget(self, name: str) -> None:
        """Drop everything known of ``name`` (its publisher is gone; a restart replays from scratch)."""
        self.instances.pop(name, None)

    def publishes(self, name: str) -> bool:
        """Whether instance ``name`` has published anything (events or load) in its current life."""
        view = self.instances.get(name)
        return view is not None and bool(view.stream_id or view.block_size or view.load)

    def block_size(self, name: str) -> int:
        """Instance ``name``'s block size (tokens), or the default before it stored anything."""
        view = self.instances.get(name)
        return (view.block_size if view is not None else None) or self.default_block_size

    def block_hashes(self, name: str, token_ids: Sequence[int], cache_salt: Optional[str] = None) -> list[BlockHash]:
        """The chained hashes of ``token_ids``' full blocks at instance ``name``'s block size."""
        return hash_request_blocks(token_ids, self.block_size(name), extra_keys=(cache_salt,))

    def match(self, name: str, hashes: Sequence[bytes], now: float = 0.0) -> int:
        """How many leading blocks of ``hashes`` instance ``name`` holds (or is expected to hold at ``now``)."""
        view = self.instances.get(name)
        if view is None:
            return 0
        n = 0
        for h in hashes:
            if h not in view.hashes and view.pending.get(h, -1.0) < now:
                break
            n += 1
        return n

    def expect(self, name: str, hashes: Sequence[bytes], now: float) -> None:
        """Record ``hashes`` as pending on ``name`` until ``now + pending_ttl`` (a request was routed there);
        expired entries are dropped."""
        view = self.instance(name)
        if view.pending:
            for h in [h for h, t in view.pending.items() if t < now]:
                del view.pending[h]
        until = now + self.pending_ttl
        for h in hashes:
            if h not in view.hashes:
                view.pending[h] = until
