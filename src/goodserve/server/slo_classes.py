"""Per-request SLOs on the server: named classes (``--slo-class``) and the body's extension fields.

A request's SLOs, in order of precedence: ``slo_ttft_ms`` / ``slo_tpot_ms`` in its body, then the
``slo_class`` it names (one of the server's ``--slo-class NAME:TTFT_MS:TPOT_MS``), then the engine's
``--slo-ttft`` / ``--slo-tpot`` (applied by :meth:`goodserve.config.EngineConfig.request_options`, the one
place the engine's defaults are read). The engine schedules by them under ``--scheduling-policy slo``, and
``/metrics`` counts attainment per class: the class name, ``default`` for the engine's SLOs, ``custom`` for
SLOs given in milliseconds without a class (class names are the operator's, so the label set stays bounded).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any, Optional, Sequence

from goodserve.request_options import UNSET

_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_-]{0,63}")


@dataclass(frozen=True)
class SLOTarget:
    """One request's SLOs.

    Attributes:
        ttft: TTFT limit in seconds, ``None`` (no limit) or :data:`~goodserve.request_options.UNSET` (the
            engine's default).
        tpot: TPOT limit, the same way.
        name: The class label on ``/metrics``.
    """

    ttft: Any = UNSET
    tpot: Any = UNSET
    name: str = "default"


def parse_slo_classes(items: Optional[Sequence[str]]) -> dict[str, SLOTarget]:
    """Parse ``["interactive:500:50", "batch:10000:500"]`` (milliseconds; ``-`` for no limit).

    Raises:
        ValueError: on a malformed item, a bad name (letters, digits, ``_``, ``-``), a reserved name
            (``default``, ``custom``), a duplicate, or a limit that is not a positive number.
    """
    classes: dict[str, SLOTarget] = {}
    for item in items or ():
        parts = item.split(":")
        if len(parts) != 3 or not _NAME.fullmatch(parts[0]):
            raise ValueError(f"bad --slo-class {item!r}; expected NAME:TTFT_MS:TPOT_MS (e.g. interactive:500:50)")
        name = parts[0]
        if name in ("default", "custom") or name in classes:
            raise ValueError(f"--slo-class name {name!r} is reserved or given twice")
        limits = []
        for value in parts[1:]:
            if value == "-":
                limits.append(None)
                continue
            try:
                ms = float(value)
            except ValueError:
                raise ValueError(f"bad --slo-class {item!r}: {value!r} is not a number of milliseconds") from None
            if not 0 < ms < float("inf"):
                raise ValueError(f"bad --slo-class {item!r}: limits must be positive")
            limits.append(ms / 1000.0)
        classes[name] = SLOTarget(limits[0], limits[1], name)
    return classes


def resolve_slo(slo_class: Optional[str], slo_ttft_ms: Optional[float], slo_tpot_ms: Optional[float],
                classes: dict[str, SLOTarget]) -> SLOTarget:
    """The SLOs one request asks for (see the module docstring for the precedence); a limit it leaves to the
    engine is :data:`~goodserve.request_options.UNSET`.

    Raises:
        ValueError: ``slo_class must be ...`` when it names no configured class.
    """
    base = SLOTarget()
    if slo_class is not None:
        if slo_class not in classes:
            known = ", ".join(sorted(classes)) or "none are configured (--slo-class)"
            raise ValueError(f"slo_class must be one of the server's SLO classes ({known}), got {slo_class!r}")
        base = classes[slo_class]
    if slo_ttft_ms is None and slo_tpot_ms is None:
        return base
    return SLOTarget(base.ttft if slo_ttft_ms is None else slo_ttft_ms / 1000.0,
                     base.tpot if slo_tpot_ms is None else slo_tpot_ms / 1000.0,
                     base.name if slo_class is not None else "custom")
