"""What a token costs in the KV cache: the one formula the engine, the planner and the simulator share.

A model's cache is a tuple of **KV-cache groups** (vLLM's hybrid KV-cache manager): layers whose cached
state has the same shape and lifetime. A group is one of

* ``full``: every token of the request, ``2 · L_g · n_kv · row`` bytes per token (a K and a V row per layer
  and KV head; PagedAttention, Kwon et al., SOSP 2023, §3);
* ``sliding``: the same rows, but only the last ``window`` tokens are ever read, so blocks wholly before the
  window can be freed (Mistral 7B, Jiang et al. 2023, §2; Gemma 2/3's local layers);
* ``mla``: one latent row per layer and token, ``kv_lora_rank + qk_rope_head_dim`` elements: K and V are
  both re-projected from it (DeepSeek-V2, arXiv:2405.04434, §2.1), so there is no factor 2 and no head
  count.

A row of ``width`` elements costs ``width · b_dtype`` bytes; an ``int8`` row also carries its own float32
scale (one per token and KV head: the absmax quantisation of that row), :data:`INT8_SCALE_BYTES`.

No torch here: the KV cache manager and the planner run without it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

#: Bytes per element of each KV-cache dtype (``--kv-cache-dtype``; ``auto`` means the model's ``--dtype``).
KV_DTYPE_BYTES: dict[str, int] = {"float32": 4, "bfloat16": 2, "float16": 2, "float8": 1, "int8": 1}
#: Bytes of the float32 scale an int8 row carries.
INT8_SCALE_BYTES = 4
GROUP_KINDS = ("full", "sliding", "mla")


def kv_row_bytes(width: int, kv_dtype: str) -> int:
    """Bytes of one cached row of ``width`` elements in ``kv_dtype``, its scale included for ``int8``.

    Raises:
        ValueError: an unknown dtype.
    """
    try:
        nbytes = KV_DTYPE_BYTES[kv_dtype]
    except KeyError:
        raise ValueError(f"unknown KV-cache dtype {kv_dtype!r}; expected one of {', '.join(KV_DTYPE_BYTES)}") from None
    return width * nbytes + (INT8_SCALE_BYTES if kv_dtype == "int8" else 0)


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


@dataclass(frozen=True)
class KVCacheGroup:
    """Layers whose cache has one shape and lifetime.

    Attributes:
        kind: ``"full"``, ``"sliding"`` or ``"mla"``.
        num_layers: Layers in the group.
        num_kv_heads: KV heads each layer caches (1 for MLA).
        head_dim: Elements of one cached row (MLA: ``kv_lora_rank + qk_rope_head_dim``).
        window: ``sliding`` only: a query at position ``p`` reads positions ``p - window + 1 .. p``.
    """

    kind: str
    num_layers: int
    num_kv_heads: int
    head_dim: int
    window: Optional[int] = None

    def __post_init__(self) -> None:
        if self.kind not in GROUP_KINDS:
            raise ValueError(f"KV-cache group kind must be one of {GROUP_KINDS}, got {self.kind!r}")
        if min(self.num_layers, self.num_kv_heads, self.head_dim) < 1:
            raise ValueError(f"a KV-cache group needs >= 1 layer, head and element, got {self}")
        if (self.kind == "sliding") != (self.window is not None):
            raise ValueError("a window is given exactly for a sliding group")
        if self.window is not None and self.window < 1:
            raise ValueError(f"window must be >= 1 token, got {self.window}")
        if self.kind == "mla" and self.num_kv_heads != 1:
            raise ValueError("an MLA group caches one latent row per token (num_kv_heads=1)")

    def bytes_per_token(self, kv_dtype: str) -> int:
        """Bytes one cached token occupies across the group's layers."""
        rows = 1 if self.kind == "mla" else 2
        return rows * self.num_layers * self.num_kv_heads * kv_row_bytes(self.head_dim, kv_dtype)

    def blocks_kept(self, num_tokens: int, block_size: int) -> int:
        """Blocks the group must hold for a request of ``num_tokens`` tokens whose next query comes at
        position ``num_tokens`` - 1 (the last token is the query): every block for ``full`` and ``mla``;
        for ``sliding`` only the blocks overlapping the window ``[num_tokens - window, num_tokens)``."""
        if num_tokens <= 0:
            return 0
        if self.kind != "sliding":
            return _cdiv(num_tokens, block_size)
        first = max(0, num_tokens - self.window) // block_size
        return (num_tokens - 1) // block_size - first + 1


@dataclass(frozen=True)
class KVCacheSpec:
    """A model's whole KV cache: its groups and the dtype of every cached element.

    Attributes:
        kv_dtype: A key of :data:`KV_DTYPE_BYTES`.
        groups: The groups; their layers together are all the model's layers.
    """

    kv_dtype: str
    groups: tuple[KVCacheGroup, ...]

    def __post_init__(self) -> None:
        kv_row_bytes(1, self.kv_dtype)  # validates the dtype
        if not self.groups:
            raise ValueError("a KV-cache spec needs at least one group")

    def bytes_per_token(self) -> int:
        """Bytes one token occupies in every group (a token inside every window): what a block costs per slot."""
        return sum(g.bytes_per_token(self.kv_dtype) for g in self.groups)

    def page_bytes(self, block_size: int) -> int:
        """Bytes of one pool block: ``block_size`` tokens of one group. An engine's groups all cost the same per
        token (:mod:`goodserve.kv_cache.layout` pads them to one size), so any group gives it.

        Raises:
            ValueError: if the groups differ in bytes per token (a planner's spec, not an engine's pool).
        """
        sizes = {g.bytes_per_token(self.kv_dtype) for g in self.groups}
        if len(sizes) != 1:
            raise ValueError(f"groups of unequal bytes per token share no block size: {self.describe()}")
        return block_size * sizes.pop()

    def bytes_for_request(self, num_tokens: int, block_size: int) -> int:
        """Bytes a request of ``num_tokens`` tokens holds at most, in whole blocks, windows applied."""
        return sum(g.blocks_kept(num_tokens, block_size) * block_size * g.bytes_per_token(self.kv_dtype)
                   for g in self.groups)

    def describe(self) -> str:
        """One line for logs: dtype and groups, e.g. ``int8: full x30 (3 x 64)``; equal groups in a row are
        counted, e.g. ``bfloat16: full x4 (1 x 256), 6 groups of sliding x4 (1 x 256, window 512)``."""
        parts: list[list] = []  # [description, count]
        for g in self.groups:
            text = f"{g.kind} x{g.num_layers} ({g.num_kv_heads} x {g.head_dim}" + (f", window {g.window})"
                                                                                 if g.window else ")")
            if parts and parts[-1][0] == text:
                parts[-1][1] += 1
            else:
                parts.append([text, 1])
        return f"{self.kv_dtype}: " + ", ".join(t if n == 1 else f"{n} groups of {t}" for t, n in parts)


def dense_spec(num_layers: int, num_kv_heads: int, head_dim: int, kv_dtype: str) -> KVCacheSpec:
    """The spec of a model whose every layer caches full K and V (Llama, Qwen, Phi-3, Mixtral)."""
    return KVCacheSpec(kv_dtype, (KVCacheGroup("full", num_layers, num_kv_heads, head_dim),))


def mla_spec(num_layers: int, kv_lora_rank: int, qk_rope_head_dim: int, kv_dtype: str) -> KVCacheSpec:
    """The spec of an MLA model: one latent-plus-RoPE-key row per layer and token (DeepSeek-V2 §2.1)."""
    return KVCacheSpec(kv_dtype, (KVCacheGroup("mla", num_layers, 1, kv_lora_rank + qk_rope_head_dim),))
