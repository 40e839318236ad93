"""An online step-time model: how long the next step will take, learned from the steps that ran.

The form is the simulator's fitted cost model (:class:`goodserve.sim.cost_model.LinearCostModel`, the one
``goodserve profile`` measures)::

    step_s = overhead + per_token · tokens + per_sampled · sampled + per_pair · attention_pairs
             + prefill · (prefill_overhead + prefill_per_sampled · sampled)

with the figures of a :class:`~goodserve.scheduler.output.StepShape`, and ``prefill`` 1 when the step computes
a prompt chunk (more tokens than it samples), 0 for a step of decodes alone. An engine runs the two kinds of
step down different paths: vLLM replays CUDA graphs captured for decode-only batches and runs mixed batches
eagerly; goodserve's CPU engine runs a decode step in one native call (up to
:data:`~goodserve.models.native_decode.DECODE_STEP_MAX_ROWS` rows on the block kernel, more on the native GEMM's
dense copies: :mod:`goodserve.models.decode_plans`) and a step with a prompt chunk layer by layer (in
batch-invariant mode, every step in one call). One line
through both kinds misprices each: replaying the steps of an azure-code run at 1.2 req/s under ``slo``
(BENCHMARKS.md, issue 14), the median of measured over predicted time was 0.71 for decode-only steps and 1.25
for steps with a prompt chunk; with the two prefill terms, 0.96 and 0.97. The SLO-aware policy
(:mod:`goodserve.scheduler.slo`) asks it before each step how long a candidate step would take.

Refitting: ordinary least squares over the last ``window`` observed steps plus a prior of a few
pseudo-steps priced by the seed coefficients (ridge regression toward the seed, Hoerl & Kennard 1970).
A sliding window rather than exponentially-forgotten recursive least squares: when a load regime excites
only some directions (pure decode: ``tokens == sampled`` on every step), forgetting RLS lets the covariance
of the unexcited directions grow without bound ("wind-up"); the prior keeps them pinned to the seed
instead, while every direction the data does excite follows the data. Coefficients are kept non-negative
(a step never gets cheaper by doing more). The model is plain Python + numpy (no torch): it runs in the
simulator too.
"""

from __future__ import annotations

import json
import math
from collections import deque
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Optional, Union

import numpy as np

from goodserve.scheduler.output import StepShape

COEFFICIENT_NAMES = ("overhead_s", "per_token_s", "per_sampled_s", "per_pair_s", "prefill_overhead_s",
                     "prefill_per_sampled_s")
# Feature scales keep the normal equations well conditioned (pairs reach 1e6 and more per step).
_SCALE = np.array([1.0, 1e-3, 1e-2, 1e-6, 1.0, 1e-2])
# Pseudo-steps priced by the seed: decodes at batch 1 and 32 over 512-token contexts and at batch 8 over
# 2048, a 512-token prompt, a 2048-token chunk after 2048 cached tokens, and steps mixing 31 decodes with a
# 256-token prompt and 7 decodes with a 64-token one (seven shapes of rank 6: every coefficient is pinned).
_PRIOR_SHAPES = (StepShape(1, 1, 512, 512, 1), StepShape(32, 32, 32 * 512, 32 * 512, 32),
                 StepShape(8, 8, 8 * 2048, 8 * 2048, 8),
                 StepShape(512, 1, 512 * 513 // 2, 512, 1),
                 StepShape(2048, 1, 2048 * 2048 + 2048 * 2049 // 2, 4096, 1),
                 StepShape(287, 32, 31 * 512 + 256 * 257 // 2, 31 * 512 + 256, 32),
                 StepShape(71, 8, 7 * 512 + 64 * 65 // 2, 7 * 512 + 64, 8))


def step_features(tokens: int, sampled: int, pairs: int) -> list[float]:
    """The regressors ``[1, tokens, sampled, pairs, prefill, prefill · sampled]`` of a step, in the order of
    :data:`COEFFICIENT_NAMES` (``prefill``: 1 when the step computes more tokens than it samples)."""
    prefill = 1.0 if tokens > sampled else 0.0
    return [1.0, float(tokens), float(sampled), float(pairs), prefill, prefill * sampled]


@dataclass(frozen=True)
class StepCoefficients:
    """Seconds per step, per computed token, per sampled token and per causal query-key pair; and what a step
    that computes a prompt chunk costs on top: once, and per sampled token (see the module docstring)."""

    overhead_s: float
    per_token_s: float
    per_sampled_s: float
    per_pair_s: float
    prefill_overhead_s: float = 0.0
    prefill_per_sampled_s: float = 0.0

    def predict(self, tokens: int, sampled: int, pairs: int) -> float:
        """Seconds for a step of this shape."""
        s = self.overhead_s + self.per_token_s * tokens + self.per_sampled_s * sampled + self.per_pair_s * pairs
        if tokens > sampled:
            s += self.prefill_overhead_s + self.prefill_per_sampled_s * sampled
        return s

    def to_dict(self) -> dict:
        return {name: getattr(self, name) for name in COEFFICIENT_NAMES}

    @classmethod
    def load(cls, path: Union[str, Path]) -> "StepCoefficients":
        """The ``coefficients`` of a ``goodserve profile`` JSON file (the two prefill terms are 0 where a file
        lacks them: profiles written before they existed).

        Raises:
            ValueError: if the file is unreadable or lacks a coefficient.
        """
        try:
            c = json.loads(Path(path).read_text())["coefficients"]
            return cls(*(float(c[name]) for name in COEFFICIENT_NAMES[:4]),
                       *(float(c.get(name, 0.0)) for name in COEFFICIENT_NAMES[4:]))
        except (OSError, json.JSONDecodeError, KeyError, TypeError, ValueError) as exc:
            raise ValueError(f"cannot read step-time coefficients from {path}: {exc!r}") from None


#: Steps the mean of :attr:`StepTimeModel.recent_step_s` weighs (an exponential average with weight 1/32;
#: the plain mean of the first 32).
RECENT_STEPS = 32

#: Observed steps before :attr:`StepTimeModel.margin` departs from 1, and the run of consecutive steps whose
#: measured / predicted ratio it takes the quantile of.
MIN_MARGIN_STEPS = 16

#: A seed for a ~100M-parameter model on a 2-core CPU (bf16); the first steps replace it.
DEFAULT_SEED = StepCoefficients(overhead_s=0.015, per_token_s=4e-4, per_sampled_s=5e-4, per_pair_s=2e-8)


class StepTimeModel:
    """Predicts step times and refits itself on the steps that ran.

    Args:
        seed: Starting coefficients (a profile's, or :data:`DEFAULT_SEED`).
        window: Observed steps the fit remembers.
        prior_weight: Weight of each of the seed's pseudo-steps in the fit (an observed step weighs 1). Any
            weight above 0 pins the directions the load never excites; a light one lets the directions it
            excites follow the data. The pseudo-steps lie far from a small server's steps (a 32-row decode,
            a 2,048-token chunk), so at 0.5 they tilted a fit over decodes of 1-8 rows by 26% at one row;
            at 0.05, replaying two served azure-code step traces, the prediction error fell from 21.6-21.8%
            to 20.7-20.8% of the step time (BENCHMARKS.md, issue 14).
        adapt: Refit on observations; ``False`` keeps the seed (tests, or a trusted profile).
        margin_quantile: The quantile, over runs of :data:`MIN_MARGIN_STEPS` steps, of measured / predicted
            time that :attr:`margin` reports.

    Raises:
        ValueError: on a negative coefficient, ``window < 1``, ``prior_weight <= 0`` or a quantile outside
            ``(0, 1]``.
    """

    def __init__(self, seed: StepCoefficients = DEFAULT_SEED, window: int = 256, prior_weight: float = 0.05,
                 adapt: bool = True, margin_quantile: float = 0.9) -> None:
        if min(seed.to_dict().values()) < 0:
            raise ValueError(f"step-time coefficients must be >= 0, got {seed}")
        if window < 1 or prior_weight <= 0:
            raise ValueError(f"window must be >= 1 and prior_weight > 0, got {window}, {prior_weight}")
        if not 0.0 < margin_quantile <= 1.0:
            raise ValueError(f"margin_quantile must be in (0, 1], got {margin_quantile}")
        self.margin_quantile = margin_quantile
        self.coefficients = seed
        self.adapt = adapt
        self._window: deque[tuple[np.ndarray, float]] = deque(maxlen=window)
        # X^T X and X^T y of the window's steps, kept as steps enter and leave (a step's refit is then O(1)).
        self._xtx = np.zeros((len(COEFFICIENT_NAMES),) * 2)
        self._xty = np.zeros(len(COEFFICIENT_NAMES))
        self._updates = 0  # steps since the sums were last computed afresh
        # (measured, predicted) of the last steps: at least one run's worth whatever the fit's window.
        self._times: deque[tuple[float, float]] = deque(maxlen=max(window, MIN_MARGIN_STEPS))
        self._margin: Optional[float] = 1.0  # margin of the steps observed so far (None: not computed yet)
        self.recent_step_s = 0.0  # exponentially weighted mean of the measured step times (RECENT_STEPS)
        xs = np.array([_features(x) for x in _PRIOR_SHAPES])
        ys = np.array([seed.predict(x.num_tokens, x.num_sampled, x.attention_pairs) for x in _PRIOR_SHAPES])
        self._prior_xtx = prior_weight * xs.T @ xs
        self._prior_xty = prior_weight * xs.T @ ys
        # Error bookkeeping (the prediction made before each observed step).
        self.num_observed = 0
        self.predicted_s_total = 0.0
        self.actual_s_total = 0.0
        self.abs_error_s_total = 0.0

    @classmethod
    def seeded_by(cls, price: Callable[[StepShape], float], **kwargs) -> "StepTimeModel":
        """A model whose seed is the least-squares fit of another model's prices of the prior's pseudo-steps
        (the simulator seeds each scheduler's model from its cost model this way; a linear cost model is
        reproduced exactly).

        Args:
            price: Seconds of a step of a given shape.
        """
        xs = np.array([_features(x) for x in _PRIOR_SHAPES])
        ys = np.array([price(x) for x in _PRIOR_SHAPES])
        theta = np.clip(np.linalg.lstsq(xs, ys, rcond=None)[0] * _SCALE, 0.0, None)
        return cls(StepCoefficients(*(float(v) for v in theta)), **kwargs)

    def predict(self, tokens: int, sampled: int, pairs: int) -> float:
        """Predicted seconds of a step computing ``tokens`` tokens, sampling ``sampled`` and attending over
        ``pairs`` causal query-key pairs (:class:`StepShape`'s figures)."""
        return self.coefficients.predict(tokens, sampled, pairs)

    def predict_shape(self, shape: StepShape) -> float:
        return self.predict(shape.num_tokens, shape.num_sampled, shape.attention_pairs)

    def observe(self, shape: StepShape, seconds: float) -> None:
        """Record a step that took ``seconds`` and refit.

        Raises:
            ValueError: if ``seconds`` is negative or not finite.
        """
        if not (math.isfinite(seconds) and seconds >= 0):
            raise ValueError(f"a step time must be a finite number of seconds >= 0, got {seconds}")
        predicted = self.predict_shape(shape)
        self.num_observed += 1
        self.predicted_s_total += predicted
        self.actual_s_total += seconds
        self.abs_error_s_total += abs(predicted - seconds)
        if predicted > 0:
            self._times.append((seconds, predicted))
            self._margin = None
        a = 1.0 / min(self.num_observed, RECENT_STEPS)
        self.recent_step_s += a * (seconds - self.recent_step_s)
        if not self.adapt:
            return
        x = _features(shape)
        if len(self._window) == self._window.maxlen:  # the oldest step leaves the window's sums
            old, old_s = self._window[0]
            self._xtx -= np.outer(old, old)
            self._xty -= old * old_s
        self._window.append((x, seconds))
        self._xtx += np.outer(x, x)
        self._xty += x * seconds
        self._updates += 1
        if self._updates >= self._window.maxlen:  # summed afresh now and then: no drift from the subtractions
            xs = np.array([f for f, _ in self._window])
            self._xtx, self._xty = xs.T @ xs, xs.T @ np.array([t for _, t in self._window])
            self._updates = 0
        theta = np.linalg.solve(self._prior_xtx + self._xtx, self._prior_xty + self._xty) * _SCALE
        self.coefficients = StepCoefficients(*(float(v) for v in np.clip(theta, 0.0, None)))

    @property
    def margin(self) -> float:
        """How much longer than predicted a run of steps may take: the ``margin_quantile`` quantile, over the
        runs of :data:`MIN_MARGIN_STEPS` consecutive steps among the last observed ones, of their measured
        time over their predicted time; at least 1 (1 before :data:`MIN_MARGIN_STEPS` steps).

        The SLO policy aims TPOTs at the SLO over it and stretches predicted steps and times to first token by
        it. A TPOT and a TTFT are sums over many steps, so what they must absorb is how far a run of steps
        strays from its prediction (drift, bias), not how far one step does: on the project's shared 2-core
        machine one step's 0.9 quantile of measured / predicted was 1.25-1.45 where 16-step runs' was
        1.14-1.28 (BENCHMARKS.md, issue 14), and aiming at the former starved prompts and shed them. On a
        machine the model predicts exactly it is 1.
        """
        if self._margin is None:
            if len(self._times) < MIN_MARGIN_STEPS:
                self._margin = 1.0
            else:
                sums = np.concatenate([[[0.0, 0.0]], np.cumsum(np.array(self._times), axis=0)])
                runs = sums[MIN_MARGIN_STEPS:] - sums[:-MIN_MARGIN_STEPS]  # [runs, 2]: measured, predicted
                self._margin = max(1.0, float(np.quantile(runs[:, 0] / runs[:, 1], self.margin_quantile)))
        return self._margin

    @property
    def mean_abs_relative_error(self) -> Optional[float]:
        """Sum of |predicted - actual| over the sum of actual step times so far (``None`` before any)."""
        return self.abs_error_s_total / self.actual_s_total if self.actual_s_total > 0 else None


def _features(shape: StepShape) -> np.ndarray:
    """The scaled :func:`step_features` of a step."""
    return np.array(step_features(shape.num_tokens, shape.num_sampled, shape.attention_pairs)) * _SCALE
