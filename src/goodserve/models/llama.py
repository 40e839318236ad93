"""A Llama-family decoder over a flat token batch and a paged KV cache.

Covers Llama 2/3 (incl. Llama-3 rope scaling), Mistral, Qwen2/2.5 (q/k/v bias), Qwen3 (RMSNorm of each q and
k head before RoPE), Phi-3 (its fused projections split by the loaders), SmolLM2, and the mixtures of experts
Mixtral and Qwen3-MoE (their MLP in :mod:`goodserve.models.moe`): RMSNorm (Zhang & Sennrich
2019), rotary position embeddings in the rotate-half layout (Su et al. 2021), grouped-query attention (Ainslie
et al. 2023; MQA when there is one KV head), a SwiGLU MLP (Shazeer 2020) and optionally tied embeddings. The
arithmetic mirrors HF ``transformers`` (norms in float32, cast back before the weight) so greedy decoding
matches it token for token.

There is no padding and no batch dimension: a step is ``num_tokens`` tokens from many requests, each with
its own position; attention reads the paged cache through ``AttentionMetadata``.
"""

from __future__ import annotations

import math
from typing import Optional, Union

import torch
import torch.nn.functional as F
from torch import nn

from goodserve.config import ModelConfig
from goodserve.models import decode_plans, native, native_decode
from goodserve.models.attention import AttentionBackend, AttentionMetadata, NativeAttentionBackend
from goodserve.models.checkpoint import dense_weight, take_weight
from goodserve.models.invariant import InvariantLinear, rms_norm_torch
from goodserve.models.invariant_attention import SPLIT_TOKENS, InvariantAttentionBackend, run_starts
from goodserve.models.kquant import PartsLinear
from goodserve.models.linear import dense_linear
from goodserve.models.moe import SparseMoeBlock
from goodserve.models.quant import DEFAULT_MAX_ROWS, BlockQuantized, make_linear, runs_on_blocks
from goodserve.models.short_rows import as_decode_rows, decode_rows


def cos_sin_table(inv_freq: torch.Tensor, max_positions: int, dtype: torch.dtype) -> torch.Tensor:
    """``[2, max_positions, head_dim]`` cos and sin of every position: row ``p`` is ``cos/sin(p * inv_freq)``
    repeated over the two halves (rotate-half layout), computed in float32 then cast to ``dtype``."""
    freqs = torch.arange(max_positions, device=inv_freq.device).float()[:, None] * inv_freq[None, :]
    emb = torch.cat((freqs, freqs), dim=-1)  # [max_positions, head_dim]
    return torch.stack([emb.cos(), emb.sin()]).to(dtype)


def rope_inv_freq(config: ModelConfig) -> torch.Tensor:
    """Inverse frequencies ``[head_dim // 2]`` (float32), with Llama-3 or linear scaling applied.

    Llama-3 scaling (Meta's Llama 3.1 release): wavelengths longer than
    ``original_max_position_embeddings / low_freq_factor`` are divided by ``factor``, shorter than
    ``.../high_freq_factor`` are kept, and those between are interpolated smoothly.

    Raises:
        ValueError: for a rope scaling type other than ``default``, ``linear`` or ``llama3``.
    """
    dim = config.head_dim
    # Always on the CPU, also under a ``torch.device("meta")`` context: arithmetic on meta tensors runs
    # Python decompositions whose first use imports torch._dynamo (seconds of a one-shot command's start).
    steps = torch.arange(0, dim, 2, dtype=torch.int64, device="cpu")
    inv_freq = 1.0 / (config.rope_theta ** (steps.float() / dim))
    scaling = config.rope_scaling or {}
    kind = scaling.get("rope_type", scaling.get("type", "default"))
    if kind == "default":
        return inv_freq
    factor = float(scaling["factor"])
    if kind == "linear":
        return inv_freq / factor
    if kind != "llama3":
        raise ValueError(f"unsupported rope scaling {kind!r}; supported: default, linear, llama3")
    low, high = float(scaling["low_freq_factor"]), float(scaling["high_freq_factor"])
    old_len = float(scaling["original_max_position_embeddings"])
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > old_len / low, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = (wavelen >= old_len / high) & (wavelen <= old_len / low)
    return torch.where(medium, smoothed, scaled)


class RMSNorm(nn.Module):
    """``x / sqrt(mean(x²) + eps) * weight``, reduced in float32. Input/output ``[num_tokens, hidden]``."""

    def __init__(self, hidden_size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size), requires_grad=False)
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _rms_norm(x, self.weight, self.eps)


def _rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    # One fused op for HF's ``x32 * rsqrt(mean(x32²) + eps)`` (bit-identical here), the weight applied after
    # the cast back as HF does.
    return weight * F.rms_norm(x.float(), (x.shape[-1],), eps=eps).to(x.dtype)


def add_rms_norm(x: torch.Tensor, residual: Optional[torch.Tensor], weight: torch.Tensor,
                 eps: float, invariant: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """``(RMSNorm(x + residual) * weight, x + residual)``; without ``residual``, of ``x`` itself.

    One native call on the CPU where the kernels build (:func:`goodserve.models.native.rms_norm`, rounded as
    the eager ops; each row summed in order by one thread), else the eager ops, whose sum of squares is
    taken in order when ``invariant`` (batch-invariant mode). ``x``, ``residual``: ``[rows, hidden]``.
    """
    if native.usable(x):
        return native.rms_norm(x, weight, eps, residual)
    h = x if residual is None else x + residual
    return (rms_norm_torch if invariant else _rms_norm)(h, weight, eps), h


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate-half RoPE. ``x``: ``[num_tokens, heads, head_dim]``; ``cos``/``sin``: ``[num_tokens, 1, head_dim]``."""
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin


class RotaryTable:
    """The step's rotary embedding: ``table`` (``[2, max_positions, head_dim]`` cos and sin) at ``positions``
    (``[rows]`` int64). Calling it on ``[rows, heads, head_dim]`` rotates every head (one native call on the
    CPU where the kernels build, else the eager ops over the rows' cos/sin, gathered once per step)."""

    def __init__(self, table: torch.Tensor, positions: torch.Tensor) -> None:
        self.table, self.positions = table, positions
        self.cos_sin: Optional[torch.Tensor] = None
        if not native.usable(table):
            self.cos_sin = table.index_select(1, positions)[:, :, None, :]  # [2, rows, 1, head_dim]

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.cos_sin is None:
            return native.rope(x, self.table, self.positions)
        return _rotate(x, self.cos_sin[0], self.cos_sin[1])


PAD_MULTIPLE = 16
PAD_MIN_TOKENS = 128


def padded_num_tokens(num_tokens: int) -> int:
    """Rows the GEMMs run on for a step of ``num_tokens`` tokens.

    CPU GEMM kernels (oneDNN, bf16) are markedly slower on row counts that are not a multiple of 16: on the
    default model the four projections of a layer take 7.4 ms at 517 rows and 4.6 ms at 512 (5.4 ms at
    528). Steps above ``PAD_MIN_TOKENS`` tokens, typically a prefill chunk plus the running decodes, are
    padded up to a multiple of ``PAD_MULTIPLE`` rows; smaller steps are weight-bound and gain nothing.
    Padding rows hold token 0 at position 0, skip attention (so they never touch the KV cache) and are
    dropped after the last layer.
    """
    if num_tokens <= PAD_MIN_TOKENS:
        return num_tokens
    return -(-num_tokens // PAD_MULTIPLE) * PAD_MULTIPLE


class DecoderLayer(nn.Module):
    """Pre-norm attention + SwiGLU block; q/k/v and gate/up projections fused into one matmul each.

    With ``config.qk_norm`` (Qwen3), ``qk_norm`` is the ``[num_heads + num_kv_heads, head_dim]`` weight of an
    RMSNorm over each head of q and k before RoPE: ``q_norm``'s ``[head_dim]`` row repeated for the query
    heads, then ``k_norm``'s for the KV heads, so one norm call covers both as HF's two do.

    With ``moe`` the MLP is ``self.moe``, a :class:`~goodserve.models.moe.SparseMoeBlock` (Mixtral, Qwen3-MoE),
    and there are no ``gate_up_proj`` / ``down_proj``.

    With ``window`` the layer attends within that many tokens (``config.layer_window``: Mistral's
    ``sliding_window``, Qwen2's sliding layers), through the step's windowed metadata.
    """

    def __init__(self, config: ModelConfig, moe: bool = False, window: Optional[int] = None) -> None:
        super().__init__()
        c = config
        self.num_heads, self.num_kv_heads, self.head_dim = c.num_attention_heads, c.num_key_value_heads, c.head_dim
        self.q_size, self.kv_size = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        self.input_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.qkv_proj = nn.Linear(c.hidden_size, self.q_size + 2 * self.kv_size, bias=c.attention_bias)
        self.o_proj = nn.Linear(self.q_size, c.hidden_size, bias=False)
        self.post_attention_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.moe = SparseMoeBlock(c) if moe else None
        self.gate_up_proj = None if moe else nn.Linear(c.hidden_size, 2 * c.intermediate_size, bias=False)
        self.down_proj = None if moe else nn.Linear(c.intermediate_size, c.hidden_size, bias=False)
        self.intermediate_size = c.intermediate_size
        self.qk_norm: Optional[nn.Parameter] = None
        if c.qk_norm:
            self.qk_norm = nn.Parameter(torch.ones(c.num_attention_heads + c.num_key_value_heads, c.head_dim),
                                        requires_grad=False)
        self.eps = c.rms_norm_eps
        self.window = window
        self.invariant = False  # batch-invariant mode (set by LlamaForCausalLM.load_weights)

    def forward(self, x: torch.Tensor, residual: Optional[torch.Tensor], rope: "RotaryTable",
                kv_cache: tuple[torch.Tensor, torch.Tensor], meta: AttentionMetadata,
                attn: AttentionBackend) -> tuple[torch.Tensor, torch.Tensor]:
        """One layer with the residual add deferred into the next norm (as vLLM's fused add + RMSNorm).

        Args:
            x: ``[rows, hidden]``, the previous layer's MLP output (the embeddings for the first layer).
            residual: ``[rows, hidden]`` the residual stream before ``x`` is added; ``None`` for the first layer.

        Returns:
            ``(mlp_out, residual)``: the hidden state after the layer is ``mlp_out + residual``.
        """
        # Projections are called through ``forward`` (``nn.Linear``, ``PackedLinear`` or ``QuantLinear``) and
        # norms through their weights: at batch 1 the per-call overhead of ``nn.Module.__call__`` is a visible
        # share of a decode step on CPU.
        n = x.shape[0]  # rows, possibly padded past the step's tokens (see LlamaForCausalLM.forward)
        h, residual = add_rms_norm(x, residual, self.input_layernorm.weight, self.input_layernorm.eps,
                                   self.invariant)
        qkv = self.qkv_proj.forward(h)
        qk, v = qkv.split([self.q_size + self.kv_size, self.kv_size], dim=-1)
        qk = qk.view(n, self.num_heads + self.num_kv_heads, self.head_dim)
        if self.qk_norm is not None:  # Qwen3: each head of q and k normalised, in float32 as HF's RMSNorm
            if native.usable(qk) and not self.invariant:
                qk = native.head_rms_norm(qk, self.qk_norm, self.eps)
            else:
                qk = (rms_norm_torch if self.invariant else _rms_norm)(qk, self.qk_norm, self.eps)
        qk = rope(qk)  # q and k at once
        q, k = qk[:, :self.num_heads], qk[:, self.num_heads:]  # [n, num_heads | num_kv_heads, head_dim]
        v = v.view(n, self.num_kv_heads, self.head_dim)
        t = meta.slot_mapping.shape[0]  # the step's real tokens; padding rows skip attention
        o = attn(q[:t], k[:t], v[:t], kv_cache[0], kv_cache[1], meta.for_window(self.window)).reshape(t, self.q_size)
        if t < n:
            o = F.pad(o, (0, 0, 0, n - t))
        h, residual = add_rms_norm(self.o_proj.forward(o), residual, self.post_attention_layernorm.weight,
                                   self.post_attention_layernorm.eps, self.invariant)
        if self.moe is not None:
            return self.moe.forward(h), residual
        gate_up = self.gate_up_proj.forward(h)
        if native.usable(gate_up):  # the one-call decode step's kernel: the same bits on both paths
            return self.down_proj.forward(native.silu_mul(gate_up)), residual
        gate, up = gate_up.split(self.intermediate_size, dim=-1)
        return self.down_proj.forward(F.silu(gate) * up), residual


class LlamaForCausalLM(nn.Module):
    """The decoder plus LM head.

    Args:
        config: The architecture.
    """

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.config = config
        # Given its weight, the embedding skips its random init: on ``meta`` that init (``normal_``) runs a
        # Python decomposition whose first use imports torch._dynamo, 2.5 s of a one-shot command's start.
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size,
                                         _weight=torch.empty(config.vocab_size, config.hidden_size))
        self.layers = nn.ModuleList(DecoderLayer(config, config.is_moe_layer(i), config.layer_window(i))
                                    for i in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        # The LM head, made by ``load_weights`` (from the embedding when tied).
        self.lm_head: Optional[nn.Module] = None
        # Decode steps in one native call (made by ``load_weights`` where every projection allows it), and
        # steps past the block kernel's rows on the dense copies (:func:`decode_plans.wide_plan`, made once they are).
        self.decode_plan: Optional[native_decode.DecodeLayers] = None
        self._wide_plan: Optional[native_decode.DecodeLayers] = None
        self.batch_invariant = False
        self.requires_grad_(False)
        self.register_buffer("inv_freq", rope_inv_freq(config), persistent=False)
        self._rope_tables: dict[torch.dtype, torch.Tensor] = {}

    def load_weights(self, weights: dict[str, Union[torch.Tensor, BlockQuantized]],
                     dtype: Optional[torch.dtype] = None, quantization: str = "none",
                     batch_invariant: bool = False) -> None:
        """Take HF-named weights, fusing q/k/v and gate/up; the model may have been built on ``meta``.

        A checkpoint that fuses them itself (Phi-3) was split into these names by the loader
        (:func:`goodserve.models.checkpoint.split_fused_projections`).

        Every parameter is replaced (not copied into), so a model built under ``torch.device("meta")``
        allocates nothing before its weights arrive.

        Args:
            weights: HF parameter names (``model.layers.0.self_attn.q_proj.weight``, ...) to tensors, or to
                :class:`BlockQuantized` weights as the GGUF file holds them; with ``config.qk_norm`` also
                ``self_attn.q_norm.weight`` and ``self_attn.k_norm.weight`` (``[head_dim]`` each) per layer; a
                mixture-of-experts layer's router and experts stacked by :func:`goodserve.models.moe.stack_experts`
                (dense in ``dtype``; a GGUF's expert blocks on the block kernel under ``auto``:
                :meth:`goodserve.models.moe.SparseMoeBlock.load`).
            dtype: Dtype of the dense weights and activations; default: the embedding's current dtype.
            quantization: How linear layers run, see :func:`goodserve.models.quant.make_linear`.
            batch_invariant: Every linear layer on :class:`~goodserve.models.invariant.InvariantLinear` (one
                kernel and one reduction order for every step size, a GGUF's blocks dequantized) and norms
                summed in order: a token's hidden states do not depend on its batch. ``quantization`` does
                not apply then.

        Raises:
            ValueError: when a weight is missing or has the wrong shape, on an unknown ``quantization``, or
                ``batch_invariant`` for a mixture of experts or a model with sliding-window layers (not
                implemented).
        """
        dtype = dtype or self.embed_tokens.weight.dtype
        if batch_invariant and self.config.num_experts:
            raise ValueError("batch-invariant mode is not implemented for a mixture of experts "
                             f"({self.config.architecture})")
        if batch_invariant and self.config.sliding_window is not None:
            raise ValueError("batch-invariant mode is not implemented for sliding-window attention "
                             f"({self.config.architecture}, sliding_window={self.config.sliding_window}); "
                             "supported: models with full attention on every layer")

        def take(name: str, shape: tuple[int, ...]) -> Union[torch.Tensor, BlockQuantized]:
            return take_weight(weights, name, shape)

        def dense(name: str, shape: tuple[int, ...]) -> nn.Parameter:
            return nn.Parameter(dense_weight(weights, name, shape, dtype), requires_grad=False)

        def fused(names: list[str], shapes: list[tuple[int, int]]):
            parts = [take(n, s) for n, s in zip(names, shapes)]
            if all(isinstance(p, BlockQuantized) for p in parts) and len({p.qtype for p in parts}) == 1:
                return BlockQuantized.cat(parts)
            if not batch_invariant and quantization == "auto" and all(runs_on_blocks(p, dtype) for p in parts):
                return parts  # blocks of mixed types (Q4_K_M: a Q6_K attn_v beside Q4_K q/k): a layer per part
            return torch.cat([p.dequantize() if isinstance(p, BlockQuantized) else p for p in parts])

        c = self.config
        hidden, inter = c.hidden_size, c.intermediate_size
        self.batch_invariant = batch_invariant

        def linear(weight, bias):
            if isinstance(weight, list):
                biases = [None] * len(weight) if bias is None else bias.split([w.shape[0] for w in weight])
                return PartsLinear([make_linear(w, b, dtype, quantization) for w, b in zip(weight, biases)])
            if batch_invariant:
                return InvariantLinear(weight, bias, dtype)
            return make_linear(weight, bias, dtype, quantization)

        self.embed_tokens.weight = dense("model.embed_tokens.weight", (c.vocab_size, hidden))
        self.norm.weight = dense("model.norm.weight", (hidden,))
        # Tied, the head is a second (prepacked) copy of the embedding where ``dense_linear`` packs it:
        # the lookup needs row-major rows, the GEMM its own layout. Under ``auto`` a head in the file's blocks
        # (SmolLM2's Q8_0 embedding) runs decode steps on the block kernel: half the bytes of bfloat16.
        head_name = "model.embed_tokens.weight" if c.tie_word_embeddings else "lm_head.weight"
        head = take(head_name, (c.vocab_size, hidden))
        if batch_invariant:
            if not isinstance(head, BlockQuantized):
                head = self.embed_tokens.weight if c.tie_word_embeddings else dense(head_name, (c.vocab_size, hidden))
            self.lm_head = linear(head, None)
        elif quantization == "auto" and runs_on_blocks(head, dtype):
            self.lm_head = make_linear(head, None, dtype, quantization)
        else:
            self.lm_head = dense_linear(self.embed_tokens.weight if c.tie_word_embeddings
                                        else dense(head_name, (c.vocab_size, hidden)))
        for i, layer in enumerate(self.layers):
            p = f"model.layers.{i}."
            a = p + "self_attn."
            q_shape, kv_shape = (layer.q_size, hidden), (layer.kv_size, hidden)
            qkv = fused([a + "q_proj.weight", a + "k_proj.weight", a + "v_proj.weight"], [q_shape, kv_shape, kv_shape])
            bias = None
            if c.attention_bias:
                bias = torch.cat([take(a + "q_proj.bias", (layer.q_size,)), take(a + "k_proj.bias", (layer.kv_size,)),
                                  take(a + "v_proj.bias", (layer.kv_size,))])
            layer.qkv_proj = linear(qkv, bias)
            layer.o_proj = linear(take(a + "o_proj.weight", (hidden, layer.q_size)), None)
            if layer.moe is not None:
                layer.moe.load(dense, p, weights, dtype, quantization == "auto")
            else:
                gate_up = fused([p + "mlp.gate_proj.weight", p + "mlp.up_proj.weight"], [(inter, hidden)] * 2)
                layer.gate_up_proj = linear(gate_up, None)
                layer.down_proj = linear(take(p + "mlp.down_proj.weight", (hidden, inter)), None)
            layer.invariant = batch_invariant
            layer.input_layernorm.weight = dense(p + "input_layernorm.weight", (hidden,))
            layer.post_attention_layernorm.weight = dense(p + "post_attention_layernorm.weight", (hidden,))
            if c.qk_norm:
                d = c.head_dim
                q_norm, k_norm = dense(a + "q_norm.weight", (d,)), dense(a + "k_norm.weight", (d,))
                layer.qk_norm = nn.Parameter(torch.cat([q_norm.expand(c.num_attention_heads, d),
                                                        k_norm.expand(c.num_key_value_heads, d)]),
                                             requires_grad=False)
        self.inv_freq = rope_inv_freq(c).to(self.embed_tokens.weight.device)
        self._rope_tables.clear()
        self.decode_plan = decode_plans.decode_plan(self)
        self._wide_plan = None

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                kv_caches: list[tuple[torch.Tensor, torch.Tensor]], meta: AttentionMetadata,
                attn: AttentionBackend) -> torch.Tensor:
        """Run the decoder over a flat batch (on :func:`padded_num_tokens` rows inside).

        Args:
            input_ids: ``[num_tokens]`` int64.
            positions: ``[num_tokens]`` int64 position of each token in its request.
            kv_caches: Per layer ``(k_cache, v_cache)``, each ``[num_blocks, block_size, num_kv_heads, head_dim]``.
            meta: Attention metadata of the step.
            attn: The attention backend.

        Returns:
            ``[num_tokens, hidden_size]`` final hidden states (after the last norm).
        """
        num_tokens = input_ids.shape[0]
        padded = padded_num_tokens(num_tokens)
        if padded > num_tokens:
            input_ids = F.pad(input_ids, (0, padded - num_tokens))
            positions = F.pad(positions, (0, padded - num_tokens))
        x = self.embed_tokens(input_ids)  # [padded, hidden]
        rope = RotaryTable(self.rope_cos_sin(x.dtype), positions)
        residual = None
        for i, (layer, kv_cache) in enumerate(zip(self.layers, kv_caches)):
            x, residual = layer.forward(x, residual, rope, kv_cache, meta.for_layer(i), attn)
        return add_rms_norm(x[:num_tokens], residual[:num_tokens], self.norm.weight, self.norm.eps,
                            self.batch_invariant)[0]

    def can_decode_in_one_call(self, num_tokens: int, meta: AttentionMetadata, attn: AttentionBackend) -> bool:
        """Whether :meth:`decode_in_one_call` takes this step: a plan for its rows (:meth:`one_call_plan`), only
        decodes and short chunks, or any step in batch-invariant mode
        (:func:`~goodserve.models.short_rows.as_decode_rows`), and the native attention kernel the plan attends
        with."""
        plan = self.one_call_plan(num_tokens)
        if plan is None or num_tokens > plan.max_rows or not as_decode_rows(meta, num_tokens):
            return False
        if self.batch_invariant:
            return isinstance(attn, InvariantAttentionBackend) and attn.use_native
        return isinstance(attn, NativeAttentionBackend)

    def one_call_plan(self, rows: int) -> Optional[native_decode.DecodeLayers]:
        """The plan a one-call step of ``rows`` rows runs on: past the block kernel's
        :data:`~goodserve.models.quant.DEFAULT_MAX_ROWS` rows the wide plan on the dense copies once they are
        made and where it applies (:func:`goodserve.models.decode_plans.wide_plan`: the rows' layer-by-layer
        path runs on those copies too), else the load's :attr:`decode_plan`."""
        if rows > DEFAULT_MAX_ROWS and self.decode_plan is not None and not self.batch_invariant:
            if self._wide_plan is None:
                self._wide_plan = decode_plans.wide_plan(self)
            if self._wide_plan is not None:
                return self._wide_plan
        return self.decode_plan

    def decode_in_one_call(self, input_ids: torch.Tensor, positions: torch.Tensor,
                           kv_caches: list[tuple[torch.Tensor, torch.Tensor]], meta: AttentionMetadata,
                           attn: AttentionBackend) -> torch.Tensor:
        """:meth:`forward` for a step of decodes and short chunks (any step in batch-invariant mode) in one native
        call (:func:`goodserve.models.native_decode.decode_layers`), each token one row
        (:func:`~goodserve.models.short_rows.decode_rows`) on :meth:`one_call_plan`'s weights; the same bits as
        the layer-by-layer path on the same kernels where its attention splits each context as this call does
        (one split up to 256 tokens of context); the runner calls it where :meth:`can_decode_in_one_call`.

        Returns:
            ``[num_tokens, hidden_size]`` final hidden states.
        """
        c = self.config
        amx = self.batch_invariant and attn.uses_amx(
            input_ids.new_empty((0, c.num_attention_heads, c.head_dim), dtype=self.norm.weight.dtype),
            c.num_key_value_heads)
        tables, seq_lens, max_len = decode_rows(meta)
        runs = run_starts(meta, c.num_attention_heads // c.num_key_value_heads) if amx and meta.prefills else None
        return native_decode.decode_layers(self.one_call_plan(input_ids.shape[0]), self.embed_tokens(input_ids),
                                           positions, kv_caches, meta.slot_mapping, tables, seq_lens, max_len,
                                           self.rope_cos_sin(self.norm.weight.dtype),
                                           SPLIT_TOKENS if self.batch_invariant else None, amx, runs)

    def rope_cos_sin(self, dtype: torch.dtype) -> torch.Tensor:
        """``[2, max_position_embeddings, head_dim]`` cos and sin of every position, made once per dtype.

        Row ``p`` is ``cos/sin(p * inv_freq)`` repeated over the two halves (rotate-half layout), computed in
        float32 exactly as a per-step computation would be, then cast to ``dtype``.
        """
        table = self._rope_tables.get(dtype)
        if table is None:
            table = self._rope_tables[dtype] = cos_sin_table(self.inv_freq, self.config.max_position_embeddings, dtype)
        return table

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """``[n, hidden_size]`` -> ``[n, vocab_size]`` float32 logits (after :meth:`load_weights`)."""
        return self.lm_head.forward(hidden).float()
