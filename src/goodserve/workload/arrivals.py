"""Request arrival times for the serving benchmark: Poisson, gamma (bursty), or a trace's own clock.

All functions return offsets in seconds from the benchmark start, non-decreasing, one per request.

* Poisson at rate ``R``: exponential gaps with mean ``1/R``.
* Gamma with shape ``B`` ("burstiness") at rate ``R``: gaps ~ Gamma(shape=B, scale=1/(R*B)). The mean gap
  stays ``1/R``; the gaps' coefficient of variation is ``1/sqrt(B)``. ``B = 1`` is Poisson, ``B < 1`` is
  burstier, ``B > 1`` is more regular.
* Rate ``inf``: every request at time 0.
* Trace: the recorded arrival times, shifted to start at 0 and multiplied by ``time_scale``
  (``0.5`` replays the trace twice as fast).
"""

from __future__ import annotations

import math
import random
from typing import Sequence


def gamma_arrivals(num_requests: int, rate: float, burstiness: float = 1.0, seed: int = 0) -> list[float]:
    """Arrival offsets with gamma-distributed gaps (Poisson when ``burstiness == 1``).

    The first request arrives after one gap (not at 0), so the process is stationary from the start.

    Args:
        num_requests: How many arrivals.
        rate: Mean requests per second; ``math.inf`` sends everything at time 0.
        burstiness: Gamma shape ``B`` > 0; coefficient of variation of the gaps is ``1/sqrt(B)``.
        seed: Seed of the private random generator.

    Raises:
        ValueError: for a non-positive rate or burstiness, or a negative count.
    """
    if num_requests < 0:
        raise ValueError(f"num_requests must be >= 0, got {num_requests}")
    if not rate > 0:
        raise ValueError(f"request rate must be > 0 (or inf), got {rate}")
    if not burstiness > 0 or math.isinf(burstiness):
        raise ValueError(f"burstiness must be a finite number > 0, got {burstiness}")
    if math.isinf(rate):
        return [0.0] * num_requests
    rng = random.Random(seed)
    scale = 1.0 / (rate * burstiness)
    t, out = 0.0, []
    for _ in range(num_requests):
        t += rng.gammavariate(burstiness, scale)
        out.append(t)
    return out


def poisson_arrivals(num_requests: int, rate: float, seed: int = 0) -> list[float]:
    """Poisson arrivals at ``rate`` requests per second (``gamma_arrivals`` with burstiness 1)."""
    return gamma_arrivals(num_requests, rate, 1.0, seed)


def trace_arrivals(timestamps: Sequence[float], time_scale: float = 1.0) -> list[float]:
    """A trace's own arrival times (seconds), shifted to start at 0 and scaled by ``time_scale``.

    Raises:
        ValueError: for a non-positive ``time_scale`` or timestamps that go backwards.
    """
    if not time_scale > 0:
        raise ValueError(f"trace time scale must be > 0, got {time_scale}")
    if not timestamps:
        return []
    if any(b < a for a, b in zip(timestamps, timestamps[1:])):
        raise ValueError("trace timestamps must be non-decreasing")
    t0 = timestamps[0]
    return [(t - t0) * time_scale for t in timestamps]


def gaps_cv(arrivals: Sequence[float]) -> float:
    """Coefficient of variation (std / mean) of the gaps between arrivals (the first gap from 0 included).

    Raises:
        ValueError: with fewer than two arrivals or a zero mean gap.
    """
    gaps = [b - a for a, b in zip([0.0, *arrivals], arrivals)]
    if len(gaps) < 2:
        raise ValueError("need at least two arrivals")
    mean = sum(gaps) / len(gaps)
    if mean <= 0:
        raise ValueError("mean gap is zero")
    var = sum((g - mean) ** 2 for g in gaps) / (len(gaps) - 1)
    return math.sqrt(var) / mean


def parse_rate(text: str) -> float:
    """``"inf"`` -> ``math.inf``; otherwise a positive float (requests per second).

    Raises:
        ValueError: for a non-number or a non-positive rate.
    """
    value = float(text)
    if not value > 0:
        raise ValueError(f"request rate must be > 0 or inf, got {text!r}")
    return value
