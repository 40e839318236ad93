"""Step-time cost models for the simulator: how long the model takes to compute one ``SchedulerOutput``.

A cost model sees exactly what the real model runner sees (the scheduler's decision for one step) and
returns seconds. Three are provided:

* :class:`RooflineCostModel` for accelerators from their datasheet (:mod:`goodserve.sim.hardware`). Each
  layer runs two kinds of kernel one after the other, and each is timed on its own roofline
  ``max(FLOPs / peak, bytes / bandwidth)`` (Williams et al., CACM 2009):

  - the projections and MLP (GEMMs): ``2 · params_per_layer`` FLOPs per scheduled token; their weights
    are read **once per step** whatever the batch (this is why batching pays);
  - attention: every new token at position ``p`` attends to the ``p + 1`` tokens up to itself
    (``2 · n_heads · (d_qk + d_v)`` FLOPs per query-key pair, causal), and every request's K/V context
    (``num_computed_tokens + num_new_tokens`` tokens) is read once per step, at the cache's
    ``kv_bytes_per_token`` in its own dtype. The step's shape carries only totals over requests, so a
    sliding-window layer is priced here as if it read the whole context (an upper bound; the planner's
    :func:`~goodserve.sim.roofline.decode_bytes` caps each sliding layer at its window).

  The LM head runs only for tokens that sample (``ScheduledRequest.sample``), as in the real runner. A
  per-step overhead (``HardwareSpec.step_overhead_s``: scheduling, input preparation, launches) is added.
  Tensor-parallel communication is not modelled.
* :class:`LinearCostModel`, least-squares coefficients measured on this machine by ``goodserve profile``
  (:mod:`goodserve.sim.profile`): ``overhead + a · tokens + b · sampled + c · attention pairs``, with a
  fixed and a per-sampled-token extra for steps that compute a prompt chunk. The formula is the SLO
  policy's online step-time model's (:class:`goodserve.scheduler.step_time.StepCoefficients`).
* :class:`ConstantCostModel`, a fixed time per step, for tests whose timings are worked out by hand.
* :class:`NoisyCostModel` wraps any of them with the scatter and drift of a shared machine's step times,
  seeded, so a scheduling policy can be judged against predictions that the next steps do not keep.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Protocol, Union

import numpy as np

from goodserve.scheduler.output import SchedulerOutput, StepShape
from goodserve.scheduler.step_time import StepCoefficients
from goodserve.sim.hardware import HardwareSpec
from goodserve.sim.model_size import kv_bytes_per_token, param_count
from goodserve.sim.presets import ArchSpec
from goodserve.sim.roofline import decode_bytes


class CostModel(Protocol):
    """Anything that prices one step."""

    def step_time(self, out: SchedulerOutput) -> float:
        """Seconds the model takes to compute ``out`` (including the fixed per-step overhead)."""
        ...

    def predict(self, shape: StepShape) -> float:
        """Seconds for a non-empty step of this shape (what seeds the scheduler's step-time model)."""
        ...


class ConstantCostModel:
    """Every non-empty step takes ``step_s`` seconds.

    Raises:
        ValueError: if ``step_s`` is not positive.
    """

    def __init__(self, step_s: float) -> None:
        if step_s <= 0:
            raise ValueError(f"step time must be > 0, got {step_s}")
        self.step_s = step_s

    def step_time(self, out: SchedulerOutput) -> float:
        return self.step_s if out.scheduled else 0.0

    def predict(self, shape: StepShape) -> float:
        return self.step_s


class RooflineCostModel:
    """Roofline step time of a model on an accelerator (see the module docstring).

    Args:
        arch: The model.
        hw: The accelerator.
        dtype: Weights and compute dtype (``"bfloat16"``, ``"float8"``, ``"float32"``).
        tp: Tensor-parallel degree (FLOPs and bytes are per GPU).
        overhead_s: Per-step overhead; ``None`` takes ``hw.step_overhead_s``.
        kv_dtype: Dtype of the cached elements (a key of :data:`~goodserve.kv_cache.spec.KV_DTYPE_BYTES`);
            ``None`` means ``dtype``.
    """

    def __init__(self, arch: ArchSpec, hw: HardwareSpec, dtype: str = "bfloat16", tp: int = 1,
                 overhead_s: float | None = None, kv_dtype: str | None = None) -> None:
        self.arch, self.hw, self.dtype, self.tp = arch, hw, dtype, tp
        self.overhead_s = hw.step_overhead_s if overhead_s is None else overhead_s
        self._peak = hw.peak_flops(dtype)
        pc = param_count(arch)
        lm_head = arch.vocab_size * arch.hidden_size
        embed = 0 if arch.tie_word_embeddings else lm_head  # an input embedding is a lookup, not a GEMM
        self._body_flops_per_token = 2 * (pc.active - embed - lm_head) / tp
        self._lm_head_flops_per_token = 2 * lm_head / tp
        if arch.is_mla:
            d_qk, d_v = arch.kv_lora_rank + arch.qk_rope_head_dim, arch.kv_lora_rank
        else:
            d_qk = d_v = arch.head_dim
        self._flops_per_pair = 2 * arch.num_attention_heads * (d_qk + d_v) * arch.num_hidden_layers / tp
        self._kv_bytes_per_token = kv_bytes_per_token(arch, kv_dtype or dtype, tp)

    def gemm_time(self, shape: StepShape) -> float:
        """Seconds of the projections, MLPs and LM head: weights read once, FLOPs per token."""
        flops = shape.num_tokens * self._body_flops_per_token + shape.num_sampled * self._lm_head_flops_per_token
        weight_bytes = decode_bytes(self.arch, max(1, shape.num_tokens), 0, self.dtype, self.tp)
        return max(flops / self._peak, weight_bytes / self.hw.mem_bandwidth)

    def attention_time(self, shape: StepShape) -> float:
        """Seconds of attention: causal query-key FLOPs against the K/V context read once per request."""
        flops = shape.attention_pairs * self._flops_per_pair
        kv_bytes = shape.kv_tokens_read * self._kv_bytes_per_token
        return max(flops / self._peak, kv_bytes / self.hw.mem_bandwidth)

    def step_time(self, out: SchedulerOutput) -> float:
        if not out.scheduled:
            return 0.0
        return self.predict(StepShape.of(out))

    def predict(self, shape: StepShape) -> float:
        return self.overhead_s + self.gemm_time(shape) + self.attention_time(shape)


@dataclass(frozen=True)
class LinearCostModel:
    """Step time fitted on a real machine: :class:`~goodserve.scheduler.step_time.StepCoefficients`' formula,
    ``overhead + per_token·tokens + per_sampled·sampled + per_pair·attention_pairs``, plus
    ``prefill_overhead + prefill_per_sampled·sampled`` for a step that computes a prompt chunk (seconds).

    Attributes:
        coefficients: The fitted figures (the scheduler's own type, so the simulator and the SLO policy
            price a step with the same code).
        source: Where the coefficients came from (a profile file, a machine).
    """

    coefficients: StepCoefficients
    source: str = ""

    def step_time(self, out: SchedulerOutput) -> float:
        if not out.scheduled:
            return 0.0
        return self.predict(StepShape.of(out))

    def predict(self, shape: StepShape) -> float:
        """Seconds for a step of this shape."""
        return self.coefficients.predict(shape.num_tokens, shape.num_sampled, shape.attention_pairs)

    def to_dict(self) -> dict:
        return self.coefficients.to_dict()

    @classmethod
    def load(cls, path: Union[str, Path]) -> "LinearCostModel":
        """Read the ``coefficients`` of a ``goodserve profile`` JSON file.

        Raises:
            ValueError: if the file is unreadable or lacks a coefficient.
        """
        return cls(StepCoefficients.load(path), source=str(path))


class NoisyCostModel:
    """A cost model's step times as a shared machine delivers them: ``inner × exp(drift + noise)``, plus a
    stall of ``stall_s`` seconds with probability ``stall_p`` per step.

    ``noise`` is drawn anew for every step, ``N(0, noise_sigma²)`` (a step's own scatter: a lognormal factor
    whose 0.9 quantile is ``exp(1.28·noise_sigma)``); ``drift`` is a stationary AR(1) process over steps with
    standard deviation ``drift_sigma`` and correlation ``exp(-1 / drift_steps)`` from one step to the next
    (the machine's speed wandering over hundreds of steps, as another tenant comes and goes). Both are in
    log-space, so the median factor is 1. Stalls are the single steps of seconds that no step shape
    explains (BENCHMARKS.md, simulator §4, saw 1.7-3.0 s ones about once per thousand steps on this CPU).
    :meth:`predict` is the inner model's: the scheduler's step-time model is seeded with what the machine
    would do without the noise, and learns the rest.

    Args:
        inner: The noiseless cost model.
        noise_sigma: Standard deviation of each step's log-factor (>= 0).
        drift_sigma: Standard deviation of the drift's log-factor (>= 0).
        drift_steps: Correlation length of the drift, in steps (> 0).
        stall_p: Probability of a stall per step, in ``[0, 1]``.
        stall_s: Seconds a stall adds to its step (>= 0).
        seed: Seed of the generator (the same seed gives the same factors step by step).

    Raises:
        ValueError: on a negative sigma or stall, a non-positive correlation length or a probability outside
            ``[0, 1]``.
    """

    def __init__(self, inner: CostModel, noise_sigma: float, drift_sigma: float = 0.0, drift_steps: float = 500.0,
                 stall_p: float = 0.0, stall_s: float = 0.0, seed: int = 0) -> None:
        if noise_sigma < 0 or drift_sigma < 0:
            raise ValueError(f"step-time noise must be >= 0, got {noise_sigma} and drift {drift_sigma}")
        if drift_steps <= 0:
            raise ValueError(f"drift correlation length must be > 0 steps, got {drift_steps}")
        if not 0.0 <= stall_p <= 1.0 or stall_s < 0:
            raise ValueError(f"stall probability must be in [0, 1] and its seconds >= 0, got {stall_p}, {stall_s}")
        self.stall_p, self.stall_s = stall_p, stall_s
        self.inner = inner
        self.noise_sigma, self.drift_sigma = noise_sigma, drift_sigma
        self._rho = float(np.exp(-1.0 / drift_steps))
        self._rng = np.random.default_rng(seed)
        self._drift = drift_sigma * float(self._rng.standard_normal())  # drawn from the stationary law

    def factor(self) -> float:
        """The next step's factor (advances the drift and draws the step's noise)."""
        self._drift = self._rho * self._drift + \
            self.drift_sigma * float(np.sqrt(1.0 - self._rho ** 2)) * float(self._rng.standard_normal())
        return float(np.exp(self._drift + self.noise_sigma * float(self._rng.standard_normal())))

    def step_time(self, out: SchedulerOutput) -> float:
        t = self.inner.step_time(out)
        if t <= 0:
            return t
        t *= self.factor()
        return t + self.stall_s if self.stall_p and self._rng.random() < self.stall_p else t

    def predict(self, shape: StepShape) -> float:
        return self.inner.predict(shape)
