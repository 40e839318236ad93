"""The side channel between a consumer and a producer: small JSON messages over pyzmq REQ/REP, the
producer's lease checks on its own thread, the consumer's requests without blocking the engine loop.

Why claim and release, and not a notification on the READ: a NIXL READ is one-sided, the producer's memory
is read without any code of the producer running, so it cannot refuse a read of blocks whose hold has
ended. The consumer therefore asks first:

1. ``claim`` ``{request_id, lease, block_ids, engine_id}`` -> ``{ok, pin_s}``: the producer checks the
   handle against a live hold (:meth:`LeaseTable.claim`: same request, nonce and blocks, not expired) and
   *pins* it for ``pin_s`` seconds, so it cannot expire under the read. A refusal (``{ok: false, error}``)
   fails the consumer's request with the producer's reason; nothing is read. The consumer reads only if the
   claim's answer came back within ``pin_s`` of when it sent it, and gives the read up once that time has
   passed, so it never reads unpinned blocks. The first claim to a producer also asks for its memory layout
   and NIXL agent metadata (``layout: true``), saving a round trip.
2. ``release`` ``{request_id, lease, reason}`` -> ``{ok}``: after the read (``pulled``), or instead of it
   (``aborted``: the consumer's request was aborted; ``failed``: it could not read). The producer frees the
   blocks at its next step. A release that is lost leaves the hold pinned until ``pin_s`` passes.

Each message is one JSON object; each answer carries ``ok``. The producer answers from its side-channel
thread (the lease table is thread-safe), so a claim never waits for an engine step; the consumer's sockets
are polled by the engine thread at each step (:meth:`SideChannelClient.poll`, never blocking).
"""

from __future__ import annotations

import json
import logging
import threading
import time
from typing import Any, Callable, Hashable, Optional

from goodserve.kv_transfer.lease import LeaseError, LeaseTable

logger = logging.getLogger(__name__)


def answer(msg: Any, engine_id: str, leases: Optional[LeaseTable], layout: dict, now: float) -> dict:
    """The producer's answer to one side-channel message (pure but for the lease table it updates).

    Args:
        msg: The decoded message.
        engine_id: This producer's id (a claim names the producer it means).
        leases: Its holds (``None`` on an instance that is not a producer: every claim is refused).
        layout: ``{"layout": ..., "metadata": ...}``: added to a claim's answer that asks for it.
        now: The engine's monotonic clock (seconds).
    """
    if not isinstance(msg, dict) or msg.get("op") not in ("claim", "release", "layout"):
        return {"ok": False, "error": "unknown side-channel message"}
    if msg["op"] == "layout":
        return {"ok": True, **layout}
    if msg.get("engine_id") not in (None, engine_id):
        return {"ok": False, "error": f"this side channel is producer {engine_id}, not {msg.get('engine_id')}"}
    if leases is None:
        return {"ok": False, "error": f"instance {engine_id} is not a producer: it holds no KV for pulls"}
    try:
        rid, nonce = str(msg["request_id"]), str(msg["lease"])
        if msg["op"] == "claim":
            pin_s = leases.claim(rid, nonce, [int(b) for b in msg["block_ids"]], now)
            return {"ok": True, "pin_s": pin_s, **(layout if msg.get("layout") else {})}
        leases.release(rid, nonce, str(msg.get("reason", "pulled")), now)
        return {"ok": True}
    except (LeaseError, ValueError, KeyError, TypeError) as e:
        return {"ok": False, "error": str(e) if isinstance(e, (LeaseError, ValueError)) else f"bad message: {e!r}"}


class SideChannelServer:
    """The producer's end: a REP socket answered by a thread of its own.

    Args:
        context: The pyzmq context.
        host: Address to bind (``127.0.0.1`` unless the config says otherwise).
        port: TCP port; ``0`` picks a free one (see :attr:`port`).
        engine_id: This instance's id.
        leases: Its lease table (``None``: not a producer).
        layout: What a claim asking for the layout gets (JSON-serialisable).
        clock: Seconds on the engine's clock.
    """

    def __init__(self, context: Any, host: str, port: int, engine_id: str, leases: Optional[LeaseTable],
                 layout: dict, clock: Callable[[], float] = time.monotonic) -> None:
        import zmq

        self._rep = context.socket(zmq.REP)
        self._rep.setsockopt(zmq.LINGER, 0)
        address = f"tcp://{host}"
        if port == 0:
            self.port = self._rep.bind_to_random_port(address)
        else:
            self._rep.bind(f"{address}:{port}")
            self.port = port
        self._engine_id, self._leases, self._layout, self._clock = engine_id, leases, layout, clock
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._serve, name="goodserve-kv-side-channel", daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        import zmq

        poller = zmq.Poller()
        poller.register(self._rep, zmq.POLLIN)
        while not self._stop.is_set():
            if not poller.poll(100):
                continue
            raw = self._rep.recv()
            try:
                msg = json.loads(raw)
            except ValueError:
                msg = None
            try:
                reply = answer(msg, self._engine_id, self._leases, self._layout, self._clock())
            except Exception as e:  # noqa: BLE001 - a REP socket must answer, or it serves nobody again
                logger.exception("side channel: answering %r failed", raw[:200])
                reply = {"ok": False, "error": f"the producer failed: {type(e).__name__}"}
            self._rep.send(json.dumps(reply).encode())

    def close(self) -> None:
        self._stop.set()
        self._thread.join(1.0)
        self._rep.close()


class SideChannelClient:
    """The consumer's end: one REQ socket per message in flight, polled without blocking.

    Args:
        context: The pyzmq context.
    """

    def __init__(self, context: Any) -> None:
        self._context = context
        self._pending: list[tuple[Any, float, Hashable]] = []  # (socket, deadline, tag)

    def send(self, host: str, port: int, msg: dict, deadline: float, tag: Hashable) -> None:
        """Send ``msg`` to the producer at ``host:port``; its answer (or ``None`` past ``deadline``) comes back
        from :meth:`poll` under ``tag``."""
        import zmq

        sock = self._context.socket(zmq.REQ)
        sock.setsockopt(zmq.LINGER, 0)
        sock.connect(f"tcp://{host}:{port}")
        sock.send(json.dumps(msg).encode())
        self._pending.append((sock, deadline, tag))

    def poll(self, now: float) -> list[tuple[Hashable, Optional[dict]]]:
        """The answers that arrived, and ``None`` for each message whose deadline passed unanswered."""
        import zmq

        if not self._pending:
            return []
        got, still = [], []
        for sock, deadline, tag in self._pending:
            if sock.poll(0, zmq.POLLIN):
                try:
                    reply = json.loads(sock.recv())
                except ValueError:
                    reply = {"ok": False, "error": "the producer's answer is not JSON"}
                got.append((tag, reply))
                sock.close()
            elif now >= deadline:
                got.append((tag, None))
                sock.close()
            else:
                still.append((sock, deadline, tag))
        self._pending = still
        return got

    def __len__(self) -> int:
        return len(self._pending)

    def close(self) -> None:
        for sock, _, _ in self._pending:
            sock.close()
        self._pending = []
