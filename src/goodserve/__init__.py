"""goodserve: an LLM serving engine built for goodput.

Public API: ``LLM``, ``SamplingParams``, ``EngineConfig``, ``RequestOutput``.
"""

from goodserve.config import EngineConfig
from goodserve.llm import LLM
from goodserve.outputs import RequestOutput
from goodserve.sampling_params import SamplingParams

__all__ = ["LLM", "SamplingParams", "EngineConfig", "RequestOutput"]
__version__ = "0.1.0"
