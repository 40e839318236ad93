"""The iteration-level scheduler: which requests advance by how many tokens in the next step.

Each step is decided afresh (Orca, Yu et al., OSDI 2022, §3: iteration-level scheduling), under two
limits: a token budget, ``max_num_batched_tokens`` (compute), and the KV block pool (memory, PagedAttention
§4). Long prompts are cut into chunks that share the budget with ongoing decodes, and decodes always get
their token first, so a long prompt never stalls them (Sarathi-Serve, Agrawal et al., OSDI 2024, §4:
chunked prefill and stall-free batching).

There are no phases: a request only has ``num_computed_tokens`` catching up with ``num_tokens``. A prefix
hit starts it further ahead; a preemption frees its blocks and sends it back to 0 (recompute).

One step: ``schedule(now)`` -> the runner computes the :class:`SchedulerOutput` -> ``update_from_output``,
which returns an :class:`EngineCoreOutput` per request that sampled or finished. The scheduler is the only
writer of a :class:`Request`; what it decides leaves it only as those plain messages and as
:meth:`make_stats`.

Baselines (``SchedulerConfig.mode``), for comparison in the simulator and the benchmarks:

* ``static``: request-level batching; a batch runs to completion before the next is admitted (pre-Orca).
* ``reserve``: the ``chunked`` flow, but admission allocates blocks for prompt + ``max_tokens`` up front,
  as systems without paging reserve the maximum length (Orca's "Max" baseline in PagedAttention §6). It
  never preempts. Prefix caching is off: a reserved block would be registered before its K/V is written.
* ``prefill-first``: unchunked, prefill-prioritising batching (vLLM v0): a waiting prompt is admitted only
  whole, and a step that admits prompts schedules no decodes. The first prompt of a step may exceed the token budget so that
  prompts longer than ``max_num_batched_tokens`` can run.

Policies (``SchedulerConfig.policy``) order the waiting queue: ``fcfs``, ``priority``, and ``slo``
(:mod:`goodserve.scheduler.slo`), which also sizes each step's prefill, stops admission and picks the
preemption victim from predicted step times. Every policy feeds the online step-time model
(:mod:`goodserve.scheduler.step_time`) the steps' measured times (:meth:`Scheduler.observe_step_time`); its
prediction error is in :meth:`make_stats`.

Disaggregated serving goes through the KV connector's scheduler half
(:class:`~goodserve.kv_transfer.base.KVConnectorScheduler`), called at named points only: a request's
``kv_transfer_params`` are checked on arrival; a remote prefill's matched tokens are allocated (without
registering their hashes) and the request waits in ``WAITING_FOR_REMOTE_KVS``; each step's transfer
metadata goes into :class:`SchedulerOutput`; at a request's end the connector says whether its blocks
outlive it (held for a consumer, or still being written by a pull) and gives the handle; and its update
after each step names the requests whose K/V landed or failed and the blocks to free. The holds and pulls
are the connector's state, not the scheduler's.
"""

from __future__ import annotations

import bisect
import logging
from typing import Iterable, Optional

from goodserve.config import CacheConfig, SchedulerConfig
from goodserve.kv_cache.manager import KVCacheManager
from goodserve.kv_transfer.base import KVConnectorScheduler, no_connector_error
from goodserve.kv_transfer.config import KVTransferConfig
from goodserve.kv_transfer.factory import create_connector_scheduler
from goodserve.kv_transfer.messages import KVConnectorOutput, KVConnectorStats, KVConnectorUpdate
from goodserve.kv_transfer.params import KVTransferParams
from goodserve.request import Request, RequestStatus
from goodserve.scheduler.output import (EngineCoreOutput, NewRequestData, SampledToken, ScheduledRequest,
                                        SchedulerOutput, SchedulerStats, StepShape)
from goodserve.scheduler.queue import RequestQueue, create_request_queue
from goodserve.scheduler.slo import SLOPolicy
from goodserve.scheduler.step_time import StepTimeModel
from goodserve.scheduler.stop import check_stop
from goodserve.validation import ParamError

logger = logging.getLogger(__name__)


class Scheduler:
    """Continuous batching with chunked prefill, prefix caching and recompute preemption.

    Args:
        scheduler_config: Step limits and the waiting-queue policy.
        cache_config: The KV pool (``reserve`` mode runs without prefix caching: a reserved block would be
            registered before its K/V is written).
        step_model: The online step-time model (a fresh :class:`StepTimeModel` when ``None``).
        kv_transfer: This instance's part in disaggregated serving (``None``: none); its connector's
            scheduler half is built from it unless ``kv_connector`` is given.
        kv_connector: The KV connector's scheduler half (the engine core's, sharing the worker's leases).
    """

    def __init__(self, scheduler_config: SchedulerConfig, cache_config: CacheConfig,
                 step_model: Optional[StepTimeModel] = None,
                 kv_transfer: Optional[KVTransferConfig] = None,
                 kv_connector: Optional[KVConnectorScheduler] = None) -> None:
        self.scheduler_config = scheduler_config
        self.cache_config = cache_config
        self.block_size = cache_config.block_size
        enable_prefix_caching = cache_config.enable_prefix_caching
        if scheduler_config.mode == "reserve" and enable_prefix_caching:
            logger.info("scheduler mode 'reserve' runs without prefix caching")
            enable_prefix_caching = False
        self.kv_cache_manager = KVCacheManager(cache_config.num_blocks, cache_config.block_size,
                                               enable_prefix_caching)
        self.step_model = step_model if step_model is not None else StepTimeModel()
        self.slo: Optional[SLOPolicy] = None
        if scheduler_config.policy == "slo":
            self.slo = SLOPolicy(self.step_model, scheduler_config.max_num_batched_tokens, self.block_size,
                                 scheduler_config.shed_load)
        self.waiting: RequestQueue = create_request_queue(scheduler_config.policy,
                                                          self.slo.queue_key if self.slo else None)
        self.running: list[Request] = []
        self.num_preemptions_total = 0
        self._requests: dict[str, Request] = {}  # unfinished requests by id
        self._in_flight: set[str] = set()  # scheduled by the last schedule(), not yet updated
        # What the runner knows: how many block ids of each request it holds (absent: it has not seen the
        # request), which requests lost their blocks to preemption since, and which finished since the
        # last step (it drops their state).
        self._runner_num_blocks: dict[str, int] = {}
        self._preempted_since_scheduled: set[str] = set()
        self._finished_req_ids: list[str] = []
        self._shed_outputs: list[EngineCoreOutput] = []  # shed while queued; handed out by the next update
        if kv_connector is None and kv_transfer is not None:
            kv_connector = create_connector_scheduler(kv_transfer, self.block_size)
        self.kv_connector = kv_connector

    # ------------------------------------------------------------------------------------------- state
    def has_unfinished_requests(self) -> bool:
        """Whether any request is waiting (for admission or for remote KV) or running."""
        return bool(self.running) or len(self.waiting) > 0 or \
            (self.kv_connector is not None and self.kv_connector.num_loading() > 0)

    def has_pending_kv_transfers(self) -> bool:
        """Whether blocks are held for a consumer's pull or a pull is in flight: the engine must keep
        stepping (an empty step polls the connector) even when no request can run."""
        return self.kv_connector is not None and self.kv_connector.has_pending()

    def unfinished_request_ids(self) -> list[str]:
        """Ids of every waiting or running request."""
        return list(self._requests)

    # ------------------------------------------------------------------------------------------ intake
    def add_request(self, request: Request) -> None:
        """Queue a request, refusing at once one that can never run.

        Raises:
            ValueError: on a duplicate ``request_id``; if ``max_tokens`` is not a positive int; if prompt +
                ``max_tokens`` exceeds ``max_model_len`` tokens; or if those tokens need more KV blocks
                than the whole pool holds. Nothing changes when it raises.
            SLOUnattainableError: under ``slo`` with ``shed_load``, if its TTFT SLO cannot be met behind the
                work queued ahead of it (judged at its ``arrival_time``).
        """
        rid = request.request_id
        if rid in self._requests:
            raise ValueError(f"request id {rid!r} is already in use")
        max_tokens = request.max_tokens
        if not isinstance(max_tokens, int) or max_tokens < 1:
            raise ValueError(f"request {rid!r}: max_tokens must be resolved to an int >= 1, "
                             f"got {max_tokens!r}")
        num_prompt = request.num_prompt_tokens
        total = num_prompt + max_tokens
        max_len = self.scheduler_config.max_model_len
        if total > max_len:
            raise ParamError(f"This model's maximum context length is {max_len} tokens; this request asks for "
                             f"{total} tokens ({num_prompt} prompt tokens + max_tokens {max_tokens}). Shorten the "
                             "prompt or lower max_tokens.", code="context_length_exceeded")
        num_blocks = self.kv_cache_manager.num_blocks
        blocks_needed = -(-total // self.block_size)
        if blocks_needed > num_blocks:
            raise ParamError(f"this request needs {blocks_needed} KV blocks ({total} tokens at "
                             f"block_size {self.block_size}), but the KV pool has only {num_blocks} blocks; "
                             "shorten the prompt, lower max_tokens or give the cache more memory",
                             code="context_length_exceeded")
        if request.kv_transfer_params is not None:
            if self.kv_connector is None:
                raise no_connector_error(request.kv_transfer_params)
            self.kv_connector.check_request(request)
        if self.slo is not None:
            self.slo.check_arrival(request, self.waiting, self.running, request.arrival_time)
        request.status = RequestStatus.WAITING
        self._requests[rid] = request
        self.waiting.add(request)

    # ---------------------------------------------------------------------------------------- schedule
    def schedule(self, now: float) -> SchedulerOutput:
        """Decide the next step: running requests first, then admissions if nothing was preempted.

        Args:
            now: Current time in seconds (engine's monotonic clock).

        Returns:
            The step; ``total_num_scheduled_tokens <= max_num_batched_tokens`` (in ``paged`` mode a step's
            single prompt may exceed it). It is never empty while requests are unfinished.
            ``num_computed_tokens`` is not advanced here (see :meth:`update_from_output`).
        """
        out = SchedulerOutput(finished_req_ids=self._finished_req_ids)
        self._finished_req_ids = []
        if self.kv_connector is not None:
            self._free_ended_holds(now)
        if self.scheduler_config.mode == "prefill-first":
            self._schedule_prefill_first(out, now)
        else:
            self._schedule_continuous(out, now)
        if self.kv_connector is not None:
            self.kv_connector.build_connector_meta(out)
        out.total_num_scheduled_tokens = sum(s.num_new_tokens for s in out.scheduled)
        self._in_flight = {s.request_id for s in out.scheduled}
        return out

    def _schedule_continuous(self, out: SchedulerOutput, now: float) -> None:
        """``chunked``, ``reserve`` and ``static``: running requests first, then admissions."""
        if self.slo is not None:
            self._triage(now)
            self.slo.begin_step(self.running, now)
        budget = self._schedule_running(out, self.scheduler_config.max_num_batched_tokens)
        if not out.scheduled and out.preempted_req_ids:
            # Prefills that reserved budget for a decode that was then preempted get a second pass, with the
            # slo policy's figures rebuilt without it (a chunk held back beside that decode is not held now).
            if self.slo is not None:
                self.slo.begin_step(self.running, now)
            budget = self._schedule_running(out, budget)
        if self.scheduler_config.mode == "static":
            if not self.running:  # request-level batching: a new batch only once the last one is done
                self._admit_static_batch(out, budget, now)
        elif not out.preempted_req_ids or not self.running:
            # No admission in a step that preempted (it would thrash) unless nothing else can run.
            self._schedule_waiting(out, budget, now)
        if self.slo is not None and self.slo.deferred:
            self._end_deferral(out, budget)

    def _end_deferral(self, out: SchedulerOutput, budget: int) -> None:
        """``slo`` rule 6: count the decodes that sat out this step, or, if no prompt got a chunk after all
        (no free blocks, the admission stop, ``max_num_seqs``), schedule them in this step."""
        deferred = [r for r in self.running if r.request_id in self.slo.deferred]
        if self.slo.prefill_scheduled:
            self.slo.num_deferred += len(deferred)
            return
        self.slo.deferred = set()
        for req in deferred:
            if budget <= 0 or self.kv_cache_manager.allocate_slots(req, 1) is None:
                break
            self._record(out, req, req.num_computed_tokens, 1)
            budget -= 1
        if not out.scheduled:  # not even a decode's block: the running pass, preempting as it does
            self._schedule_running(out, self.scheduler_config.max_num_batched_tokens)

    def _schedule_prefill_first(self, out: SchedulerOutput, now: float) -> None:
        """``prefill-first`` (vLLM v0): admit whole prompts; only a step that admitted none runs the decodes.

        Running requests are all decoding (their prompts ran whole), so the running pass gives each one
        token, preempting from the tail when blocks run out.
        """
        budget = self.scheduler_config.max_num_batched_tokens
        while budget > 0 and self.waiting and len(self.running) < self.scheduler_config.max_num_seqs:
            # The step's first prompt may exceed the budget, or a long prompt could never run.
            cap = budget if out.scheduled else max(budget, self.scheduler_config.max_model_len)
            n = self._admit(out, cap, now, whole=True)
            if n is None:
                break
            budget -= n
        if not out.scheduled:
            self._schedule_running(out, self.scheduler_config.max_num_batched_tokens)

    def _schedule_running(self, out: SchedulerOutput, budget: int) -> int:
        """Give each running request its tokens in order, preempting from the tail when blocks run out.

        A request still prefilling takes at most the budget left after reserving one token for every
        decode-phase request behind it (stall-free batching, Sarathi-Serve §4).

        Returns:
            The token budget left.
        """
        deferred = self.slo.deferred if self.slo is not None else ()
        decodes_left = sum(1 for r in self.running
                           if r.num_tokens - r.num_computed_tokens == 1 and r.request_id not in deferred)
        i = 0
        while i < len(self.running) and budget > 0:
            req = self.running[i]
            remaining = req.num_tokens - req.num_computed_tokens
            if remaining == 1 and req.request_id in deferred:  # slo rule 6: it sits this step out
                i += 1
                continue
            if remaining == 1:
                decodes_left -= 1
                n = 1
            else:
                n = min(remaining, budget - decodes_left)
                if self.slo is not None and n > 0:
                    n = self.slo.chunk_size(req, req.num_computed_tokens, n, n == remaining)
            if n <= 0:
                i += 1
                continue
            while self.kv_cache_manager.allocate_slots(req, n) is None:
                victim = self.running[-1]
                if victim is not req and victim.num_tokens - victim.num_computed_tokens == 1:
                    decodes_left -= 1
                self._preempt(victim, out)
                if victim is req:
                    return budget
            if self.slo is not None and remaining != 1:
                self.slo.count(req.num_computed_tokens, n, n == remaining)
            self._record(out, req, req.num_computed_tokens, n)
            budget -= n
            i += 1
        return budget

    def _schedule_waiting(self, out: SchedulerOutput, budget: int, now: float) -> None:
        """Admit waiting requests in queue order while budget, ``max_num_seqs`` and free blocks allow.

        Stops at the first request whose blocks do not fit (no preemption on behalf of waiting ones), and under
        ``slo`` at the first one whose decode would break the tightest TPOT SLO.
        """
        while budget > 0 and self.waiting and len(self.running) < self.scheduler_config.max_num_seqs:
            if self.slo is not None and not self.slo.may_admit(self.waiting.peek(), self.running):
                break
            n = self._admit(out, budget, now)
            if n is None:
                break
            budget -= n

    def _admit_static_batch(self, out: SchedulerOutput, budget: int, now: float) -> None:
        """Static (request-level) batching: admit up to ``max_num_seqs`` requests at once.

        Requests beyond the step's token budget join the batch with no tokens this step; the running pass
        gives them their prefill chunks in the next steps. Nothing joins until the whole batch is done.
        """
        while self.waiting and len(self.running) < self.scheduler_config.max_num_seqs:
            n = self._admit(out, budget, now)
            if n is None:
                break
            budget -= n

    def _admit(self, out: SchedulerOutput, budget: int, now: float, whole: bool = False) -> Optional[int]:
        """Move the head of the waiting queue to running with up to ``budget`` tokens scheduled.

        Args:
            whole: Admit only if all its uncached tokens fit ``budget`` (no chunking, ``prefill-first``).

        Returns:
            The tokens scheduled for it (possibly 0), or ``None`` if its blocks (or, with ``whole``, its
            tokens) do not fit.
        """
        kv = self.kv_cache_manager
        req = self.waiting.peek()
        pulled = bool(kv.get_block_ids(req.request_id))  # its K/V was pulled from a producer: it holds blocks
        hit_blocks, num_hit = ([], req.num_computed_tokens) if pulled else kv.get_computed_blocks(req)
        if self.kv_connector is not None and not pulled:
            num_remote = self.kv_connector.get_num_new_matched_tokens(req, num_hit)
            if num_remote is not None:
                return self._admit_remote_prefill(out, req, hit_blocks, num_hit, num_remote, now)
        n = max(0, min(req.num_tokens - num_hit, budget))
        if whole and n < req.num_tokens - num_hit:
            return None
        if self.slo is not None and n > 0:
            n = self.slo.chunk_size(req, num_hit, n, num_hit + n == req.num_tokens)
            if n == 0:
                return None  # the step's time limit leaves it no room
        if kv.allocate_slots(req, self._slots_to_allocate(req, num_hit, n), hit_blocks) is None:
            return None
        self.waiting.pop()
        req.num_computed_tokens = num_hit
        if req.first_scheduled_time is None:  # first admission: count the lookup once
            req.first_scheduled_time = now
            req.num_cached_tokens = num_hit
            kv.record_prefix_cache_lookup(req.num_tokens, num_hit)
        if not pulled:
            out.num_prefix_cached_tokens += num_hit
        req.status = RequestStatus.RUNNING
        self._add_running(req)
        if n:
            if self.slo is not None:
                self.slo.count(num_hit, n, num_hit + n == req.num_tokens)
            self._record(out, req, num_hit, n)
        return n

    def _admit_remote_prefill(self, out: SchedulerOutput, req: Request, hit_blocks: list[int], num_hit: int,
                              num_remote: int, now: float) -> Optional[int]:
        """Consumer side: allocate blocks for the local prefix-cache hits and the ``num_remote`` tokens the
        connector brings (their hashes are registered once they land), and leave the request (the head of the
        waiting queue) in ``WAITING_FOR_REMOTE_KVS``.

        Returns:
            ``0`` (no tokens are computed this step), or ``None`` if its blocks do not fit.
        """
        kv = self.kv_cache_manager
        if kv.allocate_slots(req, num_remote, hit_blocks, cache=False) is None:
            return None
        self.waiting.pop()
        req.num_computed_tokens = num_hit
        req.first_scheduled_time = now
        req.num_cached_tokens = num_hit
        kv.record_prefix_cache_lookup(req.num_tokens, num_hit)
        out.num_prefix_cached_tokens += num_hit
        req.status = RequestStatus.WAITING_FOR_REMOTE_KVS
        self.kv_connector.update_state_after_alloc(req, kv.get_block_ids(req.request_id), num_hit, num_remote)
        return 0

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
            outputs.append(self._core_output(req, [], now, error=error))

    def _free_ended_holds(self, now: float) -> None:
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

    def _slots_to_allocate(self, req: Request, num_hit: int, n: int) -> int:
        """New slots an admission allocates beyond the prefix hit: the step's ``n`` tokens, or under
        ``reserve`` every slot up to prompt + ``max_tokens``, so the request never needs another block."""
        if self.scheduler_config.mode == "reserve":
            return max(n, req.num_prompt_tokens + req.max_tokens - num_hit)
        return n

    def _add_running(self, req: Request) -> None:
        """Append to the running list; under ``priority`` keep it sorted so the tail is lowest priority."""
        if self.scheduler_config.policy == "priority":
            bisect.insort(self.running, req, key=lambda r: (r.priority, r.arrival_time))
        else:
            self.running.append(req)

    def _record(self, out: SchedulerOutput, req: Request, num_computed: int, n: int) -> None:
        """Add a request's share of the step: its static data if the runner has not seen it, and the block ids
        the runner does not hold yet."""
        rid = req.request_id
        known = self._runner_num_blocks.get(rid)
        resumed = rid in self._preempted_since_scheduled
        if known is None:
            out.new_requests.append(NewRequestData(rid, list(req.prompt_token_ids), req.sampling_params,
                                                   req.eos_token_ids))
        if known is None or resumed:
            known = 0
            self._preempted_since_scheduled.discard(rid)
        new_block_ids = self.kv_cache_manager.get_block_ids(rid, known)  # only what the runner lacks
        out.scheduled.append(ScheduledRequest(rid, num_computed, n, sample=num_computed + n == req.num_tokens,
                                              new_block_ids=new_block_ids, resumed_from_preemption=resumed))
        self._runner_num_blocks[rid] = known + len(new_block_ids)

    def _triage(self, now: float) -> None:
        """``slo``: requests that can no longer meet their TTFT SLO go behind the others (waiting ones to the
        back of the queue, running ones still prefilling to the back of the chunk order), or under
        ``shed_load`` are shed (their outputs go out with the next :meth:`update_from_output`)."""
        for req in self.slo.triage(list(self.waiting), self.running, now):
            if self.scheduler_config.shed_load:
                self._finish(req, RequestStatus.FINISHED_SHED)
                self._shed_outputs.append(self._core_output(req, [], now, error=self.slo.shed(req, now)))
            elif req.status == RequestStatus.RUNNING:
                req.slo_late = True
            else:
                self.waiting.remove(req)
                req.slo_late = True
                self.waiting.add(req)

    def observe_step_time(self, scheduler_output: SchedulerOutput, seconds: float) -> None:
        """Tell the step-time model how long a step took (wall seconds, as the requests saw it)."""
        if not scheduler_output.is_empty:
            self.step_model.observe(StepShape.of(scheduler_output), seconds)

    def _preempt(self, req: Request, out: SchedulerOutput) -> None:
        """Free a running request's blocks and send it back to the waiting queue to be recomputed."""
        kv = self.kv_cache_manager
        self.running.remove(req)
        kv.free(req)
        lost = req.num_computed_tokens
        req.status = RequestStatus.PREEMPTED
        req.num_computed_tokens = 0
        req.num_preemptions += 1
        self.num_preemptions_total += 1
        self.waiting.prepend(req)
        out.preempted_req_ids.append(req.request_id)
        if req.request_id in self._runner_num_blocks:
            self._preempted_since_scheduled.add(req.request_id)
        logger.warning(
            "KV cache full: preempted request %s (priority %d, %d computed tokens will be recomputed, "
            "preempted %d time(s)); %d running, %d waiting, %d/%d blocks free, %d preemptions so far. "
            "More KV blocks or a lower max_num_seqs would avoid this.",
            req.request_id, req.priority, lost, req.num_preemptions, len(self.running), len(self.waiting),
            kv.num_free_blocks, kv.num_blocks, self.num_preemptions_total)

    # ------------------------------------------------------------------------------------------ update
    def update_from_output(self, scheduler_output: SchedulerOutput, sampled: dict[str, SampledToken],
                           now: float, kv_output: Optional[KVConnectorOutput] = None) -> list[EngineCoreOutput]:
        """Advance the scheduled requests after the step ran and apply token-level stop rules.

        Args:
            scheduler_output: The step returned by :meth:`schedule`.
            sampled: The runner's result for every scheduled request with ``sample=True``; one whose ``error``
                is set fails (``FINISHED_ERROR``) and frees its blocks.
            now: Current time in seconds.
            kv_output: The KV connector's news (pulls done or failed, holds released), if it has one.

        Returns:
            An :class:`EngineCoreOutput` for every request that sampled a token or finished in this call
            (stop token, EOS, length or error), in batch order, after those shed while queued since the last
            call (``finish_reason="shed"``) and those whose pull failed (``"error"``).

        Raises:
            RuntimeError: if a request that had to sample has no entry in ``sampled``.
        """
        self._in_flight = set()
        outputs, self._shed_outputs = self._shed_outputs, []
        if self.kv_connector is not None:
            self._apply_kv_update(self.kv_connector.update_connector_output(kv_output, now), now, outputs)
        for sched in scheduler_output.scheduled:
            req = self._requests.get(sched.request_id)
            if req is None:
                continue  # aborted or stopped between schedule() and now
            req.num_computed_tokens += sched.num_new_tokens
            if not sched.sample:
                continue
            token = sampled.get(req.request_id)
            if token is None:
                raise RuntimeError(f"request {req.request_id} was scheduled to sample but got no token")
            if token.error is not None:
                self._finish(req, RequestStatus.FINISHED_ERROR)
                outputs.append(self._core_output(req, [], now, error=token.error))
                continue
            req.append_output_token(token.token_id)
            if req.first_token_time is None:
                req.first_token_time = now
            status = check_stop(req, token.token_id, self.scheduler_config.max_model_len)
            handle = None
            if status is not None:
                handle = self._finish(req, status, now)
            outputs.append(self._core_output(req, [token.token_id], now, token, kv_transfer_params=handle))
        return outputs

    @staticmethod
    def _core_output(req: Request, new_token_ids: list[int], now: float, token: Optional[SampledToken] = None,
                     error: Optional[str] = None, kv_transfer_params: Optional[dict] = None) -> EngineCoreOutput:
        with_logprobs = token is not None and req.sampling_params.logprobs is not None
        return EngineCoreOutput(
            req.request_id, new_token_ids, now, first_scheduled_time=req.first_scheduled_time,
            finish_reason=req.status.finish_reason, stop_reason=req.stop_reason,
            logprobs=[token.logprob] if with_logprobs else None,
            top_logprobs=[token.top_logprobs or []] if with_logprobs else None,
            num_cached_tokens=req.num_cached_tokens, num_preemptions=req.num_preemptions, error=error,
            prompt_logprobs=token.prompt_logprobs if token is not None else None,
            kv_transfer_params=kv_transfer_params,
            kv_transfer=req.kv_transfer if new_token_ids and req.num_output_tokens == 1 else None)

    def make_stats(self) -> SchedulerStats:
        """The scheduler's state in one record (the only way stats leave the scheduler)."""
        kv = self.kv_cache_manager
        c = self.kv_connector.stats() if self.kv_connector is not None else KVConnectorStats()
        tokens_waiting = sum(r.num_tokens - r.num_computed_tokens for r in self.waiting)
        tokens_waiting += sum(max(0, r.num_prompt_tokens - r.num_computed_tokens) for r in self.running)
        m = self.step_model
        return SchedulerStats(num_running=len(self.running), num_waiting=len(self.waiting),
                              num_tokens_waiting=tokens_waiting, kv_cache_usage=kv.usage,
                              num_preemptions_total=self.num_preemptions_total,
                              prefix_cache_queries=kv.prefix_cache_queries, prefix_cache_hits=kv.prefix_cache_hits,
                              num_shed_total=self.slo.num_shed if self.slo else 0,
                              num_deferred_decodes_total=self.slo.num_deferred if self.slo else 0,
                              num_steps_observed=m.num_observed, step_time_predicted_s_total=m.predicted_s_total,
                              step_time_actual_s_total=m.actual_s_total,
                              step_time_abs_error_s_total=m.abs_error_s_total, step_time_margin=m.margin,
                              num_blocks_held_for_pull=c.num_blocks_held,
                              num_kv_transfers_in_flight=c.num_loads_in_flight,
                              num_kv_blocks_quarantined=c.num_blocks_quarantined,
                              num_kv_transfer_timeouts_total=c.holds_ended.get("expired", 0),
                              num_kv_transfer_failures_total=c.num_failures,
                              num_kv_holds_ended_total=dict(c.holds_ended))

    def finish_requests(self, request_ids: str | Iterable[str], status: RequestStatus) -> list[str]:
        """Finish waiting or running requests from outside (abort, stop string found downstream, a failure
        while processing its output). Their blocks are freed at once.

        Args:
            request_ids: One id or several; unknown or already finished ones are ignored.
            status: A finished status, e.g. ``FINISHED_ABORTED`` or ``FINISHED_STOPPED``.

        Returns:
            The ids of the requests finished by this call.

        Raises:
            ValueError: if ``status`` is not a finished status.
        """
        if not status.is_finished:
            raise ValueError(f"finish_requests needs a finished status, got {status}")
        ids = [request_ids] if isinstance(request_ids, str) else list(request_ids)
        done = []
        for rid in ids:
            req = self._requests.get(rid)
            if req is not None:
                self._finish(req, status)
                done.append(rid)
        return done

    def _finish(self, req: Request, status: RequestStatus, now: Optional[float] = None) -> Optional[dict]:
        """End a request and free its blocks (unless the KV connector keeps them: held for a pull, or a pull
        is still writing them).

        Args:
            now: When it finished by a stop rule (its blocks may then be held for a consumer's pull).

        Returns:
            The handle of the blocks held for a consumer (``kv_transfer_params``), else ``None``.
        """
        rid = req.request_id
        if req.status == RequestStatus.RUNNING:
            self.running.remove(req)
        elif req.status != RequestStatus.WAITING_FOR_REMOTE_KVS:  # those wait in the connector
            self.waiting.remove(req)
        delay_free, handle = False, None
        if self.kv_connector is not None:
            delay_free, handle = self.kv_connector.request_finished(req, self.kv_cache_manager.get_block_ids(rid),
                                                                    now)
        if not delay_free:
            # Dropped between schedule() and update: K/V registered for this step was never written.
            valid = req.num_computed_tokens if rid in self._in_flight else None
            self.kv_cache_manager.free(req, num_valid_tokens=valid)
        req.status = status
        del self._requests[rid]
        self._preempted_since_scheduled.discard(rid)
        if self._runner_num_blocks.pop(rid, None) is not None:
            self._finished_req_ids.append(rid)
        return handle
