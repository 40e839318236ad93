"""Engine-wide counters and the periodic stats log line."""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import Callable

from goodserve.scheduler.output import SchedulerOutput, SchedulerStats

logger = logging.getLogger("goodserve.engine")


@dataclass
class EngineStats:
    """Cumulative counters of the engine, logged every ``interval`` seconds.

    Attributes:
        interval: Seconds between log lines; ``0`` disables logging.
        num_steps: Steps run.
        num_prefill_tokens: Prompt (and recompute) tokens computed.
        num_decode_tokens: Decode tokens computed.
        busy_time: Seconds spent inside steps.
    """

    interval: float = 10.0
    num_steps: int = 0
    num_prefill_tokens: int = 0
    num_decode_tokens: int = 0
    busy_time: float = 0.0
    _last_log: float = field(default_factory=time.monotonic)
    _last_prefill: int = 0
    _last_decode: int = 0

    def record_step(self, sched: SchedulerOutput, seconds: float, make_stats: Callable[[], SchedulerStats]) -> None:
        """Add one step's tokens and time, and log (with ``make_stats()``) if the interval has passed."""
        self.num_steps += 1
        self.num_prefill_tokens += sched.num_prefill_tokens
        self.num_decode_tokens += sched.num_decode_tokens
        self.busy_time += seconds
        now = time.monotonic()
        if self.interval > 0 and now - self._last_log >= self.interval:
            self.log(make_stats(), now)

    def log(self, stats: SchedulerStats, now: float) -> None:
        """Log running/waiting requests, KV usage, tokens/s since the last line, preemptions, hit rate."""
        dt = max(now - self._last_log, 1e-9)
        logger.info("running: %d, waiting: %d, KV cache usage: %.1f%%, prefill: %.1f tok/s, "
                    "decode: %.1f tok/s, preemptions: %d, prefix cache hit rate: %.1f%%",
                    stats.num_running, stats.num_waiting, 100.0 * stats.kv_cache_usage,
                    (self.num_prefill_tokens - self._last_prefill) / dt,
                    (self.num_decode_tokens - self._last_decode) / dt,
                    stats.num_preemptions_total, 100.0 * stats.prefix_cache_hit_rate)
        self._last_log, self._last_prefill, self._last_decode = now, self.num_prefill_tokens, self.num_decode_tokens
