"""Measure, in one run, the four serving-path effects behind `goodserve serve`'s process settings.

    .venv/bin/python scripts/bench_serving_path.py

1. OpenMP pools: decode steps with the engine built and stepped on one thread, against an engine built
   on the main thread and stepped on another (what the server did before it built the engine on its
   engine thread).
2. GEMM row padding: prefill steps at row counts that are not multiples of 16, padded and not.
3. malloc: minor page faults and time of 1,000-token prefills before and after ``retain_freed_memory``.
4. GC: a full collection before and after ``freeze_startup_objects``.

Each comparison runs in this process, one after the other, so the ratios share the machine's state.
"""

from __future__ import annotations

import gc
import random
import resource
import statistics
import threading
import time

from goodserve.engine.args import EngineArgs
from goodserve.engine.engine import Engine
from goodserve.engine.host import freeze_startup_objects, retain_freed_memory
from goodserve.models import llama
from goodserve.sampling_params import SamplingParams

ARGS = EngineArgs(num_blocks=1024, max_num_batched_tokens=1024, enable_prefix_caching=False, log_stats_interval=0)
rng = random.Random(0)


def prompt(n: int) -> list[int]:
    return [rng.randrange(256, 40000) for _ in range(n)]


def decode_ms(engine: Engine, batch: int, steps: int = 20) -> float:
    """Median decode step (ms) of ``batch`` requests with 200-token prompts."""
    for _ in range(batch):
        engine.add_request(prompt(200), SamplingParams(max_tokens=steps + 2, ignore_eos=True))
    engine.step()
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        engine.step()
        times.append(time.perf_counter() - t0)
    while engine.has_unfinished_requests():
        engine.step()
    return 1e3 * statistics.median(times)


def prefill_ms(engine: Engine, length: int, repeats: int = 3) -> tuple[float, float]:
    """Median time (ms) and minor page faults of a ``length``-token prefill."""
    times, faults = [], []
    for _ in range(repeats):
        engine.add_request(prompt(length), SamplingParams(max_tokens=1, ignore_eos=True))
        r0, t0 = resource.getrusage(resource.RUSAGE_SELF).ru_minflt, time.perf_counter()
        while engine.has_unfinished_requests():
            engine.step()
        times.append(time.perf_counter() - t0)
        faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - r0)
    return 1e3 * statistics.median(times), statistics.median(faults)


def in_thread(fn):
    out = []
    t = threading.Thread(target=lambda: out.append(fn()))
    t.start()
    t.join()
    return out[0]


def main() -> None:
    # 1. one OpenMP pool (built and stepped on one thread) vs two (built here, stepped on another thread)
    one_pool = in_thread(lambda: (lambda e: [decode_ms(e, b) for b in (1, 8)])(Engine(ARGS)))
    engine = Engine(ARGS)
    decode_ms(engine, 1)  # this thread's pool now exists
    two_pools = in_thread(lambda: [decode_ms(engine, b) for b in (1, 8)])
    for b, a, c in zip((1, 8), one_pool, two_pools):
        print(f"decode batch {b}: one thread {a:.1f} ms, built here and stepped on another thread {c:.1f} ms "
              f"(x{c / a:.2f})")

    # 2. GEMM row padding (this thread)
    for length in (301, 517, 533, 1000):
        padded = prefill_ms(engine, length)[0]
        llama.PAD_MIN_TOKENS, saved = 10**9, llama.PAD_MIN_TOKENS
        plain = prefill_ms(engine, length)[0]
        llama.PAD_MIN_TOKENS = saved
        print(f"prefill {length} tokens: padded to {llama.padded_num_tokens(length)} rows {padded:.0f} ms, "
              f"unpadded {plain:.0f} ms (x{plain / padded:.2f})")

    # 3. malloc thresholds (cannot be undone: measured before, then after), each on a fresh engine thread
    del engine
    before = in_thread(lambda: prefill_ms(Engine(ARGS), 1000, 5))
    retain_freed_memory()
    after = in_thread(lambda: prefill_ms(Engine(ARGS), 1000, 5))
    print(f"1000-token prefill on the engine's thread: {before[0]:.0f} ms, {before[1]:.0f} minor faults; with "
          f"retain_freed_memory {after[0]:.0f} ms, {after[1]:.0f} faults")

    # 4. GC
    t0 = time.perf_counter()
    gc.collect()
    full = time.perf_counter() - t0
    frozen = freeze_startup_objects()
    t0 = time.perf_counter()
    gc.collect()
    print(f"full GC: {1e3 * full:.0f} ms over the loaded process; {1e3 * (time.perf_counter() - t0):.1f} ms after "
          f"freezing {frozen} objects")


if __name__ == "__main__":
    main()
