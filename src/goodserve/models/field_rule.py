"""One config field's handling (:class:`FieldRule`) and the value checks the rule tables share.

The tables live in :mod:`goodserve.models.config_support` (HF ``config.json`` keys and the GGUF metadata of most
architectures) and beside the loader of an architecture with many keys of its own
(:mod:`goodserve.models.gguf_deepseek2`); this module imports nothing of the engine, so both can use it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Optional

HANDLINGS = ("implemented", "capped", "refused", "ignored")

Problem = Callable[[Any], Optional[str]]


@dataclass(frozen=True)
class FieldRule:
    """How the engine treats one config field.

    Attributes:
        field: HF ``config.json`` key, or GGUF metadata key without the ``{arch}.`` prefix.
        handling: One of :data:`HANDLINGS`, for every value ``problem`` accepts.
        why: What is supported, or why ignoring the field leaves the output unchanged.
        model_types: HF ``model_type``\\ s / GGUF architectures the rule is for (empty: all supported ones).
        problem: ``value -> None`` when the value is fine, else the reason it is refused.
    """

    field: str
    handling: str
    why: str
    model_types: tuple[str, ...] = ()
    problem: Optional[Problem] = None


def refuse_if_set(reason: str) -> Problem:
    """A check refusing any value other than absent, null, false or 0."""
    return lambda value: reason if value else None


def only(allowed: tuple[Any, ...], reason: str) -> Problem:
    """A check refusing any value not in ``allowed``."""
    return lambda value: None if value in allowed else reason


def not_one(reason: str) -> Problem:
    """A check refusing any value other than absent or 1."""
    return lambda value: None if value is None or float(value) == 1.0 else reason


def positive_int(value: Any) -> Optional[str]:
    """``None`` for an int > 0 (not a bool), else the reason."""
    return None if isinstance(value, int) and not isinstance(value, bool) and value > 0 else "expected a positive int"
