"""Prometheus metrics of the server, named like vLLM's with the prefix ``goodserve:``.

Every app gets its own :class:`prometheus_client.CollectorRegistry` (tests build several apps in one
process). Engine-wide state (running/waiting requests, tokens waiting, KV usage, preemptions, prefix-cache
counters) is read from the scheduler's :class:`~goodserve.scheduler.output.SchedulerStats` at scrape time by
a custom collector; per-request counters and histograms are fed by a :class:`RequestTracker` per request as
its delta outputs arrive on the event loop.

Latencies are in seconds, measured on the engine's monotonic clock:
TTFT = first token - arrival; ITL = gap between successive tokens; TPOT = (last - first) / (n - 1);
queue = first scheduled - arrival; prefill = first token - first scheduled; decode = last - first token.

Goodput (Zhong et al., DistServe, OSDI 2024, §2): every request with an SLO set (the engine's
``--slo-ttft`` / ``--slo-tpot``, a ``--slo-class`` it names, or its own ``slo_*_ms``) that finishes (stop or
length) counts in ``request_slo_attained_total`` when it met all its SLOs, else in
``request_slo_missed_total``, labelled by SLO class (:mod:`goodserve.server.slo_classes`); a request shed by
the ``slo`` policy counts in ``num_requests_shed``. The scheduler's online step-time model reports its
predictions beside the measured step times (``step_time_predicted_seconds_total``,
``step_time_actual_seconds_total``, ``step_time_prediction_abs_error_seconds_total``): their ratio is the
model's relative error.

Disaggregated serving (``--kv-role``): a consumer observes each pull of a prompt's K/V in
``kv_transfer_bytes`` and ``kv_transfer_seconds`` (histograms) and counts failed pulls; a producer shows the
blocks it holds for pulls, the holds that timed out, and every hold's end by reason
(``kv_transfer_holds_released_total{reason="pulled|aborted|failed|expired"}``); both show pulls in flight,
and a consumer the blocks of given-up pulls whose READ has not ended yet (``kv_transfer_blocks_quarantined``).

Every HTTP call to an API endpoint ends in exactly one of four counters, so a load test can account for all
it sent: ``api_requests_finished_total`` (answered in full), ``api_requests_rejected_total`` (429, by
reason), ``api_requests_aborted_total`` (the client went away first) and ``api_requests_failed_total`` (an
error body, 4xx or 5xx, by status code and reason; a stream that ends in an error event counts here with
the event's code). The ``request_*`` metrics above count engine requests (one per choice and prompt).
"""

from __future__ import annotations

from collections import Counter as Tally
from typing import Iterable, Optional

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from goodserve.engine.async_engine import AsyncEngine
from goodserve.workload.slo import meets_slo
from goodserve.outputs import RequestOutput
from goodserve.request_options import RequestOptions
from goodserve.scheduler.output import SchedulerStats
from goodserve.server.slo_classes import SLOTarget

PREFIX = "goodserve:"
# The API calls whose outcomes are counted (one of finished, aborted, rejected, failed each).
COUNTED_ENDPOINTS = ("/v1/completions", "/v1/chat/completions", "/tokenize", "/detokenize")
_COUNTED = "goodserve.counted"  # set in a call's ASGI scope once its outcome is counted

# 1 ms .. 40 min
LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75,
                   1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 320.0, 640.0, 1280.0, 2400.0)
# 1 KiB .. 4 GiB
BYTE_BUCKETS = tuple(float(1 << k) for k in range(10, 33, 2))
# 1 .. 128k tokens
TOKEN_BUCKETS = (1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000, 10000, 20000, 50000, 100000, 131072)


class _EngineCollector(Collector):
    """Gauges and engine-wide counters read from the scheduler's stats at scrape time."""

    def __init__(self, engine: AsyncEngine) -> None:
        self._engine = engine
        # What one cached token costs (Engine.kv_cache_bytes_per_token); None for an engine that does not say.
        per_token = getattr(getattr(engine, "engine", None), "kv_cache_bytes_per_token", None)
        self._kv_bytes_per_token = per_token if isinstance(per_token, int) else None

    def collect(self) -> Iterable[Metric]:
        s = self._engine.stats
        if self._kv_bytes_per_token is not None:
            yield GaugeMetricFamily(PREFIX + "kv_cache_bytes_per_token",
                                    "Bytes one token occupies in the served model's KV cache (every layer's K and V "
                                    "rows, an int8 row's float32 scale included; a draft model's cache is extra).",
                                    value=self._kv_bytes_per_token)
        yield GaugeMetricFamily(PREFIX + "num_requests_running", "Requests in the running batch.",
                                value=s.num_running)
        yield GaugeMetricFamily(PREFIX + "num_requests_waiting", "Requests waiting for admission.",
                                value=s.num_waiting)
        yield GaugeMetricFamily(PREFIX + "num_tokens_waiting",
                                "Prompt tokens not yet computed (waiting requests and prefill remainders).",
                                value=s.num_tokens_waiting)
        yield GaugeMetricFamily(PREFIX + "kv_cache_usage_perc", "Fraction of KV-cache blocks in use (0-1).",
                                value=s.kv_cache_usage)
        yield GaugeMetricFamily(PREFIX + "prefix_cache_blocks",
                                "Blocks registered in the prefix cache (in use or evictable): what its KV events "
                                "say it holds.", value=s.num_cached_blocks)
        yield GaugeMetricFamily(PREFIX + "engine_healthy", "1 while the engine loop runs, else 0.",
                                value=1.0 if self._engine.is_healthy() else 0.0)
        yield CounterMetricFamily(PREFIX + "num_preemptions", "Preemptions (recompute) since start.",
                                  value=s.num_preemptions_total)
        yield CounterMetricFamily(PREFIX + "prefix_cache_queries", "Prompt tokens looked up in the prefix cache.",
                                  value=s.prefix_cache_queries)
        yield CounterMetricFamily(PREFIX + "prefix_cache_hits", "Prompt tokens found in the prefix cache.",
                                  value=s.prefix_cache_hits)
        yield CounterMetricFamily(PREFIX + "num_requests_shed",
                                  "Requests refused by load shedding (slo policy): their TTFT SLO could not be met.",
                                  value=s.num_shed_total)
        yield CounterMetricFamily(PREFIX + "num_deferred_decodes",
                                  "Decodes that sat out a step so that prompts with a tighter TPOT SLO could meet their "
                                  "TTFT (slo policy).", value=s.num_deferred_decodes_total)
        yield CounterMetricFamily(PREFIX + "steps_observed", "Engine steps the step-time model observed.",
                                  value=s.num_steps_observed)
        yield CounterMetricFamily(PREFIX + "step_time_predicted_seconds",
                                  "Sum of the step-time model's predictions, made before each step ran (s).",
                                  value=s.step_time_predicted_s_total)
        yield CounterMetricFamily(PREFIX + "step_time_actual_seconds", "Sum of the measured step times (s).",
                                  value=s.step_time_actual_s_total)
        yield CounterMetricFamily(PREFIX + "step_time_prediction_abs_error_seconds",
                                  "Sum of |predicted - measured| step time (s).", value=s.step_time_abs_error_s_total)
        yield GaugeMetricFamily(PREFIX + "step_time_margin",
                                "The step-time model's margin: the 0.9 quantile of measured / predicted time over runs "
                                "of 16 recent steps (>= 1); the slo policy stretches predictions by it.",
                                value=s.step_time_margin)
        yield GaugeMetricFamily(PREFIX + "kv_transfer_blocks_held",
                                "KV blocks of finished requests held for a consumer's pull (producer).",
                                value=s.num_blocks_held_for_pull)
        yield GaugeMetricFamily(PREFIX + "kv_transfers_in_flight", "Pulls of prompt K/V not yet ended (consumer).",
                                value=s.num_kv_transfers_in_flight)
        yield GaugeMetricFamily(PREFIX + "kv_transfer_blocks_quarantined",
                                "KV blocks of failed or aborted pulls kept out of the pool until their READ ends, "
                                "since it may still write into them (consumer).",
                                value=s.num_kv_blocks_quarantined)
        yield CounterMetricFamily(PREFIX + "kv_transfer_timeouts",
                                  "Holds freed because no consumer pulled them in time (producer).",
                                  value=s.num_kv_transfer_timeouts_total)
        yield CounterMetricFamily(PREFIX + "kv_transfer_failures", "Pulls of prompt K/V that failed (consumer).",
                                  value=s.num_kv_transfer_failures_total)
        released = CounterMetricFamily(PREFIX + "kv_transfer_holds_released",
                                       "Holds of KV blocks for a consumer's pull that ended, by reason: pulled, "
                                       "aborted (the client left on either hop), failed (the consumer could not "
                                       "read), expired (= kv_transfer_timeouts) (producer).", labels=["reason"])
        for reason, n in s.num_kv_holds_ended_total.items():
            released.add_metric([reason], n)
        yield released
        yield from _spec_metrics(s)


def _spec_metrics(s: SchedulerStats) -> Iterable[Metric]:
    """Speculative decoding, under vLLM's ``spec_decode`` names: rows that verified drafts, draft tokens,
    accepted tokens, accepted tokens per position (the acceptance rate at position ``i`` is its count over
    the drafts that reached it), and the length the last step chose."""
    yield CounterMetricFamily(PREFIX + "spec_decode_num_drafts", "Decode rows that verified at least one draft token.",
                              value=s.num_spec_drafts_total)
    yield CounterMetricFamily(PREFIX + "spec_decode_num_draft_tokens", "Draft tokens verified.",
                              value=s.num_spec_draft_tokens_total)
    yield CounterMetricFamily(PREFIX + "spec_decode_num_accepted_tokens", "Draft tokens accepted.",
                              value=s.num_spec_accepted_tokens_total)
    per_pos = CounterMetricFamily(PREFIX + "spec_decode_num_accepted_tokens_per_pos",
                                  "Draft tokens accepted at each position (0 = the first draft).", labels=["position"])
    for i, n in enumerate(s.spec_accepted_per_pos):
        per_pos.add_metric([str(i)], n)
    yield per_pos
    yield GaugeMetricFamily(PREFIX + "spec_decode_length",
                            "Draft tokens per decode row chosen for the latest step (auto: 0 under load).",
                            value=s.spec_length)


class ServerMetrics:
    """All metrics of one app.

    Args:
        engine: The engine whose scheduler stats feed the gauges (and whose default SLOs are class ``default``).
        slo_classes: The server's named SLO classes (their attainment series exist from the start).
    """

    def __init__(self, engine: AsyncEngine, slo_classes: Optional[dict[str, SLOTarget]] = None) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        r.register(_EngineCollector(engine))

        def hist(name: str, doc: str, buckets: tuple) -> Histogram:
            return Histogram(PREFIX + name, doc, buckets=buckets, registry=r)

        self.prompt_tokens = Counter(PREFIX + "prompt_tokens", "Prompt tokens of requests that were prefilled.",
                                     registry=r)
        self.generation_tokens = Counter(PREFIX + "generation_tokens", "Generated tokens.", registry=r)
        self.request_success = Counter(PREFIX + "request_success", "Finished requests by finish reason.",
                                       ["finished_reason"], registry=r)
        self.slo_attained = Counter(PREFIX + "request_slo_attained",
                                    "Finished requests that met every SLO they had, by SLO class.", ["slo_class"],
                                    registry=r)
        self.slo_missed = Counter(PREFIX + "request_slo_missed",
                                  "Finished requests that missed an SLO they had, by SLO class.", ["slo_class"],
                                  registry=r)
        for name in ["default", *(slo_classes or {})]:
            self.slo_attained.labels(slo_class=name)
            self.slo_missed.labels(slo_class=name)
        self.ttft = hist("time_to_first_token_seconds", "Time to first token (s).", LATENCY_BUCKETS)
        self.itl = hist("inter_token_latency_seconds", "Gap between successive output tokens (s).",
                        LATENCY_BUCKETS)
        self.tpot = hist("request_time_per_output_token_seconds", "Per request: (last - first token) / (n - 1) (s).",
                         LATENCY_BUCKETS)
        self.e2e = hist("e2e_request_latency_seconds", "Arrival to finish (s).", LATENCY_BUCKETS)
        self.queue = hist("request_queue_time_seconds", "Arrival to first scheduled (s).", LATENCY_BUCKETS)
        self.prefill = hist("request_prefill_time_seconds", "First scheduled to first token (s).", LATENCY_BUCKETS)
        self.decode = hist("request_decode_time_seconds", "First token to last token (s).", LATENCY_BUCKETS)
        self.req_prompt_tokens = hist("request_prompt_tokens", "Prompt tokens per finished request.", TOKEN_BUCKETS)
        self.req_generation_tokens = hist("request_generation_tokens", "Generated tokens per finished request.",
                                          TOKEN_BUCKETS)
        self.kv_transfer_bytes = hist("kv_transfer_bytes", "Bytes of prompt K/V pulled per request (consumer).",
                                      BYTE_BUCKETS)
        self.kv_transfer_seconds = hist("kv_transfer_seconds", "Seconds per pull of a prompt's K/V (consumer).",
                                        LATENCY_BUCKETS)
        for reason in ("stop", "length", "abort", "error", "shed"):
            self.request_success.labels(finished_reason=reason)
        self.api_finished = Counter(PREFIX + "api_requests_finished", "API calls answered in full.", ["endpoint"],
                                    registry=r)
        self.api_rejected = Counter(PREFIX + "api_requests_rejected", "API calls refused with 429 (admission).",
                                    ["endpoint", "reason"], registry=r)
        self.api_aborted = Counter(PREFIX + "api_requests_aborted", "API calls the client left before the end.",
                                   ["endpoint"], registry=r)
        self.api_failed = Counter(PREFIX + "api_requests_failed",
                                  "API calls answered with an error body (4xx, 5xx or an error event in a stream).",
                                  ["endpoint", "status_code", "reason"], registry=r)
        self.outcomes: Tally = Tally()  # the same four outcomes, summed over labels (for the exit log)

    def count(self, scope: dict, outcome: str, status: Optional[int] = None, reason: str = "") -> None:
        """Count how one API call ended, once: later calls for the same call are ignored, and so are calls to
        routes that are not API endpoints (``COUNTED_ENDPOINTS``).

        Args:
            scope: The call's ASGI scope (``request.scope``); it remembers that the call was counted.
            outcome: ``"finished"``, ``"aborted"`` or ``"error"`` (a 429 is a rejection, else a failure).
            status: The error's HTTP status (``"error"`` only).
            reason: The error's reason label (``"error"`` only).
        """
        endpoint = scope.get("path")
        if endpoint not in COUNTED_ENDPOINTS or scope.get(_COUNTED):
            return
        scope[_COUNTED] = True
        if outcome == "finished":
            self.api_finished.labels(endpoint=endpoint).inc()
        elif outcome == "aborted":
            self.api_aborted.labels(endpoint=endpoint).inc()
        elif status == 429:
            outcome = "rejected"
            self.api_rejected.labels(endpoint=endpoint, reason=reason).inc()
        else:
            outcome = "failed"
            self.api_failed.labels(endpoint=endpoint, status_code=str(status), reason=reason).inc()
        self.outcomes[outcome] += 1

    def tracker(self, options: RequestOptions) -> "RequestTracker":
        """A tracker for one new engine request with these options (its SLOs and their class)."""
        return RequestTracker(self, options)


class RequestTracker:
    """Feeds one request's outputs into the metrics (event loop thread)."""

    def __init__(self, metrics: ServerMetrics, options: RequestOptions) -> None:
        self.m = metrics
        self.options = options
        self.num_tokens = 0
        self.last_token_time: Optional[float] = None
        self.prompt_counted = False
        self.done = False

    def observe(self, out: RequestOutput) -> None:
        """Record the new tokens of a delta output, and the request's latencies once it finished."""
        if self.done:
            return
        m, met = self.m, out.metrics
        new = len(out.token_ids)
        if new > 0:
            m.generation_tokens.inc(new)
            if not self.prompt_counted:
                m.prompt_tokens.inc(len(out.prompt_token_ids))
                self.prompt_counted = True
            last = met.last_token_time if met is not None else None
            if self.last_token_time is not None and last is not None:
                m.itl.observe(max(0.0, last - self.last_token_time) / new)
            self.last_token_time = last
            self.num_tokens += new
        if out.finished:
            self.done = True
            m.request_success.labels(finished_reason=out.finish_reason or "abort").inc()
            if met is None:
                return
            for hist, value in ((m.ttft, met.ttft), (m.tpot, met.tpot), (m.e2e, met.e2e_latency),
                                (m.queue, met.queue_time)):
                if value is not None:
                    hist.observe(value)
            if met.first_token_time is not None and met.first_scheduled_time is not None:
                m.prefill.observe(met.first_token_time - met.first_scheduled_time)
            if met.first_token_time is not None and met.last_token_time is not None:
                m.decode.observe(met.last_token_time - met.first_token_time)
            if met.kv_transfer_bytes is not None:
                m.kv_transfer_bytes.observe(met.kv_transfer_bytes)
                m.kv_transfer_seconds.observe(met.kv_transfer_seconds)
            m.req_prompt_tokens.observe(len(out.prompt_token_ids))
            m.req_generation_tokens.observe(self.num_tokens)
            o = self.options
            if out.finish_reason in ("stop", "length") and o.has_slo:
                met_slo = meets_slo(met.ttft, met.tpot, o.slo_ttft, o.slo_tpot)
                (m.slo_attained if met_slo else m.slo_missed).labels(slo_class=o.slo_class).inc()

    def ended(self, reason: str) -> None:
        """The request ended without a finished output: ``"abort"`` (client gone) or ``"error"`` (failed)."""
        if not self.done:
            self.done = True
            self.m.request_success.labels(finished_reason=reason).inc()
