"""KV cache events and their wire form (torch-free, I/O-free).

An instance's prefix cache changes in three ways, each an event with vLLM's name and fields (vLLM
``vllm/distributed/kv_events.py``, consumed by llm-d's precise prefix-cache scorer and NVIDIA Dynamo's KV
router):

- :class:`BlockStored`: full blocks became prefix-cache entries, a run of one sequence's chain (hashes in
  order, the parent of the first, the run's token ids and the block size);
- :class:`BlockRemoved`: entries left the cache (evicted for new content, or dropped as never written);
- :class:`AllBlocksCleared`: the whole cache was forgotten (``reset_prefix_cache``).

Events leave an engine in a :class:`KVEventBatch` per step, which also carries the instance's load
(:class:`InstanceLoad`: KV usage, queue, its step-time coefficients) so a router prices each instance from
what it measured. Hashes are the engine's own :data:`~goodserve.kv_cache.hashing.BlockHash` digests (32
bytes), so a router that hashes a prompt with :func:`~goodserve.kv_cache.hashing.hash_request_blocks` finds
exactly the blocks an instance holds.

Wire form: msgpack of plain lists (``[tag, fields...]`` per event), the encoding vLLM's publisher uses
(through msgspec); :func:`decode_batch` rejects anything malformed with ``ValueError``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional, Union


@dataclass(frozen=True)
class BlockStored:
    """Full blocks registered in the prefix cache, in chain order.

    Attributes:
        block_hashes: The blocks' chained hashes (each covers its block and every block before it).
        parent_block_hash: The hash of the block before the first one, ``None`` if the run starts the sequence.
        token_ids: The run's token ids, ``len(block_hashes) * block_size`` of them.
        block_size: Tokens per block.
    """

    block_hashes: tuple[bytes, ...]
    parent_block_hash: Optional[bytes]
    token_ids: tuple[int, ...]
    block_size: int


@dataclass(frozen=True)
class BlockRemoved:
    """Blocks that left the prefix cache (their hashes no longer resolve on this instance)."""

    block_hashes: tuple[bytes, ...]


@dataclass(frozen=True)
class AllBlocksCleared:
    """The instance forgot every prefix-cache entry."""


KVEvent = Union[BlockStored, BlockRemoved, AllBlocksCleared]


@dataclass(frozen=True)
class InstanceLoad:
    """An instance's load after a step.

    Attributes:
        kv_usage: Fraction of KV blocks in use, ``[0, 1]``.
        num_running: Requests in the running batch.
        num_waiting: Requests waiting for admission.
        num_tokens_waiting: Prompt tokens not yet computed (tokens).
        step_coefficients: The scheduler's step-time coefficients, in the order of
            :data:`goodserve.scheduler.step_time.COEFFICIENT_NAMES` (seconds per step, per token, ...).
        token_budget: Tokens one step may compute (``max_num_batched_tokens``).
    """

    kv_usage: float
    num_running: int
    num_waiting: int
    num_tokens_waiting: int
    step_coefficients: tuple[float, ...] = ()
    token_budget: int = 0

    @classmethod
    def of(cls, scheduler: Any) -> "InstanceLoad":
        """The load of a :class:`goodserve.scheduler.scheduler.Scheduler` now (engine and simulator alike)."""
        stats = scheduler.make_stats()
        c = scheduler.step_model.coefficients
        return cls(stats.kv_cache_usage, stats.num_running, stats.num_waiting, stats.num_tokens_waiting,
                   tuple(float(getattr(c, n)) for n in c.__dataclass_fields__),
                   scheduler.scheduler_config.max_num_batched_tokens)


@dataclass(frozen=True)
class KVEventBatch:
    """One publication: the events of one engine step (possibly none) and the load after it.

    Attributes:
        ts: Wall-clock time of publication (seconds since the epoch).
        events: The events, in the order they happened.
        load: The instance's load, if it was sampled with this batch.
        stream_id: Identifies the publisher's life: a new id means a restarted instance (empty cache, sequence
            numbers from 0 again).
    """

    ts: float
    events: tuple[KVEvent, ...] = ()
    load: Optional[InstanceLoad] = None
    stream_id: str = ""
    snapshot: bool = field(default=False)
    """True for a replay's snapshot: the events rebuild the whole cache as of the batch's sequence number."""


def _event_to_list(e: KVEvent) -> list:
    if isinstance(e, BlockStored):
        return ["BlockStored", list(e.block_hashes), e.parent_block_hash, list(e.token_ids), e.block_size]
    if isinstance(e, BlockRemoved):
        return ["BlockRemoved", list(e.block_hashes)]
    if isinstance(e, AllBlocksCleared):
        return ["AllBlocksCleared"]
    raise TypeError(f"not a KV event: {e!r}")


def encode_batch(batch: KVEventBatch) -> bytes:
    """The batch as msgpack bytes."""
    import msgpack  # the server extra's: the KV cache records events without it
    load = None
    if batch.load is not None:
        x = batch.load
        load = [x.kv_usage, x.num_running, x.num_waiting, x.num_tokens_waiting, list(x.step_coefficients),
                x.token_budget]
    return msgpack.packb([batch.ts, [_event_to_list(e) for e in batch.events], load, batch.stream_id,
                          batch.snapshot], use_bin_type=True)


def _hashes(v) -> tuple[bytes, ...]:
    if not isinstance(v, list) or not all(isinstance(h, bytes) for h in v):
        raise ValueError("block_hashes must be a list of bytes")
    return tuple(v)


def _event_from_list(v) -> KVEvent:
    if not isinstance(v, list) or not v:
        raise ValueError(f"an event must be a non-empty list, got {v!r}")
    tag = v[0]
    if tag == "BlockStored" and len(v) == 5:
        _, hashes, parent, tokens, size = v
        if parent is not None and not isinstance(parent, bytes):
            raise ValueError("parent_block_hash must be bytes or nil")
        if not isinstance(tokens, list) or not isinstance(size, int) or size < 1:
            raise ValueError("BlockStored needs a token_ids list and a block_size >= 1")
        hashes = _hashes(hashes)
        if len(tokens) != len(hashes) * size:
            raise ValueError(f"BlockStored has {len(tokens)} token ids for {len(hashes)} blocks of {size}")
        return BlockStored(hashes, parent, tuple(int(t) for t in tokens), size)
    if tag == "BlockRemoved" and len(v) == 2:
        return BlockRemoved(_hashes(v[1]))
    if tag == "AllBlocksCleared" and len(v) == 1:
        return AllBlocksCleared()
    raise ValueError(f"unknown or malformed KV event {tag!r}")


def decode_batch(data: bytes) -> KVEventBatch:
    """Parse :func:`encode_batch`'s bytes.

    Raises:
        ValueError: if ``data`` is not a well-formed batch.
    """
    import msgpack

    try:
        v = msgpack.unpackb(data, raw=False)
    except Exception as e:  # msgpack raises several exception types on bad input
        raise ValueError(f"not a msgpack KV event batch: {e}") from None
    if not isinstance(v, list) or len(v) != 5 or not isinstance(v[1], list):
        raise ValueError("a KV event batch is [ts, events, load, stream_id, snapshot]")
    ts, events, load, stream_id, snapshot = v
    parsed_load = None
    if load is not None:
        if not isinstance(load, list) or len(load) != 6:
            raise ValueError("load must be [kv_usage, running, waiting, tokens_waiting, coefficients, budget]")
        parsed_load = InstanceLoad(float(load[0]), int(load[1]), int(load[2]), int(load[3]),
                                   tuple(float(c) for c in load[4]), int(load[5]))
    return KVEventBatch(float(ts), tuple(_event_from_list(e) for e in events), parsed_load, str(stream_id),
                        bool(snapshot))
