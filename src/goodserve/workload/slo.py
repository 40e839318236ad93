"""Service-level objectives (SLOs) on request latency: parsing limits and the one attainment predicate.

A request *meets* its SLOs when each latency that has a limit stays at or under it (Zhong et al.,
"DistServe", OSDI 2024, §2). The serving benchmark, the simulator and the server's ``/metrics`` counters
all decide attainment with :func:`meets_slo`, so the three agree on every edge case. All times are seconds.
"""

from __future__ import annotations

import bisect
import itertools
import random
from dataclasses import dataclass
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


@dataclass(frozen=True)
class SLOClass:
    """A share of the traffic with SLOs of its own (e.g. tight interactive and loose batch requests).

    Attributes:
        name: The class name (the server's ``--slo-class`` name, sent as the ``slo_class`` field).
        slos: Its limits in seconds, keyed ``"ttft"`` / ``"tpot"`` (a missing one: no limit).
        share: Its fraction of the requests, in ``(0, 1]``.
    """

    name: str
    slos: dict
    share: float


def parse_slo_class_mix(items: Optional[Sequence[str]]) -> list[SLOClass]:
    """Parse ``["interactive:500:50:0.5", "batch:10000:500:0.5"]`` (NAME:TTFT_MS:TPOT_MS:SHARE; ``-`` for no
    limit) into classes whose shares sum to 1.

    Raises:
        ValueError: on a malformed item, a duplicate name, a non-positive limit or share, or shares that do not
            sum to 1.
    """
    classes: list[SLOClass] = []
    for item in items or ():
        parts = item.split(":")
        if len(parts) != 4 or not parts[0]:
            raise ValueError(f"bad SLO class {item!r}; expected NAME:TTFT_MS:TPOT_MS:SHARE")
        try:
            share = float(parts[3])
            limits = [None if v == "-" else float(v) / 1000.0 for v in parts[1:3]]
        except ValueError:
            raise ValueError(f"bad SLO class {item!r}: limits and share must be numbers") from None
        if not 0 < share <= 1 or any(v is not None and not v > 0 for v in limits):
            raise ValueError(f"bad SLO class {item!r}: limits and share must be positive (share <= 1)")
        if any(c.name == parts[0] for c in classes):
            raise ValueError(f"SLO class {parts[0]!r} given twice")
        slos = {k: v for k, v in zip(("ttft", "tpot"), limits) if v is not None}
        classes.append(SLOClass(parts[0], slos, share))
    if classes and abs(sum(c.share for c in classes) - 1.0) > 1e-6:
        raise ValueError(f"SLO class shares must sum to 1, got {sum(c.share for c in classes):g}")
    return classes


def assign_slo_classes(num_requests: int, classes: Sequence[SLOClass], seed: int = 0) -> list[SLOClass]:
    """Each request's class, drawn independently by share with a seeded generator (the same for every
    server, rate and policy)."""
    rng = random.Random(seed)
    cut = list(itertools.accumulate(c.share for c in classes))
    return [classes[min(bisect.bisect_right(cut, rng.random()), len(classes) - 1)] for _ in range(num_requests)]
