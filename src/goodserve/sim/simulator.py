"""Discrete-event simulation of a serving cluster that drives the engine's real :class:`Scheduler`.

Each instance (a replica, or a prefill or decode instance when disaggregated) owns a real
:class:`~goodserve.scheduler.scheduler.Scheduler` with its own KV block pool. Nothing is re-implemented
for the simulator: an instance asks its scheduler for the next ``SchedulerOutput``, a cost model
(:mod:`goodserve.sim.cost_model`) prices it, and when the step's time has passed the scheduler gets the
sampled tokens through ``update_from_output``, exactly as in ``Engine.step``. A policy studied here is the
policy that ships.

The clock only jumps from event to event (:mod:`goodserve.sim.events`), kept in a heap ordered by time
and then by the order they were queued, so a run is deterministic. Once every event of an instant is
applied, each idle instance with unfinished requests starts its next step.

Disaggregation (DistServe, Zhong et al., OSDI 2024) runs the engine's own KV hand-off
(:mod:`goodserve.kv_transfer`) with the router's two hops: a prefill instance (a producer) prefills with
``do_remote_decode`` and holds the blocks; the request goes with the handle to a decode instance (a
consumer), whose scheduler waits for the pull of the prompt but its last token. The pull crosses the
producer's link one transfer at a time (``tokens · KV bytes per token / link bandwidth``); when it lands
the consumer computes the last prompt token and the producer frees its blocks.

Routing: the HTTP router's own policies (:mod:`goodserve.router.policies`) choose the instance from one
:class:`~goodserve.router.policies.BackendState` per instance, kept by the simulation's events as the router
keeps it (colocated replicas by ``ClusterConfig.routing``, a prefill pool by queued prefill tokens, a decode
pool by KV usage, read exactly from its scheduler).
"""

from __future__ import annotations

import dataclasses
import heapq
import itertools
import logging
import random
from dataclasses import dataclass, field
from typing import Optional

from goodserve.kv_transfer import KVConnectorOutput, KVTransferConfig, KVTransferParams
from goodserve.kv_transfer.factory import create_connector_scheduler
from goodserve.request import Request
from goodserve.request_options import RequestOptions
from goodserve.kv_events.events import InstanceLoad, KVEventBatch
from goodserve.kv_events.index import KVIndex
from goodserve.router.policies import BackendState, KVAware, LeastLoaded, RouteRequest, RoutingPolicy, make_policy
from goodserve.sampling_params import SamplingParams
from goodserve.scheduler.output import EngineCoreOutput, SampledToken, ScheduledRequest, SchedulerOutput
from goodserve.scheduler.scheduler import Scheduler
from goodserve.scheduler.policy import SLOUnattainableError
from goodserve.scheduler.step_time import StepTimeModel
from goodserve.sim.cost_model import CostModel
from goodserve.sim.events import Event, KVTransferDone, RequestArrival, StepEnd
from goodserve.sim.spec import ROUTING_ALIASES, ClusterConfig, SimRequest
from goodserve.workload.metrics import RequestRecord, Summary, record_from_timeline, summarize

logger = logging.getLogger(__name__)

SIM_TOKEN = 7  # what the simulated model samples ...
SIM_EOS = 2  # ... until a request's last token, which is EOS


class Instance:
    """One model instance: a real scheduler (whose step-time model is seeded from the cost model and then
    learns from the step times the cost model gives, as the engine's learns from measured ones), a cost
    model and step counters.

    Args:
        name: Display name, e.g. ``"replica0"``, ``"prefill1"``.
        role: ``"colocated"``, ``"prefill"`` or ``"decode"``.
        scheduler: Its scheduler.
        cost_model: Prices its steps.
    """

    def __init__(self, name: str, role: str, scheduler: Scheduler, cost_model: CostModel) -> None:
        self.name, self.role, self.scheduler, self.cost_model = name, role, scheduler, cost_model
        self.busy = False
        self.link_free_at = 0.0  # prefill instances: when the outgoing link is next idle
        self.kv_news = KVConnectorOutput()  # what its KV connector would report at its next update
        self.num_steps = 0
        self.busy_s = 0.0
        self.max_running = 0
        self.num_mixed_steps = 0  # steps with both prefill chunks and decodes
        self.num_tokens = 0

    @property
    def load(self) -> int:
        """Unfinished requests (running + waiting), counting those whose KV is on its way."""
        stats = self.scheduler.make_stats()
        return stats.num_running + stats.num_waiting + stats.num_kv_transfers_in_flight

    def take_kv_news(self) -> Optional[KVConnectorOutput]:
        """The connector's news since the last update (``None`` if there is none)."""
        news = self.kv_news
        if not (news.finished_sending or news.finished_recving or news.failed_recving):
            return None
        self.kv_news = KVConnectorOutput()
        return news

    def stats(self, duration: float) -> dict:
        s = self.scheduler.make_stats()
        return {
            "name": self.name, "role": self.role, "steps": self.num_steps, "busy_s": self.busy_s,
            "utilisation": self.busy_s / duration if duration > 0 else 0.0,
            "mean_tokens_per_step": self.num_tokens / self.num_steps if self.num_steps else 0.0,
            "max_running": self.max_running, "mixed_steps": self.num_mixed_steps,
            "preemptions": s.num_preemptions_total, "prefix_cache_hit_rate": s.prefix_cache_hit_rate,
        }


@dataclass
class _Progress:
    """The simulator's view of one logical request across instances."""

    spec: SimRequest
    prompt_token_ids: list[int]
    token_times: list[float] = field(default_factory=list)
    producer: Optional["Instance"] = None  # disaggregated: the prefill instance holding its KV
    finished: Optional[float] = None
    num_preemptions: int = 0
    transfer_s: float = 0.0
    error: str = ""


@dataclass
class SimResult:
    """Outcome of one simulation.

    Attributes:
        summary: The benchmark's summary (TTFT, TPOT, ITL, E2E, throughput, SLO attainment, goodput).
        records: One record per request, in workload order.
        instances: Per-instance counters (see :meth:`Instance.stats`).
        num_preemptions: Preemptions over all instances.
        mean_kv_transfer_s: Mean transfer time of disaggregated requests (0 when colocated).
        prefix_cache_hit_rate: Prompt tokens found in a prefix cache over prompt tokens looked up, over all
            the front instances (replicas, or prefill instances).
    """

    summary: Summary
    records: list[RequestRecord]
    instances: list[dict]
    num_preemptions: int
    mean_kv_transfer_s: float
    prefix_cache_hit_rate: float = 0.0

    def to_dict(self, with_records: bool = False) -> dict:
        d = {"summary": self.summary.to_dict(), "instances": self.instances,
             "num_preemptions": self.num_preemptions, "mean_kv_transfer_s": self.mean_kv_transfer_s,
             "prefix_cache_hit_rate": self.prefix_cache_hit_rate}
        if with_records:
            d["records"] = [r.to_dict() for r in self.records]
        return d


class Simulator:
    """Heap-based event loop over the instances of a :class:`ClusterConfig`.

    Args:
        config: The cluster.
        cost_model: Prices every instance's steps.
        requests: The workload (any order; arrivals are queued by time).
        slos: SLO limits in seconds for the summary (``"ttft"``, ``"tpot"``, ``"e2el"``).

    Raises:
        ValueError: on duplicate request ids or a bad config.
    """

    def __init__(self, config: ClusterConfig, cost_model: CostModel, requests: list[SimRequest],
                 slos: Optional[dict[str, float]] = None) -> None:
        if len({r.request_id for r in requests}) != len(requests):
            raise ValueError("request ids must be unique")
        self.config = config
        self.requests = list(requests)
        self.slos = dict(slos or {})
        self.now = 0.0
        self._queue: list[tuple[float, int, Event]] = []
        self._seq = itertools.count()
        self._progress: dict[str, _Progress] = {}
        d = config.disaggregation
        routing = ROUTING_ALIASES.get(config.routing, config.routing)
        self._kv_events = d is None and routing == KVAware.name  # the router reads the replicas' KV events
        if d is None:
            self.front = [self._instance(f"replica{i}", "colocated", config.enable_prefix_caching, cost_model)
                          for i in range(config.num_replicas)]
            self.decode: list[Instance] = []
        else:
            self.front = [self._instance(f"prefill{i}", "prefill", config.enable_prefix_caching, cost_model)
                          for i in range(d.num_prefill)]
            self.decode = [self._instance(f"decode{i}", "decode", True, cost_model) for i in range(d.num_decode)]
        self.instances = self.front + self.decode
        self.kv_index = KVIndex(config.cache.block_size)
        front = LeastLoaded("queued_prefill_tokens")
        if d is None:
            front = make_policy(routing, **(dict(index=self.kv_index, clock=lambda: self.now,
                                                 token_budget=config.scheduler.max_num_batched_tokens)
                                            if self._kv_events else {}))
        self._policies: dict[str, RoutingPolicy] = {
            "front": front,
            "decode": LeastLoaded("kv_usage")}
        self.backend_states = {inst.name: BackendState(inst.name) for inst in self.instances}
        # name -> request id -> (route, prefilled, prefill tokens counted)
        self._routed: dict[str, dict[str, tuple[RouteRequest, bool, int]]] = {inst.name: {} for inst in self.instances}
        self._spec_rng = random.Random(0)  # draws which drafts are accepted

    def _instance(self, name: str, role: str, prefix_caching: bool, cost_model: CostModel) -> Instance:
        cache = dataclasses.replace(self.config.cache, enable_prefix_caching=prefix_caching,
                                    enable_kv_events=self._kv_events)
        step_model = StepTimeModel.seeded_by(cost_model.predict)
        kv_role = {"prefill": "producer", "decode": "consumer"}.get(role)
        # A producer's hold ends when the pull lands (the simulated links never fail): no timeout. No socket is
        # bound here: the handle's port only has to be a valid one.
        kv = create_connector_scheduler(KVTransferConfig(kv_role, engine_id=name, port=1, timeout=float("inf")),
                                        cache.block_size) if kv_role else None
        speculative = self.config.speculative if role != "prefill" else None  # a producer samples one token
        return Instance(name, role, Scheduler(self.config.scheduler, cache, step_model, kv, speculative),
                        cost_model)

    # ------------------------------------------------------------------------------------------ loop
    def push(self, event: Event) -> None:
        """Queue an event (ties in time keep queueing order)."""
        heapq.heappush(self._queue, (event.time, next(self._seq), event))

    def run(self) -> SimResult:
        """Simulate until every request has finished (or failed).

        Raises:
            RuntimeError: if a scheduler schedules nothing while it has unfinished requests.
        """
        for i, spec in enumerate(self.requests):
            self.push(RequestArrival(spec.arrival, i))
        while self._queue:
            self.now = self._queue[0][0]
            while self._queue and self._queue[0][0] == self.now:
                heapq.heappop(self._queue)[2].apply(self)
            for inst in self.instances:
                if not inst.busy and inst.scheduler.has_unfinished_requests():
                    self._start_step(inst)
        return self._result()

    def _start_step(self, inst: Instance) -> None:
        out = inst.scheduler.schedule(self.now)
        for load in out.kv_loads:
            self._start_transfer(inst, load.request_id, load.end - load.start)
        if out.is_empty:
            transfers = inst.scheduler.has_pending_kv_transfers()
            # Shed requests, and the connector's news.
            results = inst.scheduler.update_from_output(out, {}, self.now, inst.take_kv_news())
            self._count_out(inst, (), results)
            self._finish_results(inst, results)
            if inst.scheduler.has_unfinished_requests() and not transfers:
                raise RuntimeError(f"{inst.name}: requests are pending but the scheduler scheduled nothing")
            return
        step_s = inst.cost_model.step_time(out)
        inst.busy = True
        inst.num_steps += 1
        inst.busy_s += step_s
        inst.num_tokens += out.total_num_scheduled_tokens
        inst.max_running = max(inst.max_running, inst.scheduler.make_stats().num_running)
        if out.num_decode_tokens and out.num_prefill_tokens:
            inst.num_mixed_steps += 1
        self.push(StepEnd(self.now + step_s, inst, out, self.now))

    # ---------------------------------------------------------------------------------------- events
    def on_request_arrival(self, ev: RequestArrival) -> None:
        spec = self.requests[ev.index]
        # Distinct ids per request: the trace carries no text, so no two prompts share a prefix.
        base = (ev.index + 1) << 24
        ids = list(spec.prompt_token_ids) if spec.prompt_token_ids is not None else list(range(base, base + spec.prompt_len))
        prog = _Progress(spec, ids)
        self._progress[spec.request_id] = prog
        if self.config.disaggregation is None:
            max_tokens, kv_params = spec.cap, None
        else:  # the router's first hop
            max_tokens, kv_params = 1, KVTransferParams(do_remote_decode=True)
        req = self._make_request(spec, prog.prompt_token_ids, max_tokens, kv_params)
        route = RouteRequest(prompt_tokens=spec.prompt_len, max_tokens=max_tokens, token_ids=tuple(ids))
        inst = self._route(self.front, "front", route)
        try:
            inst.scheduler.add_request(req)
        except (ValueError, SLOUnattainableError) as exc:
            prog.error = str(exc)
            return
        state = self.backend_states[inst.name]
        counted = state.start(route, self._policies["front"].prefill_tokens(state, route))
        self._routed[inst.name][spec.request_id] = (route, False, counted)

    def on_step_end(self, ev: StepEnd) -> None:
        inst, out = ev.instance, ev.output
        inst.busy = False
        sampled = {s.request_id: self._sample(s) for s in out.sampling()}
        inst.scheduler.observe_step_time(out, self.now - ev.start)
        results = inst.scheduler.update_from_output(out, sampled, self.now, inst.take_kv_news())
        if inst.role != "prefill":  # a producer's token is not the client's (the router drops it)
            for rid, token in sampled.items():
                self._progress[rid].token_times.extend([self.now] * (1 + len(token.accepted)))
        self._count_out(inst, sampled, results)
        self._finish_results(inst, results)

    def _count_out(self, inst: Instance, sampled, results: list[EngineCoreOutput]) -> None:
        """Update ``inst``'s routing counters: first tokens end prefills, finished requests leave."""
        routed, state = self._routed[inst.name], self.backend_states[inst.name]
        for rid in sampled:
            entry = routed.get(rid)
            if entry is not None and not entry[1]:
                state.prefilled(entry[0], entry[2])
                routed[rid] = (entry[0], True, entry[2])
        for result in results:
            if result.finished and result.request_id in routed:
                route, prefilled, counted = routed.pop(result.request_id)
                state.finish(route, prefilled, counted)

    def _finish_results(self, inst: Instance, results: list[EngineCoreOutput]) -> None:
        for result in results:
            if not result.finished:
                continue
            prog = self._progress[result.request_id]
            prog.num_preemptions += result.num_preemptions
            if result.finish_reason in ("shed", "error"):
                prog.error = result.error or result.finish_reason
            elif inst.role == "prefill":
                self._second_hop(inst, prog, result.kv_transfer_params)
            else:
                prog.finished = self.now

    def _sample(self, s: ScheduledRequest) -> SampledToken:
        """The simulated model's tokens for one row: :data:`SIM_TOKEN` until the request's last, which is
        :data:`SIM_EOS`; under speculation each draft (always :data:`SIM_TOKEN`) is accepted with its
        position's rate, never past the request's end, and the next drafts are proposed."""
        prog = self._progress[s.request_id]
        left = prog.spec.output_len - len(prog.token_times)  # tokens still to come, this step's included
        rates = self.config.spec_acceptance
        accepted = 0
        while accepted < len(s.spec_token_ids) and accepted + 1 < left and \
                self._spec_rng.random() < rates[min(accepted, len(rates) - 1)]:
            accepted += 1
        final = SIM_EOS if accepted + 1 >= left else SIM_TOKEN
        return SampledToken(final, accepted=[SampledToken(SIM_TOKEN) for _ in range(accepted)],
                            spec_token_ids=[SIM_TOKEN] * s.num_lookahead)

    def _second_hop(self, producer: Instance, prog: _Progress, handle: dict) -> None:
        """The router's second hop: the request, with the producer's handle, to a decode instance."""
        prog.producer = producer
        spec = prog.spec
        req = self._make_request(spec, prog.prompt_token_ids, spec.cap, KVTransferParams.from_dict(handle))
        try:
            self._route(self.decode, "decode").scheduler.add_request(req)
        except (ValueError, SLOUnattainableError) as exc:
            prog.error = str(exc)
            producer.kv_news.finished_sending.append(spec.request_id)  # nobody will pull: the hold ends
            self._deliver_kv_news(producer)

    def _start_transfer(self, consumer: Instance, request_id: str, num_tokens: int) -> None:
        """A consumer's scheduler asked for a pull: it crosses the producer's link, after the pulls before it."""
        prog = self._progress[request_id]
        link = prog.producer
        start = max(self.now, link.link_free_at)
        done = start + self.config.disaggregation.transfer_time(num_tokens)
        link.link_free_at = done
        prog.transfer_s = done - self.now
        nbytes = num_tokens * self.config.disaggregation.kv_bytes_per_token
        self.push(KVTransferDone(done, request_id, consumer, nbytes, prog.transfer_s))

    def on_kv_transfer_done(self, ev: KVTransferDone) -> None:
        """A pull landed: both ends' connectors report it at their next update (at once if idle)."""
        prog = self._progress[ev.request_id]
        ev.instance.kv_news.finished_recving[ev.request_id] = (ev.nbytes, ev.seconds)
        prog.producer.kv_news.finished_sending.append(ev.request_id)
        self._deliver_kv_news(ev.instance)
        self._deliver_kv_news(prog.producer)

    def _deliver_kv_news(self, inst: Instance) -> None:
        """Hand an idle instance's scheduler its connector's news now (a busy one gets it when its step ends)."""
        news = None if inst.busy else inst.take_kv_news()
        if news is not None:
            results = inst.scheduler.update_from_output(SchedulerOutput(), {}, self.now, news)
            self._count_out(inst, (), results)
            self._finish_results(inst, results)

    def _route(self, group: list[Instance], key: str, request: Optional[RouteRequest] = None) -> Instance:
        """The instance of ``group`` (``key``: ``"front"`` or ``"decode"``) the router's policy picks for
        ``request`` (a decode hop passes none: only the pool's load matters there)."""
        states = [self.backend_states[inst.name] for inst in group]
        for inst, state in zip(group, states):
            state.kv_usage = inst.scheduler.make_stats().kv_cache_usage
            if self._kv_events and key == "front":  # the replicas' KV events and load reach the router
                events = tuple(inst.scheduler.kv_cache_manager.take_kv_events())
                self.kv_index.apply(inst.name, KVEventBatch(self.now, events, InstanceLoad.of(inst.scheduler),
                                                            stream_id=inst.name))
            if key == "decode":
                state.outstanding_requests = inst.load
        return group[self._policies[key].select(states, request or RouteRequest(0, 0))]

    # --------------------------------------------------------------------------------------- results
    def _result(self) -> SimResult:
        records = []
        for spec in self.requests:
            prog = self._progress.get(spec.request_id)
            if prog is None or prog.finished is None:
                error = prog.error if prog else "never arrived"
                records.append(RequestRecord(arrival=spec.arrival, prompt_tokens=spec.prompt_len,
                                             success=False, error=error or "unfinished"))
                continue
            records.append(record_from_timeline(spec.arrival, prog.token_times, prog.finished, spec.prompt_len,
                                                len(prog.token_times), arrival=spec.arrival))
        duration = max([p.finished for p in self._progress.values() if p.finished is not None], default=0.0)
        transfers = [p.transfer_s for p in self._progress.values() if p.transfer_s > 0]
        return SimResult(
            summary=summarize(records, duration if duration > 0 else 1e-9, self.slos),
            records=records,
            instances=[inst.stats(duration) for inst in self.instances],
            num_preemptions=sum(inst.scheduler.make_stats().num_preemptions_total for inst in self.instances),
            mean_kv_transfer_s=sum(transfers) / len(transfers) if transfers else 0.0,
            prefix_cache_hit_rate=_hit_rate(self.front),
        )

    def _make_request(self, spec: SimRequest, prompt_token_ids: list[int], max_tokens: int,
                      kv_transfer_params: Optional[KVTransferParams] = None) -> Request:
        """The scheduler's request for ``spec`` arriving now, with its SLOs (or the simulation's)."""
        slo_ttft = spec.slo_ttft if spec.slo_ttft is not None else self.slos.get("ttft")
        slo_tpot = spec.slo_tpot if spec.slo_tpot is not None else self.slos.get("tpot")
        # A client that asks for exactly the output length forces it, as the bench client does (ignore_eos);
        # one that asks for more stops at an EOS the scheduler cannot foresee.
        params = SamplingParams(max_tokens=max_tokens, ignore_eos=spec.cap == spec.output_len)
        return Request(spec.request_id, prompt_token_ids, params, arrival_time=self.now,
                       eos_token_ids=(SIM_EOS,), max_tokens=max_tokens,
                       options=RequestOptions(slo_ttft=slo_ttft, slo_tpot=slo_tpot,
                                              kv_transfer_params=kv_transfer_params))


def _hit_rate(instances: list[Instance]) -> float:
    stats = [inst.scheduler.make_stats() for inst in instances]
    queries = sum(s.prefix_cache_queries for s in stats)
    return sum(s.prefix_cache_hits for s in stats) / queries if queries else 0.0


