"""The router's side of KV events: one asyncio task per instance subscribes to its publisher and keeps the
:class:`~goodserve.kv_events.index.KVIndex` current, replaying what it missed.

On start, and whenever a sequence number skips ahead (ZeroMQ dropped batches, or the subscriber joined
late), the subscriber asks the instance's replay socket for everything from the first batch it lacks
(:mod:`goodserve.kv_events.publisher`, wire protocol); a batch from a new publisher life (another
``stream_id``: the instance restarted, its cache empty) resets that instance's view and replays the new life
from sequence number 0. Live batches that arrive during a replay are applied after it, those already
covered skipped.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from typing import Optional

import zmq
import zmq.asyncio

from goodserve.kv_events.events import KVEventBatch, decode_batch
from goodserve.kv_events.index import KVIndex
from goodserve.kv_events.publisher import END_SEQ, seq_bytes, seq_of

logger = logging.getLogger(__name__)


class KVEventSubscriber:
    """Follows one instance's KV events into ``index`` under ``name``.

    Args:
        name: The instance's key in the index (the router uses the backend URL).
        endpoint: The publisher's PUB address.
        replay_endpoint: Its replay address (``None``: gaps are logged, not repaired).
        index: The index to keep current.
        topic: The topic to subscribe to.
        replay_timeout: Seconds to wait for a replay's answer before trying again later.
    """

    def __init__(self, name: str, endpoint: str, replay_endpoint: Optional[str], index: KVIndex,
                 topic: str = "", replay_timeout: float = 2.0,
                 context: Optional[zmq.asyncio.Context] = None) -> None:
        self.name, self.endpoint, self.replay_endpoint, self.index = name, endpoint, replay_endpoint, index
        self.topic, self.replay_timeout = topic, replay_timeout
        self._ctx = context or zmq.asyncio.Context.instance()
        self.last_seq = -1  # the last sequence number applied, in the current stream
        self.stream_id: Optional[str] = None
        self.num_batches = self.num_replays = self.num_gaps = 0
        self._task: Optional[asyncio.Task] = None

    def start(self) -> None:
        """Start following in the running event loop (idempotent)."""
        if self._task is None:
            self._task = asyncio.get_running_loop().create_task(self._run())

    async def close(self) -> None:
        """Stop following."""
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None

    def _apply(self, seq: int, batch: KVEventBatch) -> None:
        self.index.apply(self.name, batch)
        self.last_seq, self.stream_id = seq, batch.stream_id
        self.num_batches += 1

    async def _replay(self, start: int) -> bool:
        """Ask for every batch from ``start`` and apply it; whether an answer came."""
        if self.replay_endpoint is None:
            return False
        sock = self._ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.connect(self.replay_endpoint)
        self.num_replays += 1
        try:
            await sock.send_multipart([b"", seq_bytes(start)])
            while True:
                frames = await asyncio.wait_for(sock.recv_multipart(), self.replay_timeout)
                if len(frames) != 3:
                    continue
                seq = seq_of(frames[1])
                if seq == END_SEQ:
                    return True
                batch = decode_batch(frames[2])
                if batch.snapshot or seq > self.last_seq or batch.stream_id != self.stream_id:
                    self._apply(seq, batch)
        except (asyncio.TimeoutError, ValueError, zmq.ZMQError) as e:
            logger.debug("KV event replay from %s failed: %s", self.name, e)
            return False
        finally:
            sock.close()

    async def _run(self) -> None:
        sub = self._ctx.socket(zmq.SUB)
        sub.setsockopt(zmq.LINGER, 0)
        sub.setsockopt(zmq.RCVHWM, 100_000)
        sub.setsockopt_string(zmq.SUBSCRIBE, self.topic)
        sub.connect(self.endpoint)
        try:
            await self._replay(0)  # what was published before we joined
            while True:
                frames = await sub.recv_multipart()
                if len(frames) != 3:
                    continue
                try:
                    seq, batch = seq_of(frames[1]), decode_batch(frames[2])
                except ValueError as e:
                    logger.warning("dropping a malformed KV event batch from %s: %s", self.name, e)
                    continue
                if batch.stream_id != self.stream_id:  # a new publisher life: its cache starts empty
                    if self.stream_id is not None:
                        logger.warning("KV events of %s: a new publisher (restarted); replaying its events",
                                       self.name)
                    self.index.forget(self.name)
                    self.stream_id, self.last_seq = batch.stream_id, -1
                if seq <= self.last_seq:
                    continue
                if seq > self.last_seq + 1:
                    self.num_gaps += 1
                    if not await self._replay(self.last_seq + 1):
                        logger.warning("KV events of %s: batches %d-%d lost and not replayed; its index may be "
                                       "stale until its entries are evicted", self.name, self.last_seq + 1, seq - 1)
                    if seq <= self.last_seq:
                        continue
                self._apply(seq, batch)
        finally:
            sub.close()
