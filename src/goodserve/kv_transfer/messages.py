"""What the scheduler and the KV connector tell each other: plain data, like the scheduler's other messages
(:mod:`goodserve.scheduler.output`)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Optional

from goodserve.kv_transfer.params import KVTransferParams

if TYPE_CHECKING:
    from goodserve.request import Request


@dataclass
class KVLoadSpec:
    """One pull for the consumer's connector to start: tokens ``[start, end)`` of a request's prompt.

    Attributes:
        request_id: The request on this instance.
        block_ids: Its local block table (covers at least ``end`` tokens).
        start: First token to pull (a multiple of the block size: tokens before it were found in the local
            prefix cache).
        end: One past the last token to pull (the prompt's last token is computed locally, for its logits).
        remote: The producer's handle (with its lease).
    """

    request_id: str
    block_ids: list[int]
    start: int
    end: int
    remote: KVTransferParams


@dataclass
class KVConnectorOutput:
    """The transport's news since the previous step.

    Attributes:
        finished_sending: Producer side: ids of held requests whose blocks a consumer has finished pulling,
            when the transport (not the lease table) learns it, e.g. the simulator's links.
        finished_recving: Consumer side: request id -> ``(bytes, seconds)`` of each pull that completed.
        failed_recving: Consumer side: request id -> why its pull failed (the request fails with it).
        still_writing: Consumer side: ids in ``failed_recving`` whose READ the transport could not stop and
            may still write into the request's blocks (given up past its deadline, or aborted). The request
            fails at once, but its blocks stay out of the pool (quarantined) until the id comes back in
            ``done_writing``: freed earlier, they could be handed to another request whose K/V the late
            bytes would then overwrite.
        done_writing: Consumer side: ids of earlier ``still_writing`` pulls whose transfer has ended (the
            transport reported it done or failed): their blocks can go back to the pool.
    """

    finished_sending: list[str] = field(default_factory=list)
    finished_recving: dict[str, tuple[int, float]] = field(default_factory=dict)
    failed_recving: dict[str, str] = field(default_factory=dict)
    still_writing: list[str] = field(default_factory=list)
    done_writing: list[str] = field(default_factory=list)


@dataclass
class KVConnectorUpdate:
    """What the scheduler must do after the connector's scheduler half applied the transport's news.

    Attributes:
        loaded: Requests whose prompt K/V (all but the last token) landed, with ``(bytes, seconds)`` of the
            pull: back to the waiting queue with those tokens computed.
        failed: Requests whose pull failed, with why: they fail (``FINISHED_ERROR``).
        to_free: Finished requests whose blocks can go now, with the tokens of valid K/V in them (``None``:
            all), e.g. an aborted request whose pull ended, or a hold that ended.
    """

    loaded: list[tuple["Request", tuple[int, float]]] = field(default_factory=list)
    failed: list[tuple["Request", str]] = field(default_factory=list)
    to_free: list[tuple["Request", Optional[int]]] = field(default_factory=list)


@dataclass(frozen=True)
class KVConnectorStats:
    """The connector's figures (see :class:`goodserve.scheduler.output.SchedulerStats`, which carries them).

    Attributes:
        num_blocks_held: Blocks of finished requests held for a consumer's pull (producer).
        num_loads_in_flight: Pulls not yet ended, aborted requests' included (consumer).
        num_failures: Pulls that failed (consumer).
        num_blocks_quarantined: Blocks of failed or aborted pulls kept out of the pool because their READ
            may still write into them (consumer; see :attr:`KVConnectorOutput.still_writing`).
        holds_ended: Holds ended since start by reason: ``pulled``, ``aborted``, ``failed``, ``expired``
            (producer).
    """

    num_blocks_held: int = 0
    num_loads_in_flight: int = 0
    num_failures: int = 0
    num_blocks_quarantined: int = 0
    holds_ended: dict[str, int] = field(default_factory=dict)
