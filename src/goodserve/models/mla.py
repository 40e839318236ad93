"""Multi-head latent attention (MLA) over a paged latent KV cache (DeepSeek-V2, arXiv:2405.04434, §2.1).

MLA caches, per layer and token, one row of ``kv_lora_rank + qk_rope_head_dim`` elements: the compressed
latent ``c_KV`` (``kv_a_proj_with_mqa``'s first ``kv_lora_rank`` outputs, after ``kv_a_layernorm``; §2.1.2,
eq. 9) followed by the decoupled key ``k^R`` that carries RoPE and is shared by every head (§2.1.3, eq. 15).
One layer's cache is ``[num_blocks, block_size, 1, kv_lora_rank + qk_rope_head_dim]``, paged like the K/V
cache of :mod:`goodserve.models.attention` (a token at position ``p`` lives in slot
``block_table[p // block_size] * block_size + p % block_size``), and is written at ``slot_mapping``.

Per head ``h`` the keys and values are ``k_h = [W_UK,h · c_KV ; k^R]`` and ``v_h = W_UV,h · c_KV``, where
``kv_b_proj``'s weight stacks ``W_UK,h`` (``[qk_nope_head_dim, kv_lora_rank]``) over ``W_UV,h`` per head.
Two exact ways to attend, used as the paper suggests (§2.1.2, "absorbed" projections):

* **decodes**, one query per request over a long context: ``W_UK`` is absorbed into the query,
  ``q_lat,h = W_UK,h^T · q_nope,h`` (``kv_lora_rank`` wide), so the score of a cached row is
  ``[q_lat,h ; q_pe,h] · [c_KV ; k^R]``: one dot product with the cached row itself, no per-head key is ever
  built. The output is ``W_UV,h · (softmax · c_KV)``: ``W_UV`` is applied once to the weighted latent.
* **prefill chunks**, many queries over their context: K and V are expanded from the latent rows once
  (``kv_b_proj``), then attended as ordinary multi-head attention, causally (cheaper than the absorbed form
  when the chunk is long: every query would otherwise pay ``kv_lora_rank``-wide dot products).

Both are the same sums as transformers' ``DeepseekV2Attention`` (which expands K/V for every step), up to
float rounding. The softmax scale is ``(qk_nope_head_dim + qk_rope_head_dim) ** -0.5`` (with YaRN's temperature
when the config scales RoPE by YaRN, :func:`mla_softmax_scale`). RoPE is applied to ``q_pe`` and ``k^R`` in the
interleaved (complex-pair) layout transformers' DeepSeek-V2 uses. No native
kernel here: the portable PyTorch path runs on any device.

The latent cache may be smaller than ``--dtype`` (``--kv-cache-dtype``): ``int8`` rows carry one float32 absmax
scale for the whole ``kv_lora_rank + qk_rope_head_dim`` row (:mod:`goodserve.models.kv_quant`), ``bfloat16``
under float32 is rounded on write; the rows a step gathers are widened to the activations' dtype before use.
"""

from __future__ import annotations

import math
from typing import Optional

import torch
import torch.nn.functional as F

from goodserve.config import EngineConfig, ModelConfig
from goodserve.models.attention import AttentionMetadata, gather_rows
from goodserve.models.kv_quant import cache_shape, read_kv, write_kv

#: Epsilon of ``kv_a_layernorm`` and ``q_a_layernorm`` (transformers' ``DeepseekV2RMSNorm`` default: the
#: config's ``rms_norm_eps`` applies to the residual-stream norms only).
MLA_NORM_EPS = 1e-6


def yarn_mscale(factor: float, mscale: float = 1.0) -> float:
    """YaRN's attention temperature ``0.1 · mscale · ln(factor) + 1`` (1 for ``factor <= 1``; Peng et al. 2023, §3.4)."""
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


def _yarn_inv_freq(dim: int, base: float, scaling: dict) -> torch.Tensor:
    """YaRN's "NTK-by-parts" inverse frequencies ``[dim // 2]`` (Peng et al. 2023, §3.2), as transformers computes
    them: dimensions rotating more than ``beta_fast`` times over the original context keep their frequency, those
    rotating fewer than ``beta_slow`` times are divided by ``factor``, a linear ramp between."""
    factor, orig = float(scaling["factor"]), float(scaling["original_max_position_embeddings"])
    beta_fast, beta_slow = scaling.get("beta_fast") or 32, scaling.get("beta_slow") or 1

    def correction_dim(rotations: float) -> float:
        return (dim * math.log(orig / (rotations * 2 * math.pi))) / (2 * math.log(base))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if scaling.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001
    pos_freqs = base ** (torch.arange(0, dim, 2, device="cpu").float() / dim)
    ramp = torch.clamp((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low), 0, 1)
    extrapolation = 1 - ramp
    return (1.0 / (factor * pos_freqs)) * (1 - extrapolation) + (1.0 / pos_freqs) * extrapolation


def mla_rope_cis(config: ModelConfig, device: Optional[torch.device] = None) -> torch.Tensor:
    """``[max_position_embeddings, qk_rope_head_dim // 2]`` complex64 ``a · exp(i · p · inv_freq)`` of every position.

    Default RoPE (Su et al. 2021): ``inv_freq = 1 / theta ** (2j / qk_rope_head_dim)``, ``a = 1``. YaRN (the
    scaling DeepSeek-V2 ships with, §3.1.1): :func:`_yarn_inv_freq`, and ``a`` the config's
    ``attention_factor``, else ``yarn_mscale(factor, mscale) / yarn_mscale(factor, mscale_all_dim)`` with both
    given, else ``yarn_mscale(factor)``. Computed in float32 as transformers does.

    Raises:
        ValueError: for another rope scaling type (:mod:`goodserve.models.config_support` refuses it first).
    """
    dim = config.qk_rope_head_dim
    scaling = config.rope_scaling or {}
    kind = scaling.get("rope_type", "default")
    factor = 1.0
    if kind == "default":
        inv_freq = 1.0 / (config.rope_theta ** (torch.arange(0, dim, 2, device="cpu").float() / dim))
    elif kind == "yarn":
        inv_freq = _yarn_inv_freq(dim, config.rope_theta, scaling)
        f, mscale, mscale_all = float(scaling["factor"]), scaling.get("mscale"), scaling.get("mscale_all_dim")
        factor = scaling.get("attention_factor") or (
            yarn_mscale(f, mscale) / yarn_mscale(f, mscale_all) if mscale and mscale_all else yarn_mscale(f))
    else:
        raise ValueError(f"rope_type {kind!r} is not implemented for multi-head latent attention (default, yarn)")
    freqs = torch.arange(config.max_position_embeddings, device="cpu").float()[:, None] * inv_freq[None, :]
    cis = torch.polar(torch.ones_like(freqs), freqs) * float(factor)
    return cis if device is None else cis.to(device)


def mla_softmax_scale(config: ModelConfig) -> float:
    """``(qk_nope_head_dim + qk_rope_head_dim) ** -0.5``, times ``yarn_mscale(factor, mscale_all_dim) ** 2`` under
    YaRN with ``mscale_all_dim`` (DeepSeek-V2's long-context temperature, as transformers applies it)."""
    scale = (config.qk_nope_head_dim + config.qk_rope_head_dim) ** -0.5
    scaling = config.rope_scaling or {}
    if scaling.get("rope_type", "default") != "default" and scaling.get("mscale_all_dim"):
        scale *= yarn_mscale(float(scaling["factor"]), scaling["mscale_all_dim"]) ** 2
    return scale


def apply_rope_interleaved(x: torch.Tensor, cis: torch.Tensor) -> torch.Tensor:
    """Rotate each pair ``(x[2j], x[2j+1])`` by the row's angle ``j``, in float32, cast back.

    Args:
        x: ``[num_tokens, heads, qk_rope_head_dim]``.
        cis: ``[num_tokens, qk_rope_head_dim // 2]`` complex64 (rows of :func:`mla_rope_cis` at the tokens'
            positions).

    Returns:
        ``x``'s shape and dtype.
    """
    pairs = torch.view_as_complex(x.float().reshape(*x.shape[:-1], -1, 2))
    return torch.view_as_real(pairs * cis[:, None, :]).flatten(-2).type_as(x)


def check_mla_engine(config: EngineConfig) -> None:
    """Refuse engine settings an MLA model cannot run with, before any weight is placed.

    Raises:
        ValueError: for ``attention_backend="native"`` (the native paged kernel reads per-head K/V, not the
            latent) or ``batch_invariant`` (no batch-invariant MLA path), naming the setting.
    """
    name = config.model.architecture
    if config.attention_backend == "native":
        raise ValueError(f"attention_backend 'native' is not implemented for multi-head latent attention ({name}): "
                         "use 'auto' or 'torch' (both run the portable MLA attention)")
    if config.batch_invariant:
        raise ValueError(f"batch-invariant mode is not implemented for multi-head latent attention ({name})")


def mla_kv_caches(config: ModelConfig, num_blocks: int, block_size: int, kv_dtype: str, dtype: torch.dtype,
                  device: torch.device, alloc) -> list[tuple[torch.Tensor, None]]:
    """Per layer ``(latent_cache, None)``, ``latent_cache`` ``[num_blocks, block_size, 1, kv_lora_rank +
    qk_rope_head_dim]`` (``+ 4`` scale bytes a row for ``kv_dtype`` ``int8``) of torch ``dtype`` from
    ``alloc(shape, dtype, device)``: ``num_blocks * block_size * spec.bytes_per_token()`` bytes in all (the
    ``mla`` group of :mod:`goodserve.kv_cache.spec`)."""
    shape = cache_shape(num_blocks, block_size, 1, config.kv_lora_rank + config.qk_rope_head_dim, kv_dtype)
    return [(alloc(shape, dtype, device), None) for _ in range(config.num_hidden_layers)]


class MLAAttentionBackend:
    """Attention of an MLA layer over its latent cache: decodes absorbed, prefill chunks expanded.

    It reads the metadata's decode groups (:class:`~goodserve.models.attention.DecodeGroup`) and prefill
    chunks as the portable backend does; there is no native MLA kernel, so a model with this backend never
    takes the native one-call decode step.
    """

    #: The runner builds the metadata with decode groups (not per-row tables).
    uses_decode_groups = True
    uses_row_tables = False

    def __call__(self, q_nope: torch.Tensor, q_pe: torch.Tensor, latent: torch.Tensor, k_pe: torch.Tensor,
                 cache: torch.Tensor, kv_b: torch.Tensor, scale: float, meta: AttentionMetadata) -> torch.Tensor:
        """Write the step's latent rows into ``cache`` and attend every query.

        Args:
            q_nope: ``[num_tokens, num_heads, qk_nope_head_dim]``.
            q_pe: ``[num_tokens, num_heads, qk_rope_head_dim]``, RoPE applied.
            latent: ``[num_tokens, kv_lora_rank]`` normalised ``c_KV``.
            k_pe: ``[num_tokens, qk_rope_head_dim]`` the shared RoPE key, RoPE applied.
            cache: ``[num_blocks, block_size, 1, kv_lora_rank + qk_rope_head_dim]``, written in place.
            kv_b: ``[num_heads, qk_nope_head_dim + v_head_dim, kv_lora_rank]``: ``kv_b_proj``'s weight per head,
                ``W_UK`` rows then ``W_UV`` rows.
            scale: Softmax scale (``(qk_nope_head_dim + qk_rope_head_dim) ** -0.5``).
            meta: The step's metadata (decodes first, then prefill chunks).

        Returns:
            ``[num_tokens, num_heads, v_head_dim]``, before ``o_proj``.

        Raises:
            RuntimeError: if ``meta`` has decodes but no decode groups (built for another backend).
        """
        if meta.num_decodes and not meta.decode_groups:
            raise RuntimeError("MLA attention reads decode groups; the metadata was built without them")
        rank = latent.shape[-1]
        nope = q_nope.shape[-1]
        rows = torch.cat([latent, k_pe], dim=-1)  # [num_tokens, kv_lora_rank + qk_rope_head_dim]
        write_kv(cache, meta.slot_mapping, rows[:, None])  # one latent "head" a token
        num_tokens, num_heads = q_nope.shape[:2]
        out = q_nope.new_empty(num_tokens, num_heads, kv_b.shape[1] - nope)
        w_uk, w_uv = kv_b[:, :nope], kv_b[:, nope:]  # [num_heads, nope | v_head_dim, kv_lora_rank]
        for g in meta.decode_groups:
            ctx = read_kv(gather_rows(cache, g.block_tables)[..., 0, :], rows.dtype)  # [n, ctx, rank + rope]
            if g.mask is None:
                ctx = ctx[:, :g.seq_len]
            q_lat = torch.einsum("nhd,hdr->nhr", q_nope[g.start:g.end], w_uk)  # [n, num_heads, kv_lora_rank]
            query = torch.cat([q_lat, q_pe[g.start:g.end]], dim=-1)[:, None]  # [n, 1, num_heads, width]
            o_lat = F.scaled_dot_product_attention(query, ctx[:, None], ctx[:, None, :, :rank], attn_mask=g.mask,
                                                   scale=scale)[:, 0]  # [n, num_heads, kv_lora_rank]
            out[g.start:g.end] = torch.einsum("nhr,hvr->nhv", o_lat, w_uv)
        for chunk in meta.prefills:
            if chunk.mask is None:  # no cached context: the chunk's own rows
                ctx = rows[chunk.start:chunk.end]
            else:
                ctx = read_kv(gather_rows(cache, chunk.block_table)[:chunk.mask.shape[1], 0], rows.dtype)
            kv = F.linear(ctx[:, :rank], kv_b.reshape(-1, rank)).view(ctx.shape[0], num_heads, -1)
            k = torch.cat([kv[..., :nope], ctx[:, None, rank:].expand(-1, num_heads, -1)], dim=-1)
            q = torch.cat([q_nope[chunk.start:chunk.end], q_pe[chunk.start:chunk.end]], dim=-1)
            o = F.scaled_dot_product_attention(q.transpose(0, 1)[None], k.transpose(0, 1)[None],
                                               kv[..., nope:].transpose(0, 1)[None], attn_mask=chunk.mask,
                                               is_causal=chunk.mask is None, scale=scale)
            out[chunk.start:chunk.end] = o[0].transpose(0, 1)
        return out
