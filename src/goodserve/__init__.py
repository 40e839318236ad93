"""goodserve: an LLM serving engine built for goodput.

Public API: ``LLM``, ``SamplingParams``, ``EngineConfig``, ``RequestOutput``. They load lazily (PEP 562), so
importing a torch-free part of the package (``goodserve.scheduler``, ``goodserve.kv_cache``,
``goodserve.sim``) does not import torch through this file.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from goodserve.config import EngineConfig
    from goodserve.llm import LLM
    from goodserve.outputs import RequestOutput
    from goodserve.sampling_params import SamplingParams

_EXPORTS = {"LLM": "goodserve.llm", "SamplingParams": "goodserve.sampling_params",
            "EngineConfig": "goodserve.config", "RequestOutput": "goodserve.outputs"}

__all__ = ["LLM", "SamplingParams", "EngineConfig", "RequestOutput"]
__version__ = "0.1.0"


def __getattr__(name: str) -> Any:
    if name in _EXPORTS:
        value = getattr(importlib.import_module(_EXPORTS[name]), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'goodserve' has no attribute {name!r}")
