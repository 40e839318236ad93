"""A producer's holds as leases: which finished requests' KV blocks a consumer may read, and until when.

A handle published in ``kv_transfer_params`` names blocks on the producer. Once its hold ends (a consumer
pulled it, the client left, or nobody came within the timeout) those blocks go back to the pool and the
next request writes into them. A consumer reading them after that would decode another request's prompt
and answer 200 with text that is not the client's (case C20). So a handle is a **lease**: the request id,
its block ids, and a random nonce only the producer and the handle's holder know. The producer validates
every pull against a live lease before the consumer reads, and *pins* the hold while the read runs, so it
cannot expire under it.

States of one hold::

    grant ──> live ──claim──> pinned ──release──> ended (pulled | aborted | failed)
               │                 └── pin deadline passes ──> ended (expired)
               ├── deadline passes ──> ended (expired)
               └── release / revoke ──> ended (aborted, or the puller's reason)

``ended`` holds are queued for the scheduler (:meth:`LeaseTable.take_ended`), which frees their blocks on
the engine thread; the side-channel thread that answers consumers only changes lease states. Every method
takes ``now`` (seconds, the engine's monotonic clock) so that expiry is exact in tests and simulations, and
every method holds one lock: the table is shared by the engine thread and the side-channel thread.
"""

from __future__ import annotations

import math
import secrets
import threading
from collections import Counter, OrderedDict
from dataclasses import dataclass
from typing import Callable, Optional

#: Why a hold ended: a consumer pulled it; the request was aborted (client gone on either hop, or the
#: consumer gave up its pull); the consumer's pull failed; nobody pulled (or finished a pull) in time.
END_REASONS = ("pulled", "aborted", "failed", "expired")
#: Reasons a consumer (or the router) may give when it releases a hold.
RELEASE_REASONS = ("pulled", "aborted", "failed")


class LeaseError(Exception):
    """A claim or release the producer refuses: no live hold matches it. The message names the request and
    why (expired, released, unknown, stale or forged) and is shown to the consumer's client."""


@dataclass(frozen=True)
class Lease:
    """One hold's identity, as its handle publishes it.

    Attributes:
        request_id: The request on the producer.
        block_ids: Its block table on the producer, first token's block first.
        num_tokens: Prompt tokens whose K/V the blocks hold.
        nonce: 32 random hex digits (128 bits); a handle that does not carry it is refused.
    """

    request_id: str
    block_ids: tuple[int, ...]
    num_tokens: int
    nonce: str


@dataclass
class _Hold:
    lease: Lease
    deadline: float  # it expires at this time unless a pull has claimed it
    pinned_until: Optional[float] = None  # claimed: a pull is reading; the pin ends by this time at the latest


class LeaseTable:
    """The producer's live holds, thread-safe.

    Args:
        ttl: Seconds a hold lives unclaimed (``--kv-transfer-timeout``; ``inf`` in the simulator, whose links
            never fail).
        pin_ttl: Seconds a claim pins a hold (default ``ttl``): a consumer that claimed and died is not
            waited for longer. The consumer gives its read up before the pin ends (the claim's answer says
            how long it is).
        history: Ended holds remembered (LRU) so that a late claim is told *why* it is refused.
        make_nonce: Makes nonces (tests pass a deterministic one).

    Raises:
        ValueError: if ``ttl`` or ``pin_ttl`` is not positive.
    """

    def __init__(self, ttl: float, pin_ttl: Optional[float] = None, history: int = 4096,
                 make_nonce: Callable[[], str] = lambda: secrets.token_hex(16)) -> None:
        pin_ttl = ttl if pin_ttl is None else pin_ttl
        if not (ttl > 0 and pin_ttl > 0):
            raise ValueError(f"lease ttl and pin_ttl must be > 0 seconds, got {ttl} and {pin_ttl}")
        self.ttl, self.pin_ttl = ttl, pin_ttl
        self._history_size = history
        self._make_nonce = make_nonce
        self._lock = threading.Lock()
        self._holds: dict[str, _Hold] = {}
        self._ended: list[tuple[str, str]] = []  # (request id, reason), not yet taken by the scheduler
        self._history: OrderedDict[str, tuple[str, str]] = OrderedDict()  # request id -> (nonce, reason)
        self._counts: Counter[str] = Counter()

    # ------------------------------------------------------------------------------------ engine thread
    def grant(self, request_id: str, block_ids: list[int] | tuple[int, ...], num_tokens: int, now: float) -> Lease:
        """Start a hold of ``block_ids`` for ``request_id``, live until ``now + ttl``.

        Raises:
            RuntimeError: if the request already holds a live lease (a broken invariant).
        """
        lease = Lease(request_id, tuple(block_ids), num_tokens, self._make_nonce())
        with self._lock:
            if request_id in self._holds:
                raise RuntimeError(f"request {request_id} already holds a KV lease")
            self._holds[request_id] = _Hold(lease, now + self.ttl)
            self._history.pop(request_id, None)
        return lease

    def expire(self, now: float) -> list[str]:
        """End the holds whose time ran out at ``now``: unclaimed past their deadline, or pinned past the pin.

        Returns:
            Their request ids (also queued for :meth:`take_ended`, reason ``"expired"``).
        """
        with self._lock:
            gone = [rid for rid, h in self._holds.items()
                    if now >= (h.deadline if h.pinned_until is None else h.pinned_until)]
            for rid in gone:
                self._end(rid, "expired")
        return gone

    def drop(self, request_id: str, reason: str) -> bool:
        """End a hold without checking a lease: the transport itself reported its end (the simulator's links),
        or the producer's own engine ends it. Returns whether it was live."""
        with self._lock:
            if request_id not in self._holds:
                return False
            self._end(request_id, reason)
            return True

    def take_ended(self) -> list[tuple[str, str]]:
        """The ``(request id, reason)`` of every hold that ended since the last call, in order."""
        with self._lock:
            ended, self._ended = self._ended, []
        return ended

    # ------------------------------------------------------------------------ side channel, HTTP route
    def claim(self, request_id: str, nonce: str, block_ids: list[int] | tuple[int, ...], now: float) -> float:
        """Pin a live hold for one pull: it cannot expire until the pull releases it or the pin ends.

        Returns:
            Seconds the pin lasts from ``now`` (``pin_ttl``): the consumer must finish reading before then.

        Raises:
            LeaseError: no live, unclaimed hold matches (see :meth:`_live`); a claim of an expired hold ends it.
        """
        with self._lock:
            hold = self._live(request_id, nonce, block_ids, now)
            if hold.pinned_until is not None:
                raise LeaseError(f"the KV hold of request {request_id} is already being pulled (a handle serves "
                                 "one pull)")
            hold.pinned_until = now + self.pin_ttl
            return self.pin_ttl

    def release(self, request_id: str, nonce: str, reason: str, now: float) -> None:
        """End a hold by its puller (after the read, or instead of it), claimed or not.

        Raises:
            ValueError: if ``reason`` is not one of :data:`RELEASE_REASONS`.
            LeaseError: no live hold matches ``request_id`` and ``nonce``.
        """
        if reason not in RELEASE_REASONS:
            raise ValueError(f"release reason must be one of {RELEASE_REASONS}, got {reason!r}")
        with self._lock:
            self._live(request_id, nonce, None, now)
            self._end(request_id, reason)

    def revoke(self, request_id: str, nonce: str, block_ids: Optional[tuple[int, ...]], now: float) -> bool:
        """End a hold from outside its pull (the client left between the hops): at once unless a pull has
        claimed it, whose read may be running (it then ends when that pull releases it, or by its pin).

        Returns:
            ``True`` if the hold ended now (reason ``"aborted"``), ``False`` if a pull holds it.

        Raises:
            LeaseError: no live hold matches.
        """
        with self._lock:
            hold = self._live(request_id, nonce, block_ids, now)
            if hold.pinned_until is not None:
                return False
            self._end(request_id, "aborted")
            return True

    # ------------------------------------------------------------------------------------------ reading
    def __contains__(self, request_id: str) -> bool:
        with self._lock:
            return request_id in self._holds

    def __len__(self) -> int:
        with self._lock:
            return len(self._holds)

    def is_pinned(self, request_id: str) -> bool:
        """Whether a pull has claimed the request's live hold."""
        with self._lock:
            hold = self._holds.get(request_id)
            return hold is not None and hold.pinned_until is not None

    def counts(self) -> dict[str, int]:
        """Holds ended since start, by reason (every one of :data:`END_REASONS`, zeros included)."""
        with self._lock:
            return {r: self._counts[r] for r in END_REASONS}

    # ---------------------------------------------------------------------------------------- internal
    def _live(self, request_id: str, nonce: str, block_ids: Optional[tuple[int, ...] | list[int]],
              now: float) -> _Hold:
        """The live hold ``request_id``'s handle names (lock held).

        Raises:
            LeaseError: unknown request id, a nonce or block ids other than the lease's (stale or forged), or
                a hold that ended (its reason named) or whose deadline passed (it ends here as expired).
        """
        hold = self._holds.get(request_id)
        if hold is None:
            past = self._history.get(request_id)
            if past is None:
                raise LeaseError(f"no KV hold of request {request_id} on this producer (unknown request id: a "
                                 "stale or forged handle)")
            if not secrets.compare_digest(past[0], str(nonce)):
                raise LeaseError(f"the lease does not match the KV hold of request {request_id} (a stale or "
                                 "forged handle)")
            what = "expired: nobody pulled it in time" if past[1] == "expired" else f"was released ({past[1]})"
            raise LeaseError(f"the KV hold of request {request_id} {what}; its blocks may belong to another "
                             "request now")
        lease = hold.lease
        if not secrets.compare_digest(lease.nonce, str(nonce)):
            raise LeaseError(f"the lease does not match the KV hold of request {request_id} (a stale or forged "
                             "handle)")
        if block_ids is not None and tuple(block_ids) != lease.block_ids:
            raise LeaseError(f"the handle names blocks {list(block_ids)[:8]} but request {request_id} holds "
                             f"{list(lease.block_ids)[:8]} (a forged handle)")
        if hold.pinned_until is None and now >= hold.deadline:
            self._end(request_id, "expired")
            raise LeaseError(f"the KV hold of request {request_id} expired: nobody pulled it within "
                             f"{_seconds(self.ttl)}; its blocks may belong to another request now")
        return hold

    def _end(self, request_id: str, reason: str) -> None:
        """Move a live hold to the ended queue and the history (lock held)."""
        hold = self._holds.pop(request_id)
        self._ended.append((request_id, reason))
        self._counts[reason] += 1
        self._history[request_id] = (hold.lease.nonce, reason)
        while len(self._history) > self._history_size:
            self._history.popitem(last=False)


def _seconds(s: float) -> str:
    return "ever" if math.isinf(s) else f"{s:g} s"
