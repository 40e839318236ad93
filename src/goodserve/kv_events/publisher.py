"""The engine's KV event publisher: one batch per step on a ZeroMQ PUB socket, with a replay socket.

Wire protocol (the shape of vLLM's ``ZmqEventPublisher``):

- PUB: three frames per batch, ``[topic, seq, payload]``; ``seq`` is an 8-byte big-endian signed sequence
  number, from 0 in each publisher life; ``payload`` is :func:`~goodserve.kv_events.events.encode_batch`'s.
- Replay (ROUTER): a subscriber that saw a gap (or just connected) sends ``[b"", seq]`` and gets every kept
  batch from ``seq`` on as ``[b"", seq, payload]``, then the end marker ``[b"", -1, b""]``. When ``seq`` is
  older than the oldest kept batch, it gets one *snapshot* instead: a batch with ``snapshot`` set whose
  events store every block the cache holds, numbered with the last published sequence number. A PUB socket
  drops what a slow or absent subscriber misses (ZeroMQ's high-water mark); the replay makes that loss
  visible and repairable.

Publishing never blocks the engine: :meth:`ZmqEventPublisher.publish` queues the batch and a thread owns both
sockets (ZeroMQ sockets are not thread-safe).
"""

from __future__ import annotations

import logging
import queue
import secrets
import threading
import time
from collections import OrderedDict, deque
from typing import Optional, Sequence

import zmq

from goodserve.kv_events.config import KVEventsConfig
from goodserve.kv_events.events import (AllBlocksCleared, BlockRemoved, BlockStored, InstanceLoad, KVEvent,
                                        KVEventBatch, encode_batch)

logger = logging.getLogger(__name__)
END_SEQ = -1


def seq_bytes(seq: int) -> bytes:
    """A sequence number's frame: 8 bytes, big-endian, signed."""
    return seq.to_bytes(8, "big", signed=True)


def seq_of(frame: bytes) -> int:
    """Parse a sequence-number frame.

    Raises:
        ValueError: if the frame is not 8 bytes.
    """
    if len(frame) != 8:
        raise ValueError(f"a sequence number frame is 8 bytes, got {len(frame)}")
    return int.from_bytes(frame, "big", signed=True)


def _bind(sock: zmq.Socket, endpoint: str, patience: float = 2.0) -> None:
    """Bind, retrying for up to ``patience`` seconds while the address is still in use: ZeroMQ closes a
    socket in its I/O thread, so an instance restarted in the same process may find its old port not yet
    released."""
    deadline = time.monotonic() + patience
    while True:
        try:
            sock.bind(endpoint)
            return
        except zmq.ZMQError as e:
            if e.errno != zmq.EADDRINUSE or time.monotonic() > deadline:
                sock.close(linger=0)
                raise
            time.sleep(0.05)


class ZmqEventPublisher:
    """Publishes :class:`KVEventBatch` es (see the module docstring).

    Args:
        config: Endpoints, topic and buffer size.
        context: A ZeroMQ context (default: the process's shared one).

    Raises:
        zmq.ZMQError: if an endpoint cannot be bound (e.g. the port is taken).
    """

    def __init__(self, config: KVEventsConfig, context: Optional[zmq.Context] = None) -> None:
        self.config = config
        self.stream_id = secrets.token_hex(8)
        self._ctx = context or zmq.Context.instance()
        self._pub = self._ctx.socket(zmq.PUB)
        self._pub.setsockopt(zmq.LINGER, 0)
        self._pub.setsockopt(zmq.SNDHWM, 100_000)
        _bind(self._pub, config.endpoint)
        self.endpoint = self._pub.getsockopt_string(zmq.LAST_ENDPOINT)
        self._replay = None
        self.replay_endpoint = None
        if config.replay_endpoint is not None:
            self._replay = self._ctx.socket(zmq.ROUTER)
            self._replay.setsockopt(zmq.LINGER, 0)
            _bind(self._replay, config.replay_endpoint)
            self.replay_endpoint = self._replay.getsockopt_string(zmq.LAST_ENDPOINT)
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._buffer: deque[tuple[int, bytes]] = deque(maxlen=config.buffer_steps)
        self._cached: OrderedDict[bytes, BlockStored] = OrderedDict()  # the cache as published: a snapshot's source
        self._last_load: Optional[InstanceLoad] = None
        self._seq = -1
        self._last_load_ts = -float("inf")
        self._closed = threading.Event()
        self._thread = threading.Thread(target=self._run, name="kv-events-publisher", daemon=True)
        self._thread.start()

    def info(self, block_size: int) -> dict:
        """What ``GET /v1/kv_events`` answers: the bound endpoints, topic, this life's id and the block size."""
        return {"endpoint": self.endpoint, "replay_endpoint": self.replay_endpoint, "topic": self.config.topic,
                "stream_id": self.stream_id, "block_size": block_size}

    def load_due(self) -> bool:
        """Whether a batch carrying only the load would go out now (``load_interval`` has passed)."""
        return time.monotonic() - self._last_load_ts >= self.config.load_interval

    def publish(self, events: Sequence[KVEvent], load: Optional[InstanceLoad] = None) -> None:
        """Queue one batch (returns at once). A batch without events is sent only when its load is due
        (:meth:`load_due`)."""
        if not events and (load is None or not self.load_due()):
            return
        if load is not None:
            self._last_load_ts = time.monotonic()
        self._queue.put(KVEventBatch(time.time(), tuple(events), load, self.stream_id))

    def close(self) -> None:
        """Send what is queued, stop the thread and close the sockets."""
        if not self._closed.is_set():
            self._closed.set()
            self._queue.put(None)
            self._thread.join(timeout=5)

    # ----------------------------------------------------------------------------- the publisher thread
    def _run(self) -> None:
        poller = zmq.Poller()
        if self._replay is not None:
            poller.register(self._replay, zmq.POLLIN)
        try:
            while True:
                if self._replay is not None and poller.poll(0 if not self._queue.empty() else 10):
                    self._serve_replay()
                try:
                    batch = self._queue.get(timeout=0 if self._replay is not None else 0.1)
                except queue.Empty:
                    continue
                if batch is None:
                    return
                self._send(batch)
        except Exception:  # a publisher fault must not go unnoticed, nor take the engine down
            logger.exception("the KV event publisher stopped")
        finally:
            self._pub.close()
            if self._replay is not None:
                self._replay.close()

    def _send(self, batch: KVEventBatch) -> None:
        self._seq += 1
        payload = encode_batch(batch)
        self._buffer.append((self._seq, payload))
        self._mirror(batch)
        self._pub.send_multipart([self.config.topic.encode(), seq_bytes(self._seq), payload])

    def _mirror(self, batch: KVEventBatch) -> None:
        if batch.load is not None:
            self._last_load = batch.load
        for e in batch.events:
            if isinstance(e, BlockStored):
                bs = e.block_size
                parent = e.parent_block_hash
                for i, h in enumerate(e.block_hashes):
                    self._cached[h] = BlockStored((h,), parent, e.token_ids[i * bs:(i + 1) * bs], bs)
                    parent = h
            elif isinstance(e, BlockRemoved):
                for h in e.block_hashes:
                    self._cached.pop(h, None)
            elif isinstance(e, AllBlocksCleared):
                self._cached.clear()

    def _serve_replay(self) -> None:
        while True:
            try:
                frames = self._replay.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            if len(frames) != 3:
                continue  # not our protocol: ignore
            ident = frames[0]
            try:
                start = seq_of(frames[2])
            except ValueError:
                continue
            oldest = self._buffer[0][0] if self._buffer else self._seq + 1
            if start < oldest and self._seq >= 0:
                snap = KVEventBatch(time.time(), tuple(self._cached.values()), self._last_load, self.stream_id,
                                    snapshot=True)
                self._replay.send_multipart([ident, b"", seq_bytes(self._seq), encode_batch(snap)])
            else:
                for seq, payload in self._buffer:
                    if seq >= start:
                        self._replay.send_multipart([ident, b"", seq_bytes(seq), payload])
            self._replay.send_multipart([ident, b"", seq_bytes(END_SEQ), b""])
