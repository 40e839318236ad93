"""Measure this machine's step times with the real engine and fit a cost model (``goodserve profile``).

The engine runs small workloads over a grid of batch shapes: for each (batch size ``B``, prompt length
``C``), ``B`` requests of ``C`` prompt tokens that each decode ``--decode-steps`` tokens. That gives
prefill chunks (alone and at growing contexts, cut by the token budget), decode batches at several
contexts, and the steps in between. Every step is timed around ``Engine.step()`` (schedule, model,
sampling, postprocessing: what a simulated step stands for) and described by its ``SchedulerOutput``.

The fit is least squares on relative error (each row divided by its measured time, so a 5 ms decode step
weighs as much as a 500 ms prefill) of::

    step_s = overhead + per_token · tokens + per_sampled · sampled + per_pair · attention_pairs
             + prefill · (prefill_overhead + prefill_per_sampled · sampled)

with ``attention_pairs`` the causal query-key pairs of the step (see
:class:`~goodserve.scheduler.output.StepShape`) and ``prefill`` 1 for a step that computes a prompt chunk
(:func:`goodserve.scheduler.step_time.step_features`). A coefficient that comes out negative is dropped (set to 0)
and the rest refitted, so the model never predicts a cheaper step for more work.
"""

from __future__ import annotations

import logging
import random
import time
from typing import Optional, Sequence

from goodserve.scheduler.output import StepShape
from goodserve.scheduler.step_time import COEFFICIENT_NAMES as FEATURES
from goodserve.scheduler.step_time import StepCoefficients, step_features
from goodserve.sim.cost_model import LinearCostModel

logger = logging.getLogger(__name__)


def _features(shape: StepShape) -> list[float]:
    return step_features(shape.num_tokens, shape.num_sampled, shape.attention_pairs)


def fit_linear(shapes: Sequence[StepShape], seconds: Sequence[float]) -> LinearCostModel:
    """Non-negative least squares on relative error (see the module docstring).

    Raises:
        ValueError: with fewer samples than coefficients.
    """
    import numpy as np

    if len(shapes) < len(FEATURES):
        raise ValueError(f"need at least {len(FEATURES)} timed steps to fit, got {len(shapes)}")
    x = np.array([_features(s) for s in shapes]) / np.array(seconds)[:, None]
    y = np.ones(len(shapes))
    active = list(range(len(FEATURES)))
    coef = np.zeros(len(FEATURES))
    while active:
        sol, *_ = np.linalg.lstsq(x[:, active], y, rcond=None)
        if (sol >= 0).all():
            coef[active] = sol
            break
        active.pop(int(np.argmin(sol)))
    return LinearCostModel(StepCoefficients(*(float(c) for c in coef)))


def _measure(engine, batch: int, context: int, decode_steps: int, rng: random.Random
             ) -> list[tuple[StepShape, float]]:
    from goodserve.sampling_params import SamplingParams

    vocab = engine.config.model.vocab_size
    params = SamplingParams(max_tokens=decode_steps, ignore_eos=True)
    for _ in range(batch):
        engine.add_request([rng.randrange(256, vocab) for _ in range(context)], params)
    samples = []
    while engine.has_unfinished_requests():
        t0 = time.perf_counter()
        step = engine.run_step()
        samples.append((StepShape.of(step.schedule), time.perf_counter() - t0))
    return samples


def profile(model: Optional[str], dtype: str, batch_sizes: Sequence[int], contexts: Sequence[int],
            decode_steps: int, max_num_batched_tokens: int) -> list[tuple[StepShape, float]]:
    """Time every step of the grid's workloads on the real engine (one warm-up workload first)."""
    from goodserve.engine.args import EngineArgs
    from goodserve.engine.engine import Engine

    block_size = 16
    num_blocks = max(batch_sizes) * (-(-(max(contexts) + decode_steps) // block_size)) + 16
    engine = Engine(EngineArgs(model=model, dtype=dtype, device="cpu", block_size=block_size,
                               num_blocks=num_blocks, max_num_batched_tokens=max_num_batched_tokens,
                               max_num_seqs=max(batch_sizes), enable_prefix_caching=False,
                               log_stats_interval=0))
    rng = random.Random(0)
    _measure(engine, 2, min(contexts), 2, rng)  # warm-up: allocator, kernels, caches
    samples = []
    for batch in batch_sizes:
        for context in contexts:
            t0 = time.perf_counter()
            samples += _measure(engine, batch, context, decode_steps, rng)
            logger.info("profiled batch %d x context %d in %.1f s", batch, context, time.perf_counter() - t0)
    return samples
