"""What the scheduler and the KV connector tell each other each step: plain data, like the scheduler's other
messages (:mod:`goodserve.scheduler.output`)."""

from __future__ import annotations

from dataclasses import dataclass, field

from goodserve.kv_transfer.params import KVTransferParams


@dataclass
class KVLoadSpec:
    """One pull for the consumer's connector to start: tokens ``[start, end)`` of a request's prompt.

    Attributes:
        request_id: The request on this instance.
        block_ids: Its local block table (covers at least ``end`` tokens).
        start: First token to pull (a multiple of the block size: tokens before it were found in the local
            prefix cache).
        end: One past the last token to pull (the prompt's last token is computed locally, for its logits).
        remote: The producer's handle.
    """

    request_id: str
    block_ids: list[int]
    start: int
    end: int
    remote: KVTransferParams


@dataclass
class KVConnectorOutput:
    """The connector's news since the previous step.

    Attributes:
        finished_sending: Producer side: ids of held requests whose blocks a consumer has finished pulling.
        finished_recving: Consumer side: request id -> ``(bytes, seconds)`` of each pull that completed.
        failed_recving: Consumer side: request id -> why its pull failed (the request fails with it).
    """

    finished_sending: list[str] = field(default_factory=list)
    finished_recving: dict[str, tuple[int, float]] = field(default_factory=dict)
    failed_recving: dict[str, str] = field(default_factory=dict)
