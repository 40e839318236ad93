"""Service-level objectives (SLOs) on request latency: parsing limits and the one attainment predicate.

A request *meets* its SLOs when each latency that has a limit stays at or under it (Zhong et al.,
"DistServe", OSDI 2024, §2). The serving benchmark, the simulator and the server's ``/metrics`` counters
all decide attainment with :func:`meets_slo`, so the three agree on every edge case. All times are seconds.
"""

from __future__ import annotations

from typing import Optional, Sequence

#: SLO names accepted by ``parse_slos`` and the benchmark summary; values are limits in seconds.
SLO_METRICS = ("ttft", "tpot", "e2el")


def meets_slo(ttft: Optional[float], tpot: Optional[float], slo_ttft: Optional[float] = None,
              slo_tpot: Optional[float] = None, *, e2e: Optional[float] = None,
              slo_e2e: Optional[float] = None) -> bool:
    """Whether one request met every SLO that is set.

    Rules:

    * An SLO that is not set (``None``) is met.
    * A missing TTFT (no token came back) misses a set TTFT SLO; a missing E2E misses a set E2E SLO.
    * A missing TPOT (a single-token output has none) meets a set TPOT SLO.
    * Otherwise a latency meets its SLO when it is at most the limit.

    Args:
        ttft: Time to first token in seconds, or ``None``.
        tpot: Time per output token after the first in seconds, or ``None``.
        slo_ttft: TTFT limit in seconds, or ``None`` for no limit.
        slo_tpot: TPOT limit in seconds, or ``None`` for no limit.
        e2e: End-to-end latency in seconds, or ``None``.
        slo_e2e: E2E limit in seconds, or ``None`` for no limit.

    Returns:
        ``True`` when no set SLO is missed.
    """
    if slo_ttft is not None and (ttft is None or ttft > slo_ttft):
        return False
    if slo_tpot is not None and tpot is not None and tpot > slo_tpot:
        return False
    if slo_e2e is not None and (e2e is None or e2e > slo_e2e):
        return False
    return True


def parse_slos(items: Optional[Sequence[str]]) -> dict[str, float]:
    """Parse ``["ttft:2000", "tpot:150"]`` (milliseconds) into ``{"ttft": 2.0, "tpot": 0.15}`` (seconds).

    Raises:
        ValueError: for a malformed item, an unknown metric or a non-positive limit.
    """
    slos: dict[str, float] = {}
    for item in items or ():
        name, sep, value = item.partition(":")
        name = name.strip().lower()
        if not sep or name not in SLO_METRICS:
            raise ValueError(f"bad SLO {item!r}; expected NAME:MS with NAME in {SLO_METRICS}")
        try:
            ms = float(value)
        except ValueError:
            raise ValueError(f"bad SLO {item!r}: {value!r} is not a number of milliseconds") from None
        if ms <= 0:
            raise ValueError(f"SLO {item!r} must be positive")
        slos[name] = ms / 1000.0
    return slos
