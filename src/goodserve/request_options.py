"""A request's options beyond sampling, as one value.

Like :class:`~goodserve.sampling_params.SamplingParams` (and vLLM's ``EngineCoreRequest``), a
:class:`RequestOptions` is built once where a request enters: the server from its body and ``LLM`` from its
arguments, by :meth:`goodserve.config.EngineConfig.request_options`, which applies the engine's defaults (the
simulator, which has no engine, from its workload and its own SLOs). It is carried unopened to the
scheduler's :class:`~goodserve.request.Request`; each field is read only by its consumer (the policy, the
prefix cache, the KV connector, the server's metrics).
"""

from __future__ import annotations

import math
import numbers
from dataclasses import dataclass
from typing import Optional

from goodserve.kv_transfer.params import KVTransferParams
from goodserve.validation import ParamError


@dataclass(frozen=True)
class RequestOptions:
    """One request's scheduling, caching and hand-off options.

    Attributes:
        priority: Lower runs first under the ``priority`` policy.
        cache_salt: Isolates prefix-cache entries: only requests with the same salt share KV blocks.
        slo_ttft: TTFT SLO in seconds (``None``: none); the ``slo`` policy schedules by it.
        slo_tpot: TPOT SLO in seconds (``None``: none).
        slo_class: The label its SLO attainment is counted under on ``/metrics``: a ``--slo-class`` name,
            ``"default"`` for the engine's SLOs, ``"custom"`` for SLOs given without a class.
        kv_transfer_params: Its part in a disaggregated hand-off (``None``: an ordinary request).

    Raises:
        ParamError: on a priority that is not an int, a salt that is not a string, or an SLO that is not a
            positive finite number of seconds (naming the field).
    """

    priority: int = 0
    cache_salt: Optional[str] = None
    slo_ttft: Optional[float] = None
    slo_tpot: Optional[float] = None
    slo_class: str = "default"
    kv_transfer_params: Optional[KVTransferParams] = None

    def __post_init__(self) -> None:
        if isinstance(self.priority, bool) or not isinstance(self.priority, numbers.Integral):
            raise ParamError(f"priority must be an integer, got {self.priority!r}", param="priority")
        object.__setattr__(self, "priority", int(self.priority))  # e.g. a numpy integer
        if self.cache_salt is not None and not isinstance(self.cache_salt, str):
            raise ParamError(f"cache_salt must be a string, got {self.cache_salt!r}", param="cache_salt")
        for name in ("slo_ttft", "slo_tpot"):
            value = getattr(self, name)
            if value is not None and (isinstance(value, bool) or not isinstance(value, numbers.Real)
                                      or not 0 < value < math.inf):
                raise ParamError(f"{name} must be a positive number of seconds, got {value!r}", param=name)
            if value is not None:
                object.__setattr__(self, name, float(value))
        if self.kv_transfer_params is not None and not isinstance(self.kv_transfer_params, KVTransferParams):
            raise ParamError("kv_transfer_params must be parsed with KVTransferParams.from_dict",
                             param="kv_transfer_params")

    @property
    def has_slo(self) -> bool:
        """Whether it has a TTFT or a TPOT SLO."""
        return self.slo_ttft is not None or self.slo_tpot is not None


DEFAULT_OPTIONS = RequestOptions()


class _Unset:
    """The type of :data:`UNSET`."""

    def __repr__(self) -> str:
        return "UNSET"


#: An SLO the request did not give (the engine's default applies), as opposed to ``None``: no limit.
UNSET = _Unset()
