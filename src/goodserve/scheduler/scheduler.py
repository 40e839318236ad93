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

Seams, called at named points only: the scheduling policy (:mod:`goodserve.scheduler.policy`; its triage
applied in :mod:`goodserve.scheduler.triage`), the KV connector's scheduler half
(:mod:`goodserve.scheduler.remote_kv`) and speculative decoding (:mod:`goodserve.scheduler.spec_decode`); the
batching baselines are :mod:`goodserve.scheduler.baselines`. Every step's measured time feeds the online
step-time model (:meth:`Scheduler.observe_step_time`).
"""

from __future__ import annotations

import bisect
import logging
from typing import Iterable, Optional

from goodserve.config import CacheConfig, SchedulerConfig
from goodserve.kv_cache.manager import KVCacheManager
from goodserve.kv_transfer.base import KVConnectorScheduler
from goodserve.kv_transfer.messages import KVConnectorOutput
from goodserve.request import Request, RequestStatus
from goodserve.scheduler.baselines import BaselineModesMixin
from goodserve.scheduler.output import EngineCoreOutput, SampledToken, SchedulerOutput, SchedulerStats, StepShape
from goodserve.scheduler.policy import SLOUnattainableError, StepPlan, StepPolicy, StepTally, Triage, create_policy
from goodserve.scheduler.queue import RequestQueue
from goodserve.scheduler.remote_kv import RemoteKVMixin
from goodserve.scheduler.runner_diffs import RunnerDiffs
from goodserve.scheduler.spec_decode import SpecDecodeMixin, make_speculator
from goodserve.scheduler.step_time import StepTimeModel
from goodserve.scheduler.triage import TriageMixin
from goodserve.scheduler.stop import append_tokens, check_fits
from goodserve.spec.config import SpeculativeConfig

logger = logging.getLogger(__name__)


class Scheduler(TriageMixin, RemoteKVMixin, SpecDecodeMixin, BaselineModesMixin):
    """Continuous batching with chunked prefill, prefix caching and recompute preemption.

    Args:
        scheduler_config: Step limits and the waiting-queue policy.
        cache_config: The KV pool (``reserve`` mode runs without prefix caching: a reserved block would be
            registered before its K/V is written).
        step_model: The online step-time model (a fresh :class:`StepTimeModel` when ``None``).
        kv_connector: This instance's part in disaggregated serving, the KV connector's scheduler half
            (:func:`goodserve.kv_transfer.factory.create_connector_scheduler`; ``None``: none).
        speculative: Speculative decoding (``None``: none): decode rows verify the runner's draft tokens
            (:mod:`goodserve.spec.speculator`).
    """

    def __init__(self, scheduler_config: SchedulerConfig, cache_config: CacheConfig,
                 step_model: Optional[StepTimeModel] = None,
                 kv_connector: Optional[KVConnectorScheduler] = None,
                 speculative: Optional[SpeculativeConfig] = None) -> None:
        self.scheduler_config = scheduler_config
        self.cache_config = cache_config
        self.block_size = cache_config.block_size
        enable_prefix_caching = cache_config.enable_prefix_caching
        if scheduler_config.mode == "reserve" and enable_prefix_caching:
            logger.info("scheduler mode 'reserve' runs without prefix caching")
            enable_prefix_caching = False
        self.kv_cache_manager = KVCacheManager(cache_config.num_blocks, cache_config.block_size,
                                               enable_prefix_caching, cache_config.enable_kv_events,
                                               cache_config.group_windows)
        self.step_model = step_model if step_model is not None else StepTimeModel()
        self.policy: StepPolicy = create_policy(scheduler_config.policy, self.step_model,
                                                scheduler_config.max_num_batched_tokens, self.block_size,
                                                scheduler_config.shed_load)
        self.waiting: RequestQueue = self.policy.make_queue()
        self.running: list[Request] = []
        self.plan: StepPlan = StepPlan()  # the policy's plan of the step being built (or the last one)
        self._tally = StepTally()  # what the step being built holds so far
        self.num_preemptions_total = 0
        self.num_shed_total = 0  # refused on arrival or shed while queued or prefilling (the policy's triage)
        self.num_deferred_decodes_total = 0  # decodes that sat a step out for a prompt's TTFT
        self._requests: dict[str, Request] = {}  # unfinished requests by id
        self._in_flight: set[str] = set()  # scheduled by the last schedule(), not yet updated
        self._runner = RunnerDiffs()  # what the model runner knows of each request
        self._shed_outputs: list[EngineCoreOutput] = []  # shed while queued; handed out by the next update
        self.kv_connector = kv_connector
        self.speculator = make_speculator(speculative, self.step_model)

    # ------------------------------------------------------------------------------------------- state
    def has_unfinished_requests(self) -> bool:
        """Whether any request is waiting (for admission or for remote KV) or running."""
        return bool(self.running) or len(self.waiting) > 0 or \
            (self.kv_connector is not None and self.kv_connector.num_loading() > 0)

    def unfinished_request_ids(self) -> list[str]:
        """Ids of every waiting or running request."""
        return list(self._requests)

    # ------------------------------------------------------------------------------------------ intake
    def add_request(self, request: Request) -> None:
        """Queue a request, refusing at once one that can never run.

        Raises:
            ValueError: on a duplicate ``request_id``, or one that can never fit (:func:`check_fits`), or
                ``kv_transfer_params`` this instance cannot serve. Nothing changes when it raises.
            SLOUnattainableError: if the policy refuses it (``slo`` with ``shed_load``: its TTFT SLO cannot be
                met behind the work queued ahead of it, judged at its ``arrival_time``).
        """
        rid = request.request_id
        if rid in self._requests:
            raise ValueError(f"request id {rid!r} is already in use")
        kv = self.kv_cache_manager
        total = request.num_prompt_tokens + request.max_tokens if isinstance(request.max_tokens, int) else None
        chunked = self.scheduler_config.mode == "chunked"  # else a prompt is computed whole
        check_fits(request, self.scheduler_config.max_model_len, kv.num_blocks, self.block_size,
                   kv.max_blocks_needed(total, self.scheduler_config.max_num_batched_tokens if chunked else total)
                   if total is not None else None)
        self._check_kv_transfer(request)
        try:
            self.policy.check_arrival(request, self.waiting, self.running, request.arrival_time)
        except SLOUnattainableError:
            self.num_shed_total += 1
            raise
        request.status = RequestStatus.WAITING
        self._requests[rid] = request
        self.waiting.add(request)

    # ---------------------------------------------------------------------------------------- schedule
    def schedule(self, now: float) -> SchedulerOutput:
        """Decide the next step at ``now`` (seconds, the engine's monotonic clock): running requests first,
        then admissions if nothing was preempted.

        Returns:
            The step; ``total_num_scheduled_tokens <= max_num_batched_tokens`` (in ``prefill-first`` mode a
            step's single prompt may exceed it). It is never empty while requests are unfinished.
            ``num_computed_tokens`` is not advanced here (see :meth:`update_from_output`).
        """
        out = SchedulerOutput(finished_req_ids=self._runner.take_finished())
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
        triage = self.policy.triage(self.waiting, self.running, now)
        self._apply_triage(triage, now)
        self._begin_step(now, triage)
        budget = self._schedule_running(out, self.scheduler_config.max_num_batched_tokens)
        if not out.scheduled and out.preempted_req_ids:
            # Prefills that reserved budget for a decode that was then preempted get a second pass, with the
            # policy's plan rebuilt without it (a chunk held back beside that decode is not held now).
            self._begin_step(now, triage, again=True)
            budget = self._schedule_running(out, budget)
        if self.scheduler_config.mode == "static":
            self._admit_static_batch(out, budget, now)
        elif not out.preempted_req_ids or not self.running:
            # No admission in a step that preempted (it would thrash) unless nothing else can run.
            self._schedule_waiting(out, budget, now)
        if self.plan.deferred:
            self._end_deferral(out, budget)

    def _begin_step(self, now: float, triage: Triage, again: bool = False) -> None:
        """Ask the policy for the step's plan and order the running list by it (the tail is the first
        preemption victim); ``again``: a second pass over the same step."""
        self.plan = self.policy.plan(self.running, now, triage)
        rank = self.plan.rank
        if rank is not None:
            self.running.sort(key=lambda r: rank[r.request_id])
        self._tally = self.plan.tally()
        if self.speculator is not None:
            config = self.scheduler_config
            prompt_tokens, room = self._prompt_backlog(config.max_num_batched_tokens,
                                                       config.max_num_seqs - len(self.running))
            self.speculator.begin_step(self.running, self.plan.max_step_s, again, prompt_tokens, room, now)

    def _schedule_running(self, out: SchedulerOutput, budget: int) -> int:
        """Give each running request its tokens in order, preempting from the tail when blocks run out.

        A request still prefilling takes at most the budget left after reserving one token for every
        decode-phase request behind it (stall-free batching, Sarathi-Serve §4).

        Returns:
            The token budget left.
        """
        deferred = self.plan.deferred
        decodes_left = sum(1 for r in self.running
                           if r.num_tokens - r.num_computed_tokens == 1 and r.request_id not in deferred)
        i = 0
        while i < len(self.running) and budget > 0:
            req = self.running[i]
            remaining = req.num_tokens - req.num_computed_tokens
            if remaining == 1 and req.request_id in deferred:  # it sits this step out for a prompt
                i += 1
                continue
            spec: list[int] = []
            if remaining == 1:
                decodes_left -= 1
                spec = self._drafts(req, budget - decodes_left - 1)  # budget the decodes behind it leave
                n = 1 + len(spec)
            else:
                n = min(remaining, budget - decodes_left)
                if n > 0:
                    n = self.policy.chunk_size(self.plan, self._tally, req, req.num_computed_tokens, n,
                                               n == remaining)
            if n <= 0:
                i += 1
                continue
            while self.kv_cache_manager.allocate_slots(req, n) is None:
                if spec:  # no blocks for the drafts: verify none rather than preempt for them
                    spec, n = [], 1
                    continue
                victim = self.running[-1]
                if victim is not req and victim.num_tokens - victim.num_computed_tokens == 1:
                    decodes_left -= 1
                self._preempt(victim, out)
                if victim is req:
                    return budget
            if remaining != 1:
                self._tally.add_chunk(n, req.num_computed_tokens, n == remaining)
            elif spec:
                self._tally.add(len(spec), req.num_computed_tokens + 1, False)
            self._record(out, req, req.num_computed_tokens, n, spec)
            budget -= n
            i += 1
        return budget

    def _schedule_waiting(self, out: SchedulerOutput, budget: int, now: float) -> None:
        """Admit waiting requests in queue order while budget, ``max_num_seqs`` and free blocks allow.

        Stops at the first request whose blocks do not fit (no preemption on behalf of waiting ones), and
        at the first one the policy does not admit (``slo``: its decode would break the tightest TPOT SLO).
        """
        while budget > 0 and self.waiting and len(self.running) < self.scheduler_config.max_num_seqs:
            if not self.policy.may_admit(self.plan, self.waiting.peek(), self.running):
                break
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
            remote, n = self._admit_remote_prefill(out, req, hit_blocks, num_hit, now)
            if remote:
                return n
        n = max(0, min(req.num_tokens - num_hit, budget))
        if whole and n < req.num_tokens - num_hit:
            return None
        if n > 0:
            n = self.policy.chunk_size(self.plan, self._tally, req, num_hit, n, num_hit + n == req.num_tokens)
            if n == 0:
                return None  # the policy leaves it no room in this step
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
        if self.policy.running_key is not None:
            bisect.insort(self.running, req, key=self.policy.running_key)
        else:
            self.running.append(req)
        if n:
            self._tally.add_chunk(n, num_hit, num_hit + n == req.num_tokens)
            self._record(out, req, num_hit, n)
        return n

    def observe_step_time(self, scheduler_output: SchedulerOutput, seconds: float, proposing: float = 0.0,
                          catching_up: float = 0.0) -> None:
        """Tell the step-time model how long a step took (wall seconds, as the requests saw it, ``proposing`` of
        them spent proposing drafts for the next step, ``catching_up`` of those a draft model's reading of context
        it had missed); under speculation, through the speculator (which learns what drafts cost from steps that
        verified some)."""
        if scheduler_output.is_empty:
            return
        seen = (StepShape.of(scheduler_output), seconds) if self.speculator is None \
            else self.speculator.observe(scheduler_output, seconds, proposing, catching_up)
        if seen is not None:
            self.step_model.observe(*seen)

    def _preempt(self, req: Request, out: SchedulerOutput) -> None:
        """Free a running request's blocks and send it back to the waiting queue to be recomputed."""
        kv = self.kv_cache_manager
        self.running.remove(req)
        kv.free(req)
        lost = req.num_computed_tokens
        req.status = RequestStatus.PREEMPTED
        req.num_computed_tokens = 0
        req.spec_token_ids = []
        req.num_preemptions += 1
        self.num_preemptions_total += 1
        self.waiting.prepend(req)
        out.preempted_req_ids.append(req.request_id)
        self._runner.preempted(req.request_id)
        logger.warning("KV cache full: preempted request %s (priority %d, %d computed tokens will be recomputed, "
                       "preempted %d time(s)); %d running, %d waiting, %d/%d blocks free, %d preemptions so far. "
                       "More KV blocks or a lower max_num_seqs would avoid this.", req.request_id, req.priority,
                       lost, req.num_preemptions, len(self.running), len(self.waiting), kv.num_free_blocks,
                       kv.num_blocks, self.num_preemptions_total)

    # ------------------------------------------------------------------------------------------ update
    def update_from_output(self, scheduler_output: SchedulerOutput, sampled: dict[str, SampledToken],
                           now: float, kv_output: Optional[KVConnectorOutput] = None) -> list[EngineCoreOutput]:
        """Advance the scheduled requests after the step ran and apply token-level stop rules.

        Args:
            scheduler_output: The step returned by :meth:`schedule`.
            sampled: The runner's result for every scheduled request with ``sample=True`` (one whose ``error``
                is set fails and frees its blocks); under speculation, with the drafts it accepted.
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
            num_spec = len(sched.spec_token_ids)
            req.num_computed_tokens += sched.num_new_tokens - num_spec  # accepted drafts are added below
            if not sched.sample:
                continue
            token = sampled.get(req.request_id)
            if token is None:
                raise RuntimeError(f"request {req.request_id} was scheduled to sample but got no token")
            if token.error is not None:
                self._finish(req, RequestStatus.FINISHED_ERROR)
                outputs.append(EngineCoreOutput.of(req, [], now, error=token.error))
                continue
            if num_spec:
                req.num_computed_tokens += len(token.accepted)
            emitted, status = append_tokens(req, [*token.accepted, token], now, self.scheduler_config.max_model_len)
            handle = self._finish(req, status, now) if status is not None else None
            if self.speculator is not None:
                self._verified(req, num_spec, token)
            outputs.append(EngineCoreOutput.of(req, emitted, now, kv_transfer_params=handle))
        return outputs

    def make_stats(self) -> SchedulerStats:
        """The scheduler's state in one record (the only way stats leave the scheduler)."""
        kv = self.kv_cache_manager
        tokens_waiting = sum(r.num_tokens - r.num_computed_tokens for r in self.waiting)
        tokens_waiting += sum(max(0, r.num_prompt_tokens - r.num_computed_tokens) for r in self.running)
        m = self.step_model
        return SchedulerStats(num_running=len(self.running), num_waiting=len(self.waiting),
                              num_tokens_waiting=tokens_waiting, kv_cache_usage=kv.usage,
                              num_cached_blocks=kv.block_pool.num_cached_blocks,
                              num_preemptions_total=self.num_preemptions_total,
                              prefix_cache_queries=kv.prefix_cache_queries, prefix_cache_hits=kv.prefix_cache_hits,
                              num_shed_total=self.num_shed_total,
                              num_deferred_decodes_total=self.num_deferred_decodes_total,
                              num_steps_observed=m.num_observed, step_time_predicted_s_total=m.predicted_s_total,
                              step_time_actual_s_total=m.actual_s_total,
                              step_time_abs_error_s_total=m.abs_error_s_total, step_time_margin=m.margin,
                              **self._kv_transfer_stats(),
                              **(self.speculator.stats_fields() if self.speculator is not None else {}))

    def finish_requests(self, request_ids: str | Iterable[str], status: RequestStatus) -> list[str]:
        """Finish waiting or running requests from outside (abort, stop string found downstream, a failure
        while processing its output) with ``status``; their blocks are freed at once. Unknown or finished ids
        are ignored.

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
        self._runner.finished(rid)
        return handle
