"""DeepSeek-V2 over a flat token batch and a paged latent KV cache.

The decoder of DeepSeek-V2 (arXiv:2405.04434): pre-norm layers whose attention is multi-head latent
attention (§2.1, :mod:`goodserve.models.mla`) and whose MLP is the SwiGLU of ``intermediate_size`` on the
first ``first_k_dense_replace`` layers and DeepSeekMoE (§2.2: routed experts of
:mod:`goodserve.models.moe`, softmax top-k, optionally group-limited, scaled by ``routed_scaling_factor``,
plus shared experts) on the others. Per layer and token::

    q        = q_proj(h)                       or  q_b_proj(RMSNorm(q_a_proj(h)))     [num_heads, nope + rope]
    c_KV,k^R = kv_a_proj_with_mqa(h)           c_KV <- kv_a_layernorm(c_KV)             [kv_lora_rank], [rope]
    q_pe,k^R = RoPE(q_pe), RoPE(k^R)           (interleaved pairs, as transformers)
    cache   <- [c_KV ; k^R]                     one row of kv_lora_rank + rope elements
    o        = MLA(q, cache, kv_b_proj)                                                 [num_heads, v_head_dim]
    out      = o_proj(o)

The arithmetic mirrors transformers' ``DeepseekV2ForCausalLM`` (norms in float32, cast back before the
weight) so greedy decoding matches it token for token in float32.
"""

from __future__ import annotations

from typing import Optional, Union

import torch
import torch.nn.functional as F
from torch import nn

from goodserve.config import ModelConfig
from goodserve.models.attention import AttentionMetadata
from goodserve.models.checkpoint import dense_weight, take_weight
from goodserve.models.linear import dense_linear
from goodserve.models.llama import RMSNorm, _rms_norm, add_rms_norm
from goodserve.models.mla import (MLA_NORM_EPS, MLAAttentionBackend, apply_rope_interleaved, mla_rope_cis,
                                 mla_softmax_scale)
from goodserve.models.moe import SparseMoeBlock, hf_layer_names
from goodserve.models.quant import BlockQuantized, make_linear


def expected_weight_names(config: ModelConfig) -> set[str]:
    """HF names of every tensor a DeepSeek-V2 checkpoint holds for ``config`` (``lm_head.weight`` included)."""
    names = {"model.embed_tokens.weight", "model.norm.weight", "lm_head.weight"}
    q = ["q_proj"] if config.q_lora_rank is None else ["q_a_proj", "q_a_layernorm", "q_b_proj"]
    attn = q + ["kv_a_proj_with_mqa", "kv_a_layernorm", "kv_b_proj", "o_proj"]
    parts = [f"self_attn.{p}" for p in attn] + ["mlp.gate_proj", "mlp.up_proj", "mlp.down_proj", "input_layernorm",
                                                 "post_attention_layernorm"]
    shared = [f"mlp.shared_experts.{w}.weight" for w in ("gate_proj", "up_proj", "down_proj")]
    for i in range(config.num_hidden_layers):
        moe = config.is_moe_layer(i)
        names.update(f"model.layers.{i}.{part}.weight" for part in parts if not (moe and part.startswith("mlp.")))
        if moe:
            names.update(hf_layer_names(config, i))
            names.update(f"model.layers.{i}.{w}" for w in shared)  # zero rows without shared experts
    return names


class MLADecoderLayer(nn.Module):
    """One pre-norm layer: MLA, then the SwiGLU MLP (gate and up fused into one matmul) or, with ``moe``, the
    DeepSeekMoE MLP (§2.2.1): the routed experts (:class:`~goodserve.models.moe.SparseMoeBlock`) plus the shared
    experts, one SwiGLU of width ``num_shared_experts * moe_intermediate_size`` (``gate_up_proj`` /
    ``down_proj`` then hold the shared experts)."""

    def __init__(self, config: ModelConfig, moe: bool = False) -> None:
        super().__init__()
        c = config
        self.num_heads, self.rank = c.num_attention_heads, c.kv_lora_rank
        self.nope, self.rope, self.v_dim = c.qk_nope_head_dim, c.qk_rope_head_dim, c.v_head_dim
        self.scale = mla_softmax_scale(c)
        self.input_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        # Made by DeepseekV2ForCausalLM.load_weights: q_proj (or q_a_proj, q_a_norm, q_b_proj), kv_a_proj,
        # kv_a_norm, kv_b ([num_heads, nope + v_head_dim, kv_lora_rank]), o_proj, gate_up_proj, down_proj.
        self.q_proj: Optional[nn.Module] = None
        self.q_a_proj: Optional[nn.Module] = None
        self.q_a_norm: Optional[torch.Tensor] = None
        self.q_b_proj: Optional[nn.Module] = None
        self.kv_a_proj: Optional[nn.Module] = None
        self.kv_a_norm: Optional[torch.Tensor] = None
        self.kv_b: Optional[torch.Tensor] = None
        self.o_proj: Optional[nn.Module] = None
        self.gate_up_proj: Optional[nn.Module] = None
        self.down_proj: Optional[nn.Module] = None
        self.moe = SparseMoeBlock(c) if moe else None
        self.intermediate_size = c.num_shared_experts * c.moe_intermediate_size if moe else c.intermediate_size

    def forward(self, x: torch.Tensor, residual: Optional[torch.Tensor], cis: torch.Tensor,
                cache: torch.Tensor, meta: AttentionMetadata,
                attn: MLAAttentionBackend) -> tuple[torch.Tensor, torch.Tensor]:
        """One layer with the residual add deferred into the next norm.

        Args:
            x: ``[num_tokens, hidden]``, the previous layer's MLP output (the embeddings for the first layer).
            residual: ``[num_tokens, hidden]`` the residual stream before ``x``; ``None`` for the first layer.
            cis: ``[num_tokens, qk_rope_head_dim // 2]`` complex64 RoPE rotations at the tokens' positions.
            cache: ``[num_blocks, block_size, 1, kv_lora_rank + qk_rope_head_dim]``, written in place.
            meta: The step's metadata.
            attn: The MLA attention.

        Returns:
            ``(mlp_out, residual)``: the hidden state after the layer is ``mlp_out + residual``.
        """
        n = x.shape[0]
        h, residual = add_rms_norm(x, residual, self.input_layernorm.weight, self.input_layernorm.eps)
        if self.q_proj is not None:
            q = self.q_proj.forward(h)
        else:
            q = self.q_b_proj.forward(_rms_norm(self.q_a_proj.forward(h), self.q_a_norm, MLA_NORM_EPS))
        q = q.view(n, self.num_heads, self.nope + self.rope)
        q_nope, q_pe = q.split([self.nope, self.rope], dim=-1)
        latent, k_pe = self.kv_a_proj.forward(h).split([self.rank, self.rope], dim=-1)
        latent = _rms_norm(latent, self.kv_a_norm, MLA_NORM_EPS)  # [n, kv_lora_rank]
        q_pe = apply_rope_interleaved(q_pe, cis)  # [n, num_heads, qk_rope_head_dim]
        k_pe = apply_rope_interleaved(k_pe[:, None], cis)[:, 0]  # [n, qk_rope_head_dim]
        o = attn(q_nope, q_pe, latent, k_pe, cache, self.kv_b, self.scale, meta)  # [n, num_heads, v_head_dim]
        h, residual = add_rms_norm(self.o_proj.forward(o.reshape(n, self.num_heads * self.v_dim)), residual,
                                   self.post_attention_layernorm.weight, self.post_attention_layernorm.eps)
        out = self.moe.forward(h) if self.moe is not None else None
        if self.gate_up_proj is None:  # MoE without shared experts
            return out, residual
        gate, up = self.gate_up_proj.forward(h).split(self.intermediate_size, dim=-1)
        dense = self.down_proj.forward(F.silu(gate) * up)
        return dense if out is None else out + dense, residual


class DeepseekV2ForCausalLM(nn.Module):
    """The DeepSeek-V2 decoder plus LM head, with the call surface the runner uses for
    :class:`~goodserve.models.llama.LlamaForCausalLM` (``load_weights``, ``forward``, ``compute_logits``).

    Args:
        config: The architecture (``config.is_mla``).

    Raises:
        ValueError: if ``config`` is not an MLA config.
    """

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        if not config.is_mla:
            raise ValueError(f"DeepseekV2ForCausalLM needs an MLA config, got {config.architecture!r}")
        self.config = config
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size,
                                         _weight=torch.empty(config.vocab_size, config.hidden_size))
        self.layers = nn.ModuleList(MLADecoderLayer(config, config.is_moe_layer(i))
                                    for i in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.lm_head: Optional[nn.Module] = None
        self.decode_plan = None  # no native one-call decode step for MLA
        self.requires_grad_(False)
        self._cis: Optional[torch.Tensor] = None

    def load_weights(self, weights: dict[str, Union[torch.Tensor, BlockQuantized]],
                     dtype: Optional[torch.dtype] = None, quantization: str = "none",
                     batch_invariant: bool = False) -> None:
        """Take HF-named weights (``model.layers.0.self_attn.kv_b_proj.weight``, ...); gate/up are fused.

        Args:
            weights: HF parameter names to tensors (:func:`expected_weight_names`).
            dtype: Dtype of the weights and activations; default: the embedding's current dtype.
            quantization: How the linear layers run (:func:`goodserve.models.quant.make_linear`); ``kv_b_proj``
                always stays dense in ``dtype`` (it is absorbed into the decode queries and outputs).
            batch_invariant: Refused: there is no batch-invariant MLA path.

        Raises:
            ValueError: when a weight is missing or has the wrong shape, or ``batch_invariant``.
        """
        if batch_invariant:
            raise ValueError("batch-invariant mode is not implemented for multi-head latent attention "
                             f"({self.config.architecture})")
        dtype = dtype or self.embed_tokens.weight.dtype
        c = self.config

        def dense(name: str, shape: tuple[int, ...]) -> torch.Tensor:
            return dense_weight(weights, name, shape, dtype)

        def linear(name: str, shape: tuple[int, int]) -> nn.Module:
            return make_linear(take_weight(weights, name, shape), None, dtype, quantization)

        hidden, heads = c.hidden_size, c.num_attention_heads
        qk = c.qk_nope_head_dim + c.qk_rope_head_dim
        self.embed_tokens.weight = nn.Parameter(dense("model.embed_tokens.weight", (c.vocab_size, hidden)),
                                                requires_grad=False)
        self.norm.weight = nn.Parameter(dense("model.norm.weight", (hidden,)), requires_grad=False)
        self.lm_head = dense_linear(self.embed_tokens.weight if c.tie_word_embeddings
                                    else dense("lm_head.weight", (c.vocab_size, hidden)))
        for i, layer in enumerate(self.layers):
            p = f"model.layers.{i}."
            a = p + "self_attn."
            if c.q_lora_rank is None:
                layer.q_proj = linear(a + "q_proj.weight", (heads * qk, hidden))
            else:
                layer.q_a_proj = linear(a + "q_a_proj.weight", (c.q_lora_rank, hidden))
                layer.q_a_norm = dense(a + "q_a_layernorm.weight", (c.q_lora_rank,))
                layer.q_b_proj = linear(a + "q_b_proj.weight", (heads * qk, c.q_lora_rank))
            layer.kv_a_proj = linear(a + "kv_a_proj_with_mqa.weight", (c.kv_lora_rank + c.qk_rope_head_dim, hidden))
            layer.kv_a_norm = dense(a + "kv_a_layernorm.weight", (c.kv_lora_rank,))
            layer.kv_b = dense(a + "kv_b_proj.weight", (heads * (c.qk_nope_head_dim + c.v_head_dim), c.kv_lora_rank)
                               ).view(heads, c.qk_nope_head_dim + c.v_head_dim, c.kv_lora_rank)
            layer.o_proj = linear(a + "o_proj.weight", (hidden, heads * c.v_head_dim))
            mlp, inter = p + "mlp.", layer.intermediate_size
            if layer.moe is not None:
                layer.moe.load(lambda name, shape: nn.Parameter(dense(name, shape), requires_grad=False), p)
                mlp = p + "mlp.shared_experts."
            if inter:
                gate_up = torch.cat([dense(mlp + "gate_proj.weight", (inter, hidden)),
                                     dense(mlp + "up_proj.weight", (inter, hidden))])
                layer.gate_up_proj = make_linear(gate_up, None, dtype, quantization)
                layer.down_proj = linear(mlp + "down_proj.weight", (hidden, inter))
            layer.input_layernorm.weight = nn.Parameter(dense(p + "input_layernorm.weight", (hidden,)),
                                                        requires_grad=False)
            layer.post_attention_layernorm.weight = nn.Parameter(
                dense(p + "post_attention_layernorm.weight", (hidden,)), requires_grad=False)
        self._cis = mla_rope_cis(c, self.embed_tokens.weight.device)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                kv_caches: list[tuple[torch.Tensor, None]], meta: AttentionMetadata,
                attn: MLAAttentionBackend) -> torch.Tensor:
        """Run the decoder over a flat batch.

        Args:
            input_ids: ``[num_tokens]`` int64.
            positions: ``[num_tokens]`` int64 position of each token in its request.
            kv_caches: Per layer ``(latent_cache, None)`` (:func:`goodserve.models.mla.mla_kv_caches`).
            meta: Attention metadata of the step.
            attn: The MLA attention (:class:`~goodserve.models.mla.MLAAttentionBackend`).

        Returns:
            ``[num_tokens, hidden_size]`` final hidden states (after the last norm).

        Raises:
            RuntimeError: if ``attn`` is not an MLA backend (the runner picks it for an MLA model).
        """
        if not isinstance(attn, MLAAttentionBackend):
            raise RuntimeError(f"an MLA model attends with MLAAttentionBackend, got {type(attn).__name__}")
        x = self.embed_tokens(input_ids)  # [num_tokens, hidden]
        cis = self._cis.index_select(0, positions)  # [num_tokens, qk_rope_head_dim // 2]
        residual = None
        for layer, (cache, _) in zip(self.layers, kv_caches):
            x, residual = layer.forward(x, residual, cis, cache, meta, attn)
        return add_rms_norm(x, residual, self.norm.weight, self.norm.eps)[0]

    def can_decode_in_one_call(self, num_tokens: int, meta: AttentionMetadata, attn: object) -> bool:
        """Never: the native one-call decode step (:func:`goodserve.models.native_decode.decode_layers`) has no MLA."""
        return False

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """``[n, hidden_size]`` -> ``[n, vocab_size]`` float32 logits (after :meth:`load_weights`)."""
        return self.lm_head.forward(hidden).float()
