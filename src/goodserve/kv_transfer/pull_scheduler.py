"""The scheduler half of a pull connector: the producer holds a finished prefill's blocks under a lease, the
consumer pulls them into blocks of its own. Torch-free: the engine and the simulator run it alike.

Producer: a request sent with ``do_remote_decode`` that finishes by a stop rule keeps its blocks; a lease
(:mod:`goodserve.kv_transfer.lease`) is granted for them and its handle becomes the output's
``kv_transfer_params``. The blocks are freed when the hold ends: a consumer released it after its pull (or
gave up), the router revoked it (the client left between the hops), or its time ran out.

Consumer: a request sent with a handle (``do_remote_prefill``) is admitted into ``WAITING_FOR_REMOTE_KVS``
with blocks for its prompt but the last token (local prefix-cache hits kept); the step's
:attr:`SchedulerOutput.kv_loads` asks the worker half to pull the rest. When the pull lands the request
goes back to the waiting queue with those tokens computed, computes its last prompt token (whose logits
give the first output token) and decodes like any request (vLLM v1's ``WAITING_FOR_REMOTE_KVS`` works the
same way). A request aborted while its pull runs keeps its blocks until the pull ends (it may still be
writing into them), and ``kv_cancels`` tells the worker to give the pull up and release the producer's hold.

Quarantine: a pull the worker gives up while its READ may still be writing (past its deadline, or aborted
and past it) is reported failed at once, so the request fails without waiting, and ``still_writing``; its
blocks stay allocated to the finished request, out of the pool (so :meth:`KVCacheManager.check_integrity`
counts them in use), until the worker reports the transfer ended (``done_writing``). Freed earlier, they
could go to another request whose K/V the late bytes would overwrite: silent wrong output.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Optional

from goodserve.kv_transfer.base import KVConnectorScheduler
from goodserve.kv_transfer.config import KVTransferConfig
from goodserve.kv_transfer.lease import LeaseError, LeaseTable
from goodserve.kv_transfer.messages import KVConnectorOutput, KVConnectorStats, KVConnectorUpdate, KVLoadSpec
from goodserve.kv_transfer.params import KVTransferParams
from goodserve.validation import ParamError

if TYPE_CHECKING:
    from goodserve.request import Request
    from goodserve.scheduler.output import SchedulerOutput

logger = logging.getLogger(__name__)


class PullConnectorScheduler(KVConnectorScheduler):
    """Holds (producer) and pulls (consumer) of one instance.

    Args:
        config: The instance's role, engine id, the host and port its handles publish, the timeout.
        block_size: Tokens per KV block (a handle's blocks must hold its tokens).
        leases: The producer's lease table, shared with the worker half that answers consumers (a fresh one
            when ``None``: the simulator, scheduler tests).
    """

    def __init__(self, config: KVTransferConfig, block_size: int, leases: Optional[LeaseTable] = None) -> None:
        self.config, self.block_size = config, block_size
        self.leases = leases if leases is not None else LeaseTable(config.timeout)
        self._held: dict[str, tuple["Request", int]] = {}  # request id -> (request, its blocks)
        # request id -> (request, its blocks), for pulls in flight of waiting requests, of requests already
        # aborted, and of finished requests whose given-up READ may still write into their blocks
        self._recving: dict[str, tuple["Request", int]] = {}
        self._recving_finished: dict[str, tuple["Request", int]] = {}
        self._quarantined: dict[str, tuple["Request", int]] = {}
        self._loads: list[KVLoadSpec] = []  # for the next step's metadata
        self._cancels: list[str] = []
        self.num_failures = 0

    # ------------------------------------------------------------------------------------------ intake
    def check_request(self, request: "Request") -> None:
        p = request.kv_transfer_params
        if p is None:
            return
        c = self.config
        if p.do_remote_decode and not c.is_producer:
            raise ParamError(f"kv_transfer_params: do_remote_decode needs an instance started with --kv-role "
                             f"producer or both (this one: {c.role})", param="kv_transfer_params")
        if not p.do_remote_prefill:
            return
        if not c.is_consumer:
            raise ParamError(f"kv_transfer_params: do_remote_prefill needs an instance started with --kv-role "
                             f"consumer or both (this one: {c.role})", param="kv_transfer_params")
        if p.remote_num_tokens != request.num_prompt_tokens:
            raise ParamError(f"kv_transfer_params: the producer holds K/V for {p.remote_num_tokens} tokens but "
                             f"this prompt has {request.num_prompt_tokens}; send the same prompt to both",
                             param="kv_transfer_params")
        if len(p.remote_block_ids) * self.block_size < p.remote_num_tokens:
            raise ParamError(f"kv_transfer_params: {len(p.remote_block_ids)} remote blocks cannot hold "
                             f"{p.remote_num_tokens} tokens at block_size {self.block_size} (producer and consumer "
                             "must use the same block size)", param="kv_transfer_params")

    # ------------------------------------------------------------------------------- consumer: pulls
    def get_num_new_matched_tokens(self, request: "Request", num_computed_tokens: int) -> Optional[int]:
        p = request.kv_transfer_params
        if p is None or not p.do_remote_prefill or request.first_scheduled_time is not None:
            return None  # an ordinary request, or one recomputed after a preemption
        return max(0, request.num_prompt_tokens - 1 - num_computed_tokens)

    def update_state_after_alloc(self, request: "Request", block_ids: list[int], num_computed_tokens: int,
                                 num_external_tokens: int) -> None:
        rid = request.request_id
        self._recving[rid] = (request, len(block_ids))
        self._loads.append(KVLoadSpec(rid, list(block_ids), num_computed_tokens,
                                      num_computed_tokens + num_external_tokens, request.kv_transfer_params))

    def build_connector_meta(self, scheduler_output: "SchedulerOutput") -> None:
        scheduler_output.kv_loads, self._loads = self._loads, []
        scheduler_output.kv_cancels, self._cancels = self._cancels, []

    # ----------------------------------------------------------------------------------------- finish
    def request_finished(self, request: "Request", block_ids: list[int],
                         now: Optional[float]) -> tuple[bool, Optional[dict]]:
        rid = request.request_id
        quarantined = self._quarantined.get(rid)
        if quarantined is not None and quarantined[0] is request:  # its pull failed, but the READ may still
            return True, None  # write into its blocks: they are freed when it ends
        entry = self._recving.pop(rid, None)
        if entry is not None:
            # Aborted while its pull runs: the pull may still write into its blocks; freed when it ends.
            self._recving_finished[rid] = entry
            self._cancels.append(rid)
            return True, None
        p = request.kv_transfer_params
        if now is None or p is None or not p.do_remote_decode:
            return False, None
        lease = self.leases.grant(rid, block_ids, request.num_prompt_tokens, now)
        self._held[rid] = (request, len(block_ids))
        c = self.config
        return True, KVTransferParams(do_remote_prefill=True, remote_engine_id=c.engine_id, remote_host=c.host,
                                      remote_port=c.port, remote_block_ids=lease.block_ids,
                                      remote_request_id=rid, remote_num_tokens=lease.num_tokens,
                                      remote_lease=lease.nonce).to_dict()

    # ------------------------------------------------------------------------------ transport's news
    def update_connector_output(self, kv_output: Optional[KVConnectorOutput], now: float) -> KVConnectorUpdate:
        update = KVConnectorUpdate()
        if kv_output is not None:
            for rid in kv_output.finished_sending:
                self.leases.drop(rid, "pulled")
            for rid, transfer in kv_output.finished_recving.items():
                self._end_recv(rid, None, transfer, update)
            # A READ that ended within the same news needs no quarantine.
            writing = set(kv_output.still_writing).difference(kv_output.done_writing)
            for rid, error in kv_output.failed_recving.items():
                self._end_recv(rid, error, None, update, rid in writing)
            for rid in kv_output.done_writing:
                entry = self._quarantined.pop(rid, None)
                if entry is not None:  # the late bytes are void: only its prefix-cache hits hold valid K/V
                    logger.info("KV transfer: the given-up READ of %s ended; its %d blocks are freed", rid, entry[1])
                    update.to_free.append((entry[0], entry[0].num_cached_tokens))
        update.to_free.extend((req, None) for req in self.take_ended_holds(now))
        return update

    def _end_recv(self, rid: str, error: Optional[str], transfer: Optional[tuple[int, float]],
                  update: KVConnectorUpdate, still_writing: bool = False) -> None:
        """A pull ended for the request (``error``: it failed; ``still_writing``: its READ may go on)."""
        entry = self._recving_finished.pop(rid, None)
        if entry is not None:  # aborted meanwhile: only its prefix-cache hits hold valid K/V
            if still_writing:
                self._quarantine(rid, entry)
            else:
                update.to_free.append((entry[0], entry[0].num_cached_tokens))
            return
        entry = self._recving.pop(rid, None)
        if entry is None:
            return
        if error is not None:
            self.num_failures += 1
            if still_writing:  # before the scheduler finishes it: request_finished then keeps its blocks
                self._quarantine(rid, entry)
            update.failed.append((entry[0], error))
        else:
            update.loaded.append((entry[0], transfer))

    def _quarantine(self, rid: str, entry: tuple["Request", int]) -> None:
        logger.warning("KV transfer: the READ of %s was given up but may still write; its %d blocks stay out of "
                       "the pool until it ends", rid, entry[1])
        self._quarantined[rid] = entry

    def take_ended_holds(self, now: float) -> list["Request"]:
        if not self._held:
            return []
        for rid in self.leases.expire(now):
            logger.warning("KV transfer: no consumer pulled request %s within %g s; its blocks are freed",
                           rid, self.config.timeout)
        ended = []
        for rid, reason in self.leases.take_ended():
            entry = self._held.pop(rid, None)
            if entry is not None:
                ended.append(entry[0])
                logger.debug("KV hold of %s ended (%s)", rid, reason)
        return ended

    def revoke(self, params: KVTransferParams, now: float) -> bool:
        c = self.config
        if not c.is_producer:
            raise LookupError(f"this instance ({c.engine_id}, role {c.role}) holds no KV for pulls")
        if params.remote_engine_id != c.engine_id:
            raise LookupError(f"the handle names producer {params.remote_engine_id}, this is {c.engine_id}")
        try:
            return self.leases.revoke(params.remote_request_id, params.remote_lease or "",
                                      params.remote_block_ids, now)
        except LeaseError as e:
            raise LookupError(str(e)) from None

    # ------------------------------------------------------------------------------------------ state
    def num_loading(self) -> int:
        return len(self._recving)

    def has_pending(self) -> bool:
        return bool(self._held or self._recving or self._recving_finished or self._quarantined)

    def stats(self) -> KVConnectorStats:
        return KVConnectorStats(num_blocks_held=sum(n for _, n in self._held.values()),
                                num_loads_in_flight=len(self._recving) + len(self._recving_finished),
                                num_failures=self.num_failures,
                                num_blocks_quarantined=sum(n for _, n in self._quarantined.values()),
                                holds_ended=self.leases.counts())
