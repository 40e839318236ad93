"""The scheduler's side of disaggregated serving: where it calls the KV connector's scheduler half.

The connector (:class:`~goodserve.kv_transfer.base.KVConnectorScheduler`) owns the holds and the pulls;
this mixin is the part of :class:`~goodserve.scheduler.scheduler.Scheduler` that applies what it decides
to the requests and the KV pool (the scheduler stays the only writer of a :class:`Request`), at named
points only: a request's ``kv_transfer_params`` checked on arrival; a remote prefill's matched tokens
allocated (without registering their hashes) while the request waits in ``WAITING_FOR_REMOTE_KVS``; the
blocks of holds that ended freed before each step; and the connector's update after each step applied
(K/V landed: back to the waiting queue; failed: the request fails; blocks released: freed).
"""

from __future__ import annotations

from typing import Optional

from goodserve.kv_cache.manager import KVCacheManager
from goodserve.kv_transfer.base import KVConnectorScheduler, no_connector_error
from goodserve.kv_transfer.messages import KVConnectorStats, KVConnectorUpdate
from goodserve.kv_transfer.params import KVTransferParams
from goodserve.request import Request, RequestStatus
from goodserve.scheduler.output import EngineCoreOutput, SchedulerOutput
from goodserve.scheduler.queue import RequestQueue
from goodserve.validation import ParamError


class RemoteKVMixin:
    """KV connector hooks of the scheduler (and its ``_finish``)."""

    kv_connector: Optional[KVConnectorScheduler]
    kv_cache_manager: KVCacheManager
    waiting: RequestQueue

    def has_pending_kv_transfers(self) -> bool:
        """Whether blocks are held for a consumer's pull or a pull is in flight: the engine must keep
        stepping (an empty step polls the connector) even when no request can run."""
        return self.kv_connector is not None and self.kv_connector.has_pending()

    def _check_kv_transfer(self, request: Request) -> None:
        """Refuse ``kv_transfer_params`` this instance cannot serve (``ValueError`` naming them)."""
        if request.kv_transfer_params is not None:
            if self.kv_connector is None:
                raise no_connector_error(request.kv_transfer_params)
            self.kv_connector.check_request(request)

    def _admit_remote_prefill(self, out: SchedulerOutput, req: Request, hit_blocks: list[int], num_hit: int,
                              now: float) -> tuple[bool, Optional[int]]:
        """Consumer side, for the head of the waiting queue: if the connector brings some of its prompt,
        allocate blocks for the local prefix-cache hits and the tokens it brings (their hashes are registered
        once they land), and leave the request in ``WAITING_FOR_REMOTE_KVS``.

        Returns:
            ``(False, None)`` if the connector brings nothing (admit it as usual); else ``(True, 0)`` (no
            tokens are computed this step), or ``(True, None)`` if its blocks do not fit.
        """
        num_remote = self.kv_connector.get_num_new_matched_tokens(req, num_hit)
        if num_remote is None:
            return False, None
        kv = self.kv_cache_manager
        if kv.allocate_slots(req, num_remote, hit_blocks, cache=False) is None:
            return True, None
        self.waiting.pop()
        req.num_computed_tokens = num_hit
        req.first_scheduled_time = now
        req.num_cached_tokens = num_hit
        kv.record_prefix_cache_lookup(req.num_tokens, num_hit)
        out.num_prefix_cached_tokens += num_hit
        req.status = RequestStatus.WAITING_FOR_REMOTE_KVS
        self.kv_connector.update_state_after_alloc(req, kv.get_block_ids(req.request_id), num_hit, num_remote)
        return True, 0

    def _apply_kv_update(self, update: KVConnectorUpdate, now: float, outputs: list[EngineCoreOutput]) -> None:
        """Free what the connector released; a request whose K/V landed goes back to the waiting queue with its
        prompt but the last token computed; one whose pull failed fails."""
        kv = self.kv_cache_manager
        for req, num_valid in update.to_free:
            kv.free(req, num_valid_tokens=num_valid)
        for req, transfer in update.loaded:
            req.num_computed_tokens = req.num_prompt_tokens - 1
            req.kv_transfer = transfer
            kv.cache_blocks(req, req.num_computed_tokens)
            req.status = RequestStatus.WAITING
            self.waiting.prepend(req)
        for req, error in update.failed:
            self._finish(req, RequestStatus.FINISHED_ERROR)
            outputs.append(EngineCoreOutput.of(req, [], now, error=error))

    def _free_ended_holds(self, now: float) -> None:
        """Free the blocks of holds that ended (expired, released, pulled)."""
        for req in self.kv_connector.take_ended_holds(now):
            self.kv_cache_manager.free(req)

    def release_kv_hold(self, params: KVTransferParams, now: float) -> bool:
        """Producer: end the hold a handle names at once, from outside its pull (the client left between the
        hops), checked against its lease.

        Returns:
            ``True`` if its blocks were freed now; ``False`` if a consumer's pull is reading them (they go
            when it ends).

        Raises:
            ParamError: if this instance holds no KV for pulls.
            LookupError: if no live hold matches the handle (the message says why).
        """
        if self.kv_connector is None:
            raise ParamError("kv_transfer_params: this instance holds no KV for pulls (started without --kv-role "
                             "producer)", param="kv_transfer_params")
        released = self.kv_connector.revoke(params, now)
        self._free_ended_holds(now)
        return released

    def _kv_transfer_stats(self) -> dict:
        """The connector's figures, as :class:`~goodserve.scheduler.output.SchedulerStats` fields."""
        c = self.kv_connector.stats() if self.kv_connector is not None else KVConnectorStats()
        return dict(num_blocks_held_for_pull=c.num_blocks_held, num_kv_transfers_in_flight=c.num_loads_in_flight,
                    num_kv_blocks_quarantined=c.num_blocks_quarantined,
                    num_kv_transfer_timeouts_total=c.holds_ended.get("expired", 0),
                    num_kv_transfer_failures_total=c.num_failures, num_kv_holds_ended_total=dict(c.holds_ended))
