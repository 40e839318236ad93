"""The KV connector's two halves: what the scheduler and the engine core may call, and nothing else.

After vLLM's ``KVConnectorBase_V1`` (``vllm/distributed/kv_transfer/kv_connector/v1/base.py``), in our own
words. A connector is split where the engine is split:

* the **scheduler half** (:class:`KVConnectorScheduler`, torch-free) decides: it validates a request's
  ``kv_transfer_params`` on arrival, says how many prompt tokens a remote prefill brings, records what was
  allocated for them, writes each step's transfer metadata into the :class:`SchedulerOutput`, decides at a
  request's end whether its blocks are held for a consumer (and publishes the handle), and turns the
  transport's news into requests ready, failed, or blocks to free. It owns the holds and pulls in flight,
  so the :class:`~goodserve.scheduler.scheduler.Scheduler` keeps no P/D state of its own; the simulator
  drives the same half with no transport at all.
* the **worker half** (:class:`KVConnectorWorker`) moves bytes: it starts the pulls a step asks for,
  abandons those of aborted requests, and reports which ended. It may import torch and a transport library.

:func:`goodserve.kv_transfer.factory.create_kv_connector` builds both from a
:class:`~goodserve.kv_transfer.config.KVTransferConfig`; nothing outside ``kv_transfer/`` names a transport.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import TYPE_CHECKING, Optional

from goodserve.kv_transfer.messages import KVConnectorOutput, KVConnectorStats, KVConnectorUpdate, KVLoadSpec
from goodserve.kv_transfer.params import KVTransferParams
from goodserve.validation import ParamError

if TYPE_CHECKING:
    from goodserve.request import Request
    from goodserve.scheduler.output import SchedulerOutput


def no_connector_error(params: KVTransferParams) -> ParamError:
    """The error for ``kv_transfer_params`` sent to an instance started without ``--kv-role``."""
    need, flag = ("consumer", "do_remote_prefill") if params.do_remote_prefill else ("producer", "do_remote_decode")
    return ParamError(f"kv_transfer_params: {flag} needs an instance started with --kv-role {need} or both (this "
                      "one: none)", param="kv_transfer_params")


class KVConnectorScheduler(ABC):
    """The scheduler's side of a KV connector. Called by the scheduler only, on the engine thread, at the
    points named below; it never writes a :class:`Request` (the scheduler does, from what it returns)."""

    @abstractmethod
    def check_request(self, request: "Request") -> None:
        """Refuse at arrival ``kv_transfer_params`` this instance cannot serve.

        Raises:
            ParamError: (``param="kv_transfer_params"``) naming what is wrong: a role this instance does not
                have, a handle for a prompt of another length, or blocks too few for its tokens.
        """

    @abstractmethod
    def get_num_new_matched_tokens(self, request: "Request", num_computed_tokens: int) -> Optional[int]:
        """How many prompt tokens after the local prefix-cache hits the connector will bring.

        Args:
            request: The head of the waiting queue, holding no blocks.
            num_computed_tokens: Tokens found in the local prefix cache (a multiple of the block size).

        Returns:
            ``None`` for a request admitted the ordinary way; else the tokens to load (possibly 0): the
            scheduler allocates slots for them without registering their hashes, and the request waits in
            ``WAITING_FOR_REMOTE_KVS`` until the connector reports the load.
        """

    @abstractmethod
    def update_state_after_alloc(self, request: "Request", block_ids: list[int], num_computed_tokens: int,
                                 num_external_tokens: int) -> None:
        """The blocks of a remote prefill are allocated: queue its load for the step's metadata."""

    @abstractmethod
    def build_connector_meta(self, scheduler_output: "SchedulerOutput") -> None:
        """Write the step's transfer metadata into ``scheduler_output`` (``kv_loads``, ``kv_cancels``)."""

    @abstractmethod
    def request_finished(self, request: "Request", block_ids: list[int],
                         now: Optional[float]) -> tuple[bool, Optional[dict]]:
        """A request ends; say whether its blocks must outlive it.

        Args:
            request: The request, still in its last status (e.g. ``WAITING_FOR_REMOTE_KVS``).
            block_ids: Its block table.
            now: When it finished by a stop rule (its output will carry a handle); ``None`` for an abort,
                an error or a stop found downstream.

        Returns:
            ``(delay_free, kv_transfer_params)``: with ``delay_free`` the scheduler does not free the blocks
            (a consumer may read them, or a pull may still write them); the connector later hands the
            request back in :attr:`KVConnectorUpdate.to_free`. ``kv_transfer_params`` is the published
            handle, or ``None``.
        """

    @abstractmethod
    def update_connector_output(self, kv_output: Optional[KVConnectorOutput], now: float) -> KVConnectorUpdate:
        """Apply the transport's news: loads that landed or failed, holds that ended."""

    @abstractmethod
    def take_ended_holds(self, now: float) -> list["Request"]:
        """Holds that ended since the last call: expired at ``now``, released by a consumer or revoked. The
        scheduler frees their blocks."""

    @abstractmethod
    def revoke(self, params: KVTransferParams, now: float) -> bool:
        """End a hold from outside its pull (the client left between the hops), checked against its lease.

        Returns:
            ``True`` if it ended now; ``False`` if a pull is reading it (it ends when that pull does).

        Raises:
            LookupError: no live hold matches the handle (the message says why).
        """

    @abstractmethod
    def num_loading(self) -> int:
        """Unfinished requests waiting for their K/V (they count as unfinished requests)."""

    @abstractmethod
    def has_pending(self) -> bool:
        """Whether holds or loads are open: the engine keeps stepping (an empty step polls the transport)."""

    @abstractmethod
    def stats(self) -> KVConnectorStats:
        """Holds, loads in flight and the counters since start."""


class KVConnectorWorker(ABC):
    """The worker's side of a KV connector: moves bytes, on the engine thread (it may run threads of its
    own). Each load started gets exactly one result from :meth:`poll`, finished or failed. A load failed
    while its transfer may still write into the request's blocks is also named in
    :attr:`KVConnectorOutput.still_writing`, and later, once the transport says the transfer has ended, in
    :attr:`KVConnectorOutput.done_writing`: until then the blocks are not returned to the pool.

    Attributes:
        port: The side-channel port it bound (published in handles).
    """

    port: int

    @abstractmethod
    def start_loads(self, specs: list[KVLoadSpec]) -> None:
        """Start the step's loads (``SchedulerOutput.kv_loads``)."""

    @abstractmethod
    def cancel_loads(self, request_ids: list[str]) -> None:
        """Abandon the loads of aborted requests (``SchedulerOutput.kv_cancels``) as soon as nothing writes
        into their blocks, releasing the producers' holds; each still gets its one result from :meth:`poll`."""

    @abstractmethod
    def poll(self) -> KVConnectorOutput:
        """Advance the transfers and return the news since the last call."""

    @abstractmethod
    def close(self) -> None:
        """Release sockets, threads and registered memory (never memory a running transfer writes into)."""
