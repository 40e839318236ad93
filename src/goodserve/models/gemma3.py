"""Gemma 3 (text, ``Gemma3ForCausalLM``) over a flat token batch and a paged KV cache.

Gemma 3 technical report (Gemma Team, 2025, §2): interleaved local and global attention layers (by default five
local, then one global; ``ModelConfig.layer_types``), the local ones attending within a sliding window of
``sliding_window`` tokens (a query at ``p`` sees ``p - W + 1 .. p``) with their own RoPE base
(``rope_local_base_freq``, no scaling), the global ones over the whole context with ``rope_theta`` and its
scaling; grouped-query attention with an RMSNorm over each head of q and k before RoPE and scores scaled by
``query_pre_attn_scalar ** -0.5``; RMSNorm scaling by ``1 + weight`` (reduced in float32, the product cast back
after the weight, as HF ``Gemma3RMSNorm``); embeddings multiplied by ``sqrt(hidden_size)`` (in the model's dtype);
a GeGLU MLP (``gelu_pytorch_tanh``); norms before and after both attention and MLP (four per layer); the LM head
tied to the embedding unless the checkpoint has its own. Attention and final logit soft-capping, which Gemma 3
does not use, are refused by :mod:`goodserve.models.config_support` before any weight is read.

The local and global layers are separate KV-cache groups (:mod:`goodserve.kv_cache.layout`): each layer reads
its group's block tables (``AttentionMetadata.for_layer``), and the local groups' blocks before the window are
freed as a request advances. Where one group is required (a draft model, KV transfer) every layer keeps every
block and the local layers mask to their window, exact either way.
"""

from __future__ import annotations

import dataclasses
from typing import Optional, Union

import torch
import torch.nn.functional as F
from torch import nn

from goodserve.config import ModelConfig
from goodserve.models.attention import AttentionBackend, AttentionMetadata
from goodserve.models.checkpoint import dense_weight
from goodserve.models.llama import RotaryTable, cos_sin_table, rope_inv_freq
from goodserve.models.quant import BlockQuantized, make_linear

#: Per-layer weights of a Gemma 3 checkpoint (HF names after ``model.layers.{i}.``, without ``.weight``).
GEMMA3_LAYER_WEIGHTS = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
                        "self_attn.q_norm", "self_attn.k_norm", "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj",
                        "input_layernorm", "post_attention_layernorm", "pre_feedforward_layernorm",
                        "post_feedforward_layernorm")
_NORMS = ("input_layernorm", "post_attention_layernorm", "pre_feedforward_layernorm", "post_feedforward_layernorm")


def gemma_rms_norm(x: torch.Tensor, scale: torch.Tensor, eps: float) -> torch.Tensor:
    """``(x / sqrt(mean(x²) + eps)) * scale`` in float32, cast back to ``x``'s dtype (HF ``Gemma3RMSNorm``).

    Args:
        x: ``[..., d]``.
        scale: ``[d]`` (or broadcastable, e.g. ``[heads, d]``) float32 ``1 + weight``.
        eps: Epsilon.
    """
    return (F.rms_norm(x.float(), (x.shape[-1],), eps=eps) * scale).to(x.dtype)


class Gemma3DecoderLayer(nn.Module):
    """One Gemma 3 layer: ``x + post_attn_norm(attn(input_norm(x)))``, then ``+ post_ff_norm(mlp(pre_ff_norm(.)))``.

    Args:
        config: The architecture.
        window: The layer's sliding window in tokens (a local layer), or ``None`` (a global layer).
    """

    def __init__(self, config: ModelConfig, window: Optional[int]) -> None:
        super().__init__()
        c = config
        self.num_heads, self.num_kv_heads, self.head_dim = c.num_attention_heads, c.num_key_value_heads, c.head_dim
        self.q_size, self.kv_size = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        self.intermediate_size = c.intermediate_size
        self.window = window
        self.eps = c.rms_norm_eps
        # The attention backend scales scores by head_dim ** -0.5; q is multiplied so they come out scaled by
        # query_pre_attn_scalar ** -0.5.
        scalar = c.query_pre_attn_scalar or float(c.head_dim)
        self.q_multiplier = (c.head_dim / scalar) ** 0.5
        self.qkv_proj: Optional[nn.Module] = None  # made by Gemma3ForCausalLM.load_weights
        self.o_proj: Optional[nn.Module] = None
        self.gate_up_proj: Optional[nn.Module] = None
        self.down_proj: Optional[nn.Module] = None
        self.norm_scales: dict[str, torch.Tensor] = {}  # 1 + weight, float32, per norm of _NORMS
        self.qk_scale: Optional[torch.Tensor] = None  # [num_heads + num_kv_heads, head_dim] 1 + q/k norm weight

    def forward(self, x: torch.Tensor, rope: RotaryTable, kv_cache: tuple[torch.Tensor, torch.Tensor],
                meta: AttentionMetadata, attn: AttentionBackend) -> torch.Tensor:
        """``x``: ``[num_tokens, hidden]`` -> the hidden state after the layer, same shape."""
        n, s = x.shape[0], self.norm_scales
        h = gemma_rms_norm(x, s["input_layernorm"], self.eps)
        qk, v = self.qkv_proj.forward(h).split([self.q_size + self.kv_size, self.kv_size], dim=-1)
        qk = gemma_rms_norm(qk.reshape(n, self.num_heads + self.num_kv_heads, self.head_dim), self.qk_scale, self.eps)
        qk = rope(qk)
        q, k = qk[:, :self.num_heads], qk[:, self.num_heads:]  # [n, num_heads | num_kv_heads, head_dim]
        if self.q_multiplier != 1.0:
            q = q * self.q_multiplier
        v = v.reshape(n, self.num_kv_heads, self.head_dim)
        o = attn(q, k, v, kv_cache[0], kv_cache[1], meta.for_window(self.window)).reshape(n, self.q_size)
        x = x + gemma_rms_norm(self.o_proj.forward(o), s["post_attention_layernorm"], self.eps)
        h = gemma_rms_norm(x, s["pre_feedforward_layernorm"], self.eps)
        gate, up = self.gate_up_proj.forward(h).split(self.intermediate_size, dim=-1)
        h = self.down_proj.forward(F.gelu(gate, approximate="tanh") * up)
        return x + gemma_rms_norm(h, s["post_feedforward_layernorm"], self.eps)


class Gemma3ForCausalLM(nn.Module):
    """The Gemma 3 text decoder plus LM head, with the runner's model interface (``load_weights``, ``forward``,
    ``compute_logits``, ``can_decode_in_one_call``).

    Args:
        config: The architecture (``architecture == "gemma3_text"``).
    """

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.config = config
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size,
                                         _weight=torch.empty(config.vocab_size, config.hidden_size))
        self.layers = nn.ModuleList(Gemma3DecoderLayer(config, config.layer_window(i))
                                    for i in range(config.num_hidden_layers))
        self.norm_scale: Optional[torch.Tensor] = None
        self.lm_head: Optional[nn.Module] = None
        self.requires_grad_(False)
        self._rope_tables: dict[tuple[bool, torch.dtype], torch.Tensor] = {}

    def load_weights(self, weights: dict[str, Union[torch.Tensor, BlockQuantized]],
                     dtype: Optional[torch.dtype] = None, quantization: str = "none",
                     batch_invariant: bool = False) -> None:
        """Take HF-named weights (``model.layers.{i}.`` + :data:`GEMMA3_LAYER_WEIGHTS` + ``.weight``), fusing
        q/k/v and gate/up into one matmul each.

        Raises:
            ValueError: when a weight is missing or has the wrong shape, or ``batch_invariant`` (not implemented
                for Gemma 3).
        """
        if batch_invariant:
            raise ValueError("batch-invariant mode is not implemented for gemma3_text; supported: Llama-family "
                             "models with full attention")
        c = self.config
        dtype = dtype or self.embed_tokens.weight.dtype
        hidden, inter, d = c.hidden_size, c.intermediate_size, c.head_dim

        def take(name: str, shape: tuple[int, ...]) -> torch.Tensor:
            return dense_weight(weights, name, shape, dtype)

        def scale(name: str, size: int) -> torch.Tensor:
            return 1.0 + take(name, (size,)).float()

        self.embed_tokens.weight = nn.Parameter(take("model.embed_tokens.weight", (c.vocab_size, hidden)),
                                                requires_grad=False)
        self.norm_scale = scale("model.norm.weight", hidden)
        head = self.embed_tokens.weight if c.tie_word_embeddings else take("lm_head.weight", (c.vocab_size, hidden))
        self.lm_head = make_linear(head, None, dtype, quantization)
        for i, layer in enumerate(self.layers):
            p = f"model.layers.{i}."
            a = p + "self_attn."
            layer.qkv_proj = make_linear(torch.cat([take(a + "q_proj.weight", (layer.q_size, hidden)),
                                                    take(a + "k_proj.weight", (layer.kv_size, hidden)),
                                                    take(a + "v_proj.weight", (layer.kv_size, hidden))]),
                                         None, dtype, quantization)
            layer.o_proj = make_linear(take(a + "o_proj.weight", (hidden, layer.q_size)), None, dtype, quantization)
            layer.gate_up_proj = make_linear(torch.cat([take(p + "mlp.gate_proj.weight", (inter, hidden)),
                                                        take(p + "mlp.up_proj.weight", (inter, hidden))]),
                                             None, dtype, quantization)
            layer.down_proj = make_linear(take(p + "mlp.down_proj.weight", (hidden, inter)), None, dtype, quantization)
            layer.norm_scales = {name: scale(p + name + ".weight", hidden) for name in _NORMS}
            layer.qk_scale = torch.cat([scale(a + "q_norm.weight", d).expand(c.num_attention_heads, d),
                                        scale(a + "k_norm.weight", d).expand(c.num_key_value_heads, d)])
        self._rope_tables.clear()

    def rope_cos_sin(self, local: bool, dtype: torch.dtype) -> torch.Tensor:
        """``[2, max_position_embeddings, head_dim]`` cos/sin of the local layers' RoPE (``rope_local_theta``, no
        scaling) or the global layers' (``rope_theta`` and ``rope_scaling``), made once per dtype."""
        key = (local, dtype)
        if key not in self._rope_tables:
            c = self.config
            if local:
                c = dataclasses.replace(c, rope_theta=c.rope_local_theta or c.rope_theta, rope_scaling=None)
            inv_freq = rope_inv_freq(c).to(self.embed_tokens.weight.device)
            self._rope_tables[key] = cos_sin_table(inv_freq, c.max_position_embeddings, dtype)
        return self._rope_tables[key]

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                kv_caches: list[tuple[torch.Tensor, torch.Tensor]], meta: AttentionMetadata,
                attn: AttentionBackend) -> torch.Tensor:
        """Run the decoder over a flat batch.

        Args:
            input_ids: ``[num_tokens]`` int64.
            positions: ``[num_tokens]`` int64 position of each token in its request.
            kv_caches: Per layer ``(k_cache, v_cache)``, each ``[num_blocks, block_size, num_kv_heads, head_dim]``.
            meta: The step's attention metadata (with its windowed view for the local layers).
            attn: The attention backend.

        Returns:
            ``[num_tokens, hidden_size]`` final hidden states (after the last norm).
        """
        weight = self.embed_tokens.weight
        x = self.embed_tokens(input_ids) * torch.tensor(self.config.hidden_size ** 0.5, dtype=weight.dtype)
        ropes = {local: RotaryTable(self.rope_cos_sin(local, x.dtype), positions) for local in (False, True)}
        for i, (layer, kv_cache) in enumerate(zip(self.layers, kv_caches)):
            x = layer.forward(x, ropes[layer.window is not None], kv_cache, meta.for_layer(i), attn)
        return gemma_rms_norm(x, self.norm_scale, self.config.rms_norm_eps)

    def can_decode_in_one_call(self, num_tokens: int, meta: AttentionMetadata, attn: AttentionBackend) -> bool:
        """Always ``False``: the one-call native decode step is Llama-only."""
        return False

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """``[n, hidden_size]`` -> ``[n, vocab_size]`` float32 logits (no soft-capping: refused when configured)."""
        return self.lm_head.forward(hidden).float()
