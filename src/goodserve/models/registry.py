"""Which model class runs a :class:`~goodserve.config.ModelConfig`: Gemma 3 (text) and DeepSeek-V2 (multi-head
latent attention) have their own decoders (:mod:`goodserve.models.gemma3`, :mod:`goodserve.models.deepseek_v2`);
every other supported architecture is a Llama-family decoder (:mod:`goodserve.models.llama`)."""

from __future__ import annotations

from goodserve.config import ModelConfig

#: ``ModelConfig.architecture`` values that run on :class:`goodserve.models.gemma3.Gemma3ForCausalLM`.
GEMMA3_ARCHITECTURES = ("gemma3_text",)


def model_class(config: ModelConfig) -> type:
    """The ``nn.Module`` class to build for ``config`` (constructed as ``cls(config)``, weights given by
    ``load_weights``)."""
    if config.is_mla:
        from goodserve.models.deepseek_v2 import DeepseekV2ForCausalLM

        return DeepseekV2ForCausalLM
    if config.architecture in GEMMA3_ARCHITECTURES:
        from goodserve.models.gemma3 import Gemma3ForCausalLM

        return Gemma3ForCausalLM
    from goodserve.models.llama import LlamaForCausalLM

    return LlamaForCausalLM


def batch_invariant_supported(config: ModelConfig) -> bool:
    """Whether the model has a batch-invariant path: the Llama-family decoder with full attention on every layer
    (its loader refuses ``batch_invariant`` for sliding windows; Gemma 3 and MLA have no such path)."""
    return not config.is_mla and config.architecture not in GEMMA3_ARCHITECTURES and config.sliding_window is None
