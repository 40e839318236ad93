"""Per-request latency records and their summary: TTFT, TPOT, ITL, E2E, SLO attainment, goodput.

Pure Python on purpose (no torch, no HTTP): the serving benchmark fills ``RequestRecord`` from
streamed chunks, and the simulator fills the same records from simulated timestamps, so both are
summarised by one ``summarize``.

Definitions (the papers' terms; all times in seconds):

* **TTFT** (time to first token): from the moment the request is sent to the first streamed chunk
  that carries output.
* **ITL** (inter-token latency): each gap between consecutive output chunks *after the first*.
  TTFT is never an ITL (case C11): a request with ``n`` output chunks has ``n - 1`` ITLs.
* **TPOT** (time per output token): ``(e2e - ttft) / (output_tokens - 1)`` per request; undefined
  (``None``) for a single-token output.
* **E2E** (end-to-end latency): from sending the request to its last byte.
* **SLO attainment**: the fraction of *all* requests (failed ones count as misses) that succeeded and
  met every given SLO (Zhong et al., "DistServe", OSDI 2024), judged by
  :func:`goodserve.workload.slo.meets_slo`.
* **Goodput**: such requests per second of benchmark duration.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from typing import Iterable, Optional, Sequence

from goodserve.workload.slo import SLO_METRICS, meets_slo

PERCENTILES = (50.0, 90.0, 99.0)


@dataclass
class RequestRecord:
    """What one benchmark request did, measured at the client (or in the simulator).

    Attributes:
        arrival: When the request was sent, seconds from the benchmark start.
        ttft: Time to first token in seconds (``None`` if no token came back).
        itls: Gaps in seconds between consecutive output chunks after the first (C11: never TTFT).
        e2e: End-to-end latency in seconds (``None`` if the request failed before finishing).
        prompt_tokens: Prompt length in tokens.
        output_tokens: Output tokens generated (from the server's usage when it reports one).
        success: Whether the request completed without an error.
        error: The error message of a failed request, else ``""``.
        expected_output_tokens: The ``max_tokens`` asked for, when known (``None`` otherwise).
    """

    arrival: float = 0.0
    ttft: Optional[float] = None
    itls: list[float] = field(default_factory=list)
    e2e: Optional[float] = None
    prompt_tokens: int = 0
    output_tokens: int = 0
    success: bool = False
    error: str = ""
    expected_output_tokens: Optional[int] = None

    @property
    def tpot(self) -> Optional[float]:
        """``(e2e - ttft) / (output_tokens - 1)`` in seconds, or ``None`` if undefined."""
        if not self.success or self.ttft is None or self.e2e is None or self.output_tokens < 2:
            return None
        return (self.e2e - self.ttft) / (self.output_tokens - 1)

    def meets(self, slos: dict[str, float]) -> bool:
        """Whether this request succeeded and met every SLO in ``slos`` (name -> limit in seconds).

        The rules are :func:`~goodserve.workload.slo.meets_slo`'s (a TPOT SLO is met trivially by a
        single-token output), after two of the record's own: a failed request misses, and so does a
        record without any token under a TPOT SLO.
        """
        if not self.success or ("tpot" in slos and self.ttft is None):
            return False
        return meets_slo(self.ttft, self.tpot, slos.get("ttft"), slos.get("tpot"),
                         e2e=self.e2e, slo_e2e=slos.get("e2el"))

    def to_dict(self) -> dict:
        """A JSON-ready dict, with the derived ``tpot`` added."""
        d = asdict(self)
        d["tpot"] = self.tpot
        return d


@dataclass(frozen=True)
class Stat:
    """Mean, median, p90 and p99 of one latency metric, in seconds (``nan`` when there is no sample)."""

    mean: float
    median: float
    p90: float
    p99: float
    count: int

    @classmethod
    def of(cls, values: Sequence[float]) -> "Stat":
        """Summarise ``values`` (percentiles by linear interpolation, like ``numpy.percentile``)."""
        if not values:
            nan = float("nan")
            return cls(nan, nan, nan, nan, 0)
        s = sorted(values)
        return cls(sum(s) / len(s), percentile(s, 50), percentile(s, 90), percentile(s, 99), len(s))


def percentile(sorted_values: Sequence[float], q: float) -> float:
    """The ``q``-th percentile (0..100) of already sorted values, by linear interpolation.

    Matches ``numpy.percentile(values, q)`` (its default "linear" method).

    Raises:
        ValueError: for an empty sequence or ``q`` outside [0, 100].
    """
    if not sorted_values:
        raise ValueError("percentile of an empty sequence")
    if not 0.0 <= q <= 100.0:
        raise ValueError(f"percentile q must be in [0, 100], got {q}")
    pos = (len(sorted_values) - 1) * q / 100.0
    lo = math.floor(pos)
    hi = min(lo + 1, len(sorted_values) - 1)
    frac = pos - lo
    return sorted_values[lo] + (sorted_values[hi] - sorted_values[lo]) * frac


@dataclass(frozen=True)
class Summary:
    """Aggregate metrics of one benchmark run.

    Attributes:
        duration: Benchmark wall time in seconds (first send to last completion).
        num_requests: All requests, failed ones included.
        completed: Requests that succeeded.
        failed: Requests that failed.
        errors: The first few distinct error messages.
        total_input_tokens: Prompt tokens of the completed requests.
        total_output_tokens: Output tokens of the completed requests.
        request_throughput: Completed requests per second.
        output_throughput: Output tokens per second.
        total_token_throughput: Prompt plus output tokens per second.
        ttft, tpot, itl, e2el: Latency statistics in seconds (over completed requests; ITL over all gaps).
        slos: The SLOs applied (name -> limit in seconds); empty if none.
        attainment: Fraction of all requests that succeeded and met every SLO (1.0 of completed
            requests when no SLO is given).
        goodput: Requests meeting every SLO per second of ``duration``.
    """

    duration: float
    num_requests: int
    completed: int
    failed: int
    errors: tuple[str, ...]
    total_input_tokens: int
    total_output_tokens: int
    request_throughput: float
    output_throughput: float
    total_token_throughput: float
    ttft: Stat
    tpot: Stat
    itl: Stat
    e2el: Stat
    slos: dict[str, float]
    attainment: float
    goodput: float

    def to_dict(self) -> dict:
        """A JSON-ready dict."""
        return asdict(self)


def summarize(records: Iterable[RequestRecord], duration: float,
              slos: Optional[dict[str, float]] = None, max_errors: int = 5) -> Summary:
    """Summarise per-request records.

    Args:
        records: One record per request sent, failed ones included (they are counted, never dropped).
        duration: Benchmark wall time in seconds; must be positive.
        slos: SLO limits in seconds keyed by ``"ttft"``, ``"tpot"``, ``"e2el"``; ``None`` for none.
        max_errors: How many distinct error messages to keep.

    Returns:
        The ``Summary``.

    Raises:
        ValueError: for a non-positive duration or an unknown SLO name.
    """
    records = list(records)
    slos = dict(slos or {})
    if duration <= 0:
        raise ValueError(f"duration must be positive, got {duration}")
    unknown = set(slos) - set(SLO_METRICS)
    if unknown:
        raise ValueError(f"unknown SLO metric(s) {sorted(unknown)}; choose from {SLO_METRICS}")
    ok = [r for r in records if r.success]
    errors: list[str] = []
    for r in records:
        if not r.success and r.error not in errors and len(errors) < max_errors:
            errors.append(r.error)
    in_tok = sum(r.prompt_tokens for r in ok)
    out_tok = sum(r.output_tokens for r in ok)
    good = sum(1 for r in records if r.meets(slos))
    return Summary(
        duration=duration,
        num_requests=len(records),
        completed=len(ok),
        failed=len(records) - len(ok),
        errors=tuple(errors),
        total_input_tokens=in_tok,
        total_output_tokens=out_tok,
        request_throughput=len(ok) / duration,
        output_throughput=out_tok / duration,
        total_token_throughput=(in_tok + out_tok) / duration,
        ttft=Stat.of([r.ttft for r in ok if r.ttft is not None]),
        tpot=Stat.of([t for t in (r.tpot for r in ok) if t is not None]),
        itl=Stat.of([gap for r in ok for gap in r.itls]),
        e2el=Stat.of([r.e2e for r in ok if r.e2e is not None]),
        slos=slos,
        attainment=good / len(records) if records else 0.0,
        goodput=good / duration,
    )



def record_from_timeline(send: float, chunk_times: Sequence[float], end: Optional[float] = None,
                         prompt_tokens: int = 0, output_tokens: Optional[int] = None,
                         arrival: float = 0.0) -> RequestRecord:
    """Build a successful record from absolute timestamps (seconds) of the output chunks.

    Args:
        send: When the request was sent.
        chunk_times: When each output-carrying chunk arrived, in order; at least one.
        end: When the response finished (defaults to the last chunk).
        prompt_tokens: Prompt length.
        output_tokens: Output tokens (defaults to the number of chunks).
        arrival: Arrival offset from the benchmark start.

    Raises:
        ValueError: if there is no chunk.
    """
    if not chunk_times:
        raise ValueError("a successful request needs at least one output chunk")
    end = chunk_times[-1] if end is None else end
    itls = [b - a for a, b in zip(chunk_times, chunk_times[1:])]
    return RequestRecord(arrival=arrival, ttft=chunk_times[0] - send, itls=itls, e2e=end - send,
                         prompt_tokens=prompt_tokens,
                         output_tokens=len(chunk_times) if output_tokens is None else output_tokens,
                         success=True)
