"""Model architectures for the planner: built-in presets and loading from a HF ``config.json``.

An :class:`ArchSpec` holds only what the memory and roofline maths need. Presets are plain data, written
from each model's published ``config.json``; :func:`load_arch` also accepts a path to such a file or to a
HF model directory containing one (a multimodal config's ``text_config`` is read for its decoder).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

from goodserve.config_layers import SLIDING
from goodserve.model_config import ModelConfig, hf_model_type


@dataclass(frozen=True)
class ArchSpec:
    """A decoder-only transformer, reduced to the shapes that decide memory and FLOPs.

    Dense Llama-family models fill the first block of fields. Multi-head latent attention (MLA,
    DeepSeek-V2 §2.1) sets ``kv_lora_rank`` and the ``qk_*``/``v_head_dim`` widths; mixture-of-experts
    (MoE) sets ``num_experts`` and friends. Sliding-window attention sets ``sliding_window`` and how many
    layers apply it (Mistral 7B §2: every layer; Gemma 2/3: the local layers between the global ones).

    Attributes:
        name: Display name.
        num_hidden_layers: Decoder layers ``L``.
        hidden_size: Residual width ``H``.
        num_attention_heads: Query heads.
        num_key_value_heads: KV heads ``n_kv`` (ignored by the KV formula when MLA is used).
        head_dim: Per-head width ``d_head``.
        intermediate_size: SwiGLU width of a dense MLP.
        vocab_size: Token ids.
        tie_word_embeddings: LM head shares the embedding matrix.
        attention_bias: q/k/v projections carry a bias (Qwen2).
        max_position_embeddings: Context length the model was trained for, tokens.
        kv_lora_rank: MLA latent width ``d_c``; ``None`` for ordinary attention.
        q_lora_rank: MLA query low-rank width ``d_c'``; ``None`` means a full-rank query projection.
        qk_rope_head_dim: MLA decoupled RoPE key width ``d_h^R`` (shared by all heads).
        qk_nope_head_dim: MLA per-head non-RoPE query/key width.
        v_head_dim: MLA per-head value width.
        num_experts: Routed experts per MoE layer; ``0`` for a dense model.
        num_experts_per_tok: Routed experts each token uses (top-k).
        num_shared_experts: Always-on experts per MoE layer.
        moe_intermediate_size: SwiGLU width of one expert.
        first_k_dense_layers: Leading layers that keep a dense MLP.
        sliding_window: Window ``W`` in tokens of the sliding layers (a query at position ``p`` attends to
            positions ``p - W + 1 .. p``); ``None`` when every layer attends to the whole context.
        num_sliding_layers: Layers that attend within ``sliding_window``; the others attend to everything.
            Only the count matters to memory and roofline maths, not where the layers sit.
    """

    name: str
    num_hidden_layers: int
    hidden_size: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    max_position_embeddings: int = 8192
    kv_lora_rank: Optional[int] = None
    q_lora_rank: Optional[int] = None
    qk_rope_head_dim: int = 0
    qk_nope_head_dim: int = 0
    v_head_dim: int = 0
    num_experts: int = 0
    num_experts_per_tok: int = 0
    num_shared_experts: int = 0
    moe_intermediate_size: int = 0
    first_k_dense_layers: int = 0
    sliding_window: Optional[int] = None
    num_sliding_layers: int = 0

    def __post_init__(self) -> None:
        for field_name in ("num_hidden_layers", "hidden_size", "num_attention_heads", "num_key_value_heads",
                           "head_dim", "vocab_size"):
            if getattr(self, field_name) < 1:
                raise ValueError(f"{self.name}: {field_name} must be >= 1, got {getattr(self, field_name)}")
        if self.num_experts and not (0 < self.num_experts_per_tok <= self.num_experts):
            raise ValueError(f"{self.name}: num_experts_per_tok must be in 1..num_experts")
        if (self.sliding_window is None) != (self.num_sliding_layers == 0):
            raise ValueError(f"{self.name}: a sliding window needs sliding layers and sliding layers a window")
        if self.sliding_window is not None and self.sliding_window < 1:
            raise ValueError(f"{self.name}: sliding_window must be >= 1 token, got {self.sliding_window}")
        if not 0 <= self.num_sliding_layers <= self.num_hidden_layers:
            raise ValueError(f"{self.name}: num_sliding_layers must be in 0..num_hidden_layers")
        if self.num_sliding_layers and self.is_mla:
            raise ValueError(f"{self.name}: sliding-window MLA layers are not modelled")

    @property
    def is_mla(self) -> bool:
        """Whether attention caches a compressed latent (MLA) instead of per-head K and V."""
        return self.kv_lora_rank is not None

    @property
    def is_moe(self) -> bool:
        """Whether the MLPs are mixtures of experts."""
        return self.num_experts > 0

    def attended_tokens(self, context: int) -> int:
        """Key positions one query at ``context`` tokens attends to, summed over layers: ``context`` for each
        full layer, ``min(context, W)`` for each sliding one (token-layers)."""
        sliding = self.num_sliding_layers * min(context, self.sliding_window or 0)
        return (self.num_hidden_layers - self.num_sliding_layers) * context + sliding

    def to_model_config(self) -> ModelConfig:
        """The engine's :class:`~goodserve.config.ModelConfig` for a dense Llama-family spec.

        Raises:
            ValueError: MLA or MoE specs, or sliding layers mixed with full ones, which the engine's
                ModelConfig cannot describe.
        """
        if self.is_mla or self.is_moe:
            raise ValueError(f"{self.name}: MLA/MoE architectures have no goodserve ModelConfig")
        if 0 < self.num_sliding_layers < self.num_hidden_layers:
            raise ValueError(f"{self.name}: mixed sliding and full layers have no goodserve ModelConfig")
        return ModelConfig(
            architecture="llama", vocab_size=self.vocab_size, hidden_size=self.hidden_size,
            intermediate_size=self.intermediate_size, num_hidden_layers=self.num_hidden_layers,
            num_attention_heads=self.num_attention_heads, num_key_value_heads=self.num_key_value_heads,
            head_dim=self.head_dim, max_position_embeddings=self.max_position_embeddings,
            attention_bias=self.attention_bias, tie_word_embeddings=self.tie_word_embeddings,
            sliding_window=self.sliding_window,
        )


# Figures from each model's config.json on the Hugging Face Hub.
PRESETS: dict[str, ArchSpec] = {
    spec.name.lower(): spec
    for spec in (
        ArchSpec("Llama-3-8B", num_hidden_layers=32, hidden_size=4096, num_attention_heads=32,
                 num_key_value_heads=8, head_dim=128, intermediate_size=14336, vocab_size=128256,
                 max_position_embeddings=8192),
        ArchSpec("Llama-3-70B", num_hidden_layers=80, hidden_size=8192, num_attention_heads=64,
                 num_key_value_heads=8, head_dim=128, intermediate_size=28672, vocab_size=128256,
                 max_position_embeddings=8192),
        ArchSpec("Qwen2.5-7B", num_hidden_layers=28, hidden_size=3584, num_attention_heads=28,
                 num_key_value_heads=4, head_dim=128, intermediate_size=18944, vocab_size=152064,
                 attention_bias=True, max_position_embeddings=131072),
        ArchSpec("Mistral-7B", num_hidden_layers=32, hidden_size=4096, num_attention_heads=32,
                 num_key_value_heads=8, head_dim=128, intermediate_size=14336, vocab_size=32000,
                 max_position_embeddings=32768),
        # MLA + MoE: 236B parameters in total, ~21B active per token (DeepSeek-V2 paper, abstract). All
        # experts must be resident, so weights memory follows the total; decode FLOPs follow the active.
        ArchSpec("DeepSeek-V2", num_hidden_layers=60, hidden_size=5120, num_attention_heads=128,
                 num_key_value_heads=128, head_dim=192, intermediate_size=12288, vocab_size=102400,
                 max_position_embeddings=131072, kv_lora_rank=512, q_lora_rank=1536, qk_rope_head_dim=64,
                 qk_nope_head_dim=128, v_head_dim=128, num_experts=160, num_experts_per_tok=6,
                 num_shared_experts=2, moe_intermediate_size=1536, first_k_dense_layers=1),
        # MLA + MoE (deepseek-ai/DeepSeek-V3 config.json): 671B parameters in total, 37B active per token
        # (DeepSeek-V3 technical report, abstract; the multi-token-prediction module is not counted here).
        ArchSpec("DeepSeek-V3", num_hidden_layers=61, hidden_size=7168, num_attention_heads=128,
                 num_key_value_heads=128, head_dim=192, intermediate_size=18432, vocab_size=129280,
                 max_position_embeddings=163840, kv_lora_rank=512, q_lora_rank=1536, qk_rope_head_dim=64,
                 qk_nope_head_dim=128, v_head_dim=128, num_experts=256, num_experts_per_tok=8,
                 num_shared_experts=1, moe_intermediate_size=2048, first_k_dense_layers=3),
        # google/gemma-3-27b-it, text_config: 5 local (sliding, 1024 tokens) layers to 1 global, layer i global
        # when (i + 1) % 6 == 0, so 10 of the 62 layers are global (Gemma 3 technical report, §2). The MLP
        # is GeGLU, the same three matrices as SwiGLU.
        ArchSpec("Gemma-3-27B", num_hidden_layers=62, hidden_size=5376, num_attention_heads=32,
                 num_key_value_heads=16, head_dim=128, intermediate_size=21504, vocab_size=262208,
                 tie_word_embeddings=True, max_position_embeddings=131072, sliding_window=1024,
                 num_sliding_layers=62 - 62 // 6),
        ArchSpec("SmolLM2-135M", num_hidden_layers=30, hidden_size=576, num_attention_heads=9,
                 num_key_value_heads=3, head_dim=64, intermediate_size=1536, vocab_size=49152,
                 tie_word_embeddings=True, max_position_embeddings=8192),
    )
}


#: Gemma 2/3 keys their ``config.json`` may leave to the transformers config class (``Gemma2Config``,
#: ``Gemma3TextConfig``): a 256k vocabulary, tied embeddings, and the local:global layer pattern (every
#: ``sliding_window_pattern``-th layer global).
_GEMMA_DEFAULTS: dict[str, dict[str, Any]] = {
    "gemma2": {"vocab_size": 256000, "tie_word_embeddings": True, "sliding_window_pattern": 2},
    "gemma3_text": {"vocab_size": 262208, "tie_word_embeddings": True, "max_position_embeddings": 131072,
                    "sliding_window_pattern": 6},
}
_GEMMA_DEFAULTS["gemma3"] = _GEMMA_DEFAULTS["gemma3_text"]


def arch_from_hf_config(cfg: dict[str, Any], name: str = "model") -> ArchSpec:
    """Build an :class:`ArchSpec` from a parsed HF ``config.json``.

    The dense shapes come from :meth:`ModelConfig.from_hf_config`, the engine loader's parser, with its
    defaults (e.g. ``max_position_embeddings`` 2048 when absent), experts included (Mixtral, Qwen3-MoE with
    its dense ``mlp_only_layers``) and its sliding layers (``layer_types``). On top, this reads DeepSeek-V2/V3
    (MLA, ``n_routed_experts``) and a multimodal config's ``text_config`` (Gemma 3).

    Raises:
        ValueError: A required key is missing.
    """
    if "text_config" in cfg and "num_hidden_layers" not in cfg:
        cfg = dict(cfg["text_config"])
    cfg = {**_GEMMA_DEFAULTS.get(hf_model_type(cfg) or "", {}), **cfg}
    try:
        base = ModelConfig.from_hf_config(cfg)
    except ValueError as exc:
        raise ValueError(f"{name}: {exc}") from None
    head_dim = base.head_dim
    mla: dict[str, Any] = {}
    if cfg.get("kv_lora_rank"):
        nope, rope = int(cfg["qk_nope_head_dim"]), int(cfg["qk_rope_head_dim"])
        mla = dict(kv_lora_rank=int(cfg["kv_lora_rank"]), q_lora_rank=cfg.get("q_lora_rank"),
                   qk_rope_head_dim=rope, qk_nope_head_dim=nope, v_head_dim=int(cfg["v_head_dim"]))
        head_dim = nope + rope
    moe: dict[str, Any] = {}
    if base.is_mla:  # DeepSeek-V2/V3 as the engine's loader parses them: no MoE layer, no experts
        if base.num_experts:
            moe = dict(num_experts=base.num_experts, num_experts_per_tok=base.num_experts_per_tok,
                       num_shared_experts=base.num_shared_experts, moe_intermediate_size=base.moe_intermediate_size,
                       first_k_dense_layers=len(base.dense_mlp_layers))
    elif cfg.get("n_routed_experts"):  # DeepSeek style
        moe = dict(num_experts=int(cfg["n_routed_experts"]), num_experts_per_tok=int(cfg["num_experts_per_tok"]),
                   num_shared_experts=int(cfg.get("n_shared_experts") or 0),
                   moe_intermediate_size=int(cfg["moe_intermediate_size"]),
                   first_k_dense_layers=int(cfg.get("first_k_dense_replace") or 0))
    elif base.num_experts:  # Mixtral, Qwen3-MoE: as the engine's loader parsed them
        moe = dict(num_experts=base.num_experts, num_experts_per_tok=base.num_experts_per_tok,
                   moe_intermediate_size=base.moe_intermediate_size,
                   # dense layers are priced by count, wherever they sit
                   first_k_dense_layers=len(base.dense_mlp_layers))
    num_sliding = 0 if mla else base.layer_types.count(SLIDING)
    return ArchSpec(
        name=name, num_hidden_layers=base.num_hidden_layers, hidden_size=base.hidden_size,
        num_attention_heads=base.num_attention_heads, num_key_value_heads=base.num_key_value_heads,
        head_dim=head_dim, intermediate_size=base.intermediate_size, vocab_size=base.vocab_size,
        tie_word_embeddings=base.tie_word_embeddings, attention_bias=base.attention_bias,
        max_position_embeddings=base.max_position_embeddings,
        sliding_window=base.sliding_window if num_sliding else None, num_sliding_layers=num_sliding, **mla, **moe,
    )


def load_arch(model: str) -> ArchSpec:
    """Resolve ``--model``: a preset name, a ``config.json`` path, or a HF model directory.

    Args:
        model: Preset name (case-insensitive, see :data:`PRESETS`) or a filesystem path.

    Raises:
        ValueError: Neither a known preset nor a readable config; the message lists the presets.
    """
    preset = PRESETS.get(model.lower())
    if preset is not None:
        return preset
    path = Path(model)
    if path.is_dir():
        path = path / "config.json"
    if not path.is_file():
        names = ", ".join(spec.name for spec in PRESETS.values())
        raise ValueError(f"unknown model {model!r}: not a preset ({names}) nor a config.json / HF model directory")
    try:
        cfg = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise ValueError(f"cannot read {path}: {exc}") from None
    return arch_from_hf_config(cfg, name=path.parent.name if path.name == "config.json" else path.stem)
