"""Command-line flags derived from the config dataclasses: every command that builds a scheduler declares
the scheduler's and the KV pool's flags from :class:`~goodserve.config.SchedulerConfig` and
:class:`~goodserve.config.CacheConfig` (their defaults and help, in the fields' metadata), so ``serve``,
``generate``, ``bench`` and ``simulate`` cannot drift apart (vLLM's ``EngineArgs`` derives its flags from its
config dataclasses the same way). Torch-free: the simulator uses it.
"""

from __future__ import annotations

from dataclasses import MISSING, fields
from typing import Any

from goodserve.config import CacheConfig, SchedulerConfig

#: The configs whose fields with a ``flag`` in their metadata are flags, in this order.
FLAG_CONFIGS = (SchedulerConfig, CacheConfig)


def scheduler_flag_dests() -> list[str]:
    """The ``argparse`` destinations of :func:`add_scheduler_flags` (``EngineArgs`` field names)."""
    return [f.metadata["dest"] or f.name for cls in FLAG_CONFIGS for f in fields(cls) if "flag" in f.metadata]


def add_scheduler_flags(group: Any, compare: bool = False) -> None:
    """Add ``--max-num-batched-tokens``, ``--max-num-seqs``, ``--max-model-len``, ``--scheduling-policy``,
    ``--scheduler``, ``--shed-load``, ``--num-blocks``, ``--block-size`` and ``--no-prefix-caching`` to an
    ``argparse`` parser or group.

    Args:
        compare: ``--scheduling-policy`` and ``--scheduler`` take comma-separated lists, each item one of the
            choices (the simulator runs each combination); checked by :func:`split_choices`.
    """
    for cls in FLAG_CONFIGS:
        for f in fields(cls):
            meta = f.metadata
            if "flag" not in meta:
                continue
            default = meta.get("cli_default", f.default if f.default is not MISSING else None)
            kwargs: dict[str, Any] = {"dest": meta["dest"] or f.name, "help": meta["help"]}
            if f.type in (bool, "bool"):
                kwargs["action"] = "store_false" if meta["flag"].startswith("--no-") else "store_true"
                kwargs["default"] = default
            elif meta["choices"] is not None and compare:
                kwargs.update(default=default, help=f"{meta['help']}; several comma-separated to compare "
                                                    f"({', '.join(meta['choices'])})")
            elif meta["choices"] is not None:
                kwargs.update(default=default, choices=list(meta["choices"]))
            else:
                kwargs.update(default=default, type=int)
            group.add_argument(meta["flag"], **kwargs)


def split_choices(value: str, flag: str, choices: tuple[str, ...]) -> list[str]:
    """A comma-separated ``value`` of a ``compare`` flag as its items.

    Raises:
        ValueError: naming ``flag`` and the choices, for an item that is not one.
    """
    items = [v.strip() for v in value.split(",") if v.strip()]
    bad = [v for v in items if v not in choices]
    if bad or not items:
        raise ValueError(f"{flag}: {', '.join(bad) or 'nothing'} is not one of {', '.join(choices)}")
    return items

