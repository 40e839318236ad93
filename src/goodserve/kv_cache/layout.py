"""How a model's layers share one KV pool: KV-cache groups, each with its own block tables.

A model whose layers all cache the same way (every layer full attention, or every layer within one window) is
one group: a block holds ``block_size`` tokens of every layer. A model that mixes them (Gemma 2/3's local and
global layers, Qwen2's ``max_window_layers``) would waste memory that way, since its local layers need only
the last ``W`` tokens. vLLM's hybrid KV-cache manager (its ``kv_cache_utils`` and ``KVCacheCoordinator``; this is
our own code) cuts such a model's layers into **groups of equal size** ``S`` (layers of one attention kind
each): a pool block then holds ``block_size`` tokens of the ``S`` layers of *one* group, every group keeps its own
block table per request drawn from the one pool, and a sliding group frees the blocks before its window as the
request advances while a full group keeps them all.

Memory: the runner keeps ``S`` cache tensors ``[num_blocks, block_size, num_kv_heads, head_dim]`` (K and V each);
layer ``l`` of group ``g`` at slot ``s`` reads and writes tensor ``s`` at the blocks of group ``g``'s table. A
group with fewer than ``S`` layers (the last one of a kind) leaves its blocks' other slots unused: the padding
:func:`plan_layout` keeps small.

A request's tables travel as one flat list, logical block ``i`` of group ``g`` at index ``i * num_groups + g``
(all groups' tables grow in lockstep), so code that passes block ids around (scheduler-to-runner diffs,
speculation's trim) needs no change; :meth:`KVCacheLayout.group_table` reads one group's table back.

No torch here.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional, Sequence

from goodserve.kv_cache.sliding import SlidingWindow
from goodserve.kv_cache.spec import KVCacheGroup, KVCacheSpec

#: The most padding (unused layer slots over all layers) :func:`plan_layout` accepts for a larger group size.
MAX_PADDING = 0.1


@dataclass(frozen=True)
class KVCacheLayout:
    """The groups of a model's KV cache and where each layer's cache lives.

    Attributes:
        group_windows: Per group, the window (tokens) its layers attend within, or ``None`` for full attention.
        layer_slots: Per layer, ``(group, slot)``: it uses the blocks of ``group``'s table in cache tensor ``slot``.
        num_slots: ``S``, the cache tensors (layers a block holds); every group has at most ``S`` layers.

    Raises:
        ValueError: a layer whose group or slot is out of range, two layers on one group's slot, or a window < 1.
    """

    group_windows: tuple[Optional[int], ...]
    layer_slots: tuple[tuple[int, int], ...]
    num_slots: int

    def __post_init__(self) -> None:
        if not self.group_windows or self.num_slots < 1:
            raise ValueError("a KV-cache layout needs at least one group and one slot")
        if any(w is not None and w < 1 for w in self.group_windows):
            raise ValueError(f"windows must be >= 1 token, got {self.group_windows}")
        if any(not (0 <= g < self.num_groups and 0 <= s < self.num_slots) for g, s in self.layer_slots):
            raise ValueError(f"layer slots {self.layer_slots} out of range for {self.num_groups} groups x "
                             f"{self.num_slots} slots")
        if len(set(self.layer_slots)) != len(self.layer_slots):
            raise ValueError(f"two layers share one group's slot: {self.layer_slots}")

    @property
    def num_groups(self) -> int:
        """``G``, the groups (block tables per request)."""
        return len(self.group_windows)

    def layer_window(self, layer: int) -> Optional[int]:
        """The window of layer ``layer``'s group (``None``: full attention)."""
        return self.group_windows[self.layer_slots[layer][0]]

    def group_table(self, flat: list[int], group: int) -> list[int]:
        """Group ``group``'s block table out of a request's flat table (entry ``i * num_groups + group``; the flat
        list itself with one group)."""
        return list(flat[group::self.num_groups]) if self.num_groups > 1 else flat

    def spec(self, kv_dtype: str, num_kv_heads: int, head_dim: int) -> KVCacheSpec:
        """The layout's :class:`KVCacheSpec`: one group of ``num_slots`` layers (padding included: the memory a
        block takes) per KV-cache group, so :meth:`KVCacheSpec.page_bytes` is what one pool block costs."""
        return KVCacheSpec(kv_dtype, tuple(
            KVCacheGroup("full" if w is None else "sliding", self.num_slots, num_kv_heads, head_dim, w)
            for w in self.group_windows))


def max_blocks_needed(group_windows: Sequence[Optional[int]], block_size: int, num_tokens: int,
                      max_chunk: int) -> int:
    """The most blocks a request of ``num_tokens`` tokens holds at once when each step computes at most ``max_chunk``
    of its tokens: per group all its blocks, or for a sliding group those its window and one chunk span
    (:meth:`SlidingWindow.max_blocks`)."""
    return sum(-(-num_tokens // block_size) if w is None
               else SlidingWindow(w, block_size).max_blocks(num_tokens, max_chunk) for w in group_windows)


def longest_request(group_windows: Sequence[Optional[int]], block_size: int, num_blocks: int, max_len: int,
                    max_chunk: Optional[int]) -> int:
    """The most tokens (up to ``max_len``) a request may reach and still fit a pool of ``num_blocks`` blocks alone.

    Args:
        group_windows: Per group its window or ``None``.
        block_size: Tokens per block.
        num_blocks: Blocks in the pool.
        max_len: The longest length asked for (tokens).
        max_chunk: Most tokens of a request computed in one step; ``None``: a prompt is computed whole.
    """
    def fits(n: int) -> bool:
        return max_blocks_needed(group_windows, block_size, n, min(max_chunk or n, n)) <= num_blocks

    lo, hi = 0, max_len  # blocks needed grow with the length: the longest that fits, by bisection
    while lo < hi:
        mid = (lo + hi + 1) // 2
        lo, hi = (mid, hi) if fits(mid) else (lo, mid - 1)
    return lo


def uniform_layout(num_layers: int, window: Optional[int] = None) -> KVCacheLayout:
    """One group of every layer (layer ``l`` at slot ``l``), attending within ``window`` tokens or fully."""
    return KVCacheLayout((window,), tuple((0, i) for i in range(num_layers)), num_layers)


def plan_layout(layer_windows: Sequence[Optional[int]], max_padding: float = MAX_PADDING) -> KVCacheLayout:
    """Cut layers into groups of one attention kind (one window, or full) and equal size.

    The group size ``S`` is the largest at most the smallest kind's layer count whose padding (slots of a kind's
    last, partial group left empty) is at most ``max_padding`` of the layers; the greatest common divisor of the
    kinds' counts always qualifies (no padding), so a larger ``S`` trades a little memory for fewer block tables.
    Groups are ordered full attention first, then by window; layers fill a kind's groups in order.

    Args:
        layer_windows: Per layer, its window (tokens) or ``None``.

    Returns:
        The layout; :func:`uniform_layout` when every layer is of one kind.

    Raises:
        ValueError: if there are no layers.
    """
    if not layer_windows:
        raise ValueError("a model needs at least one layer")
    kinds: dict[Optional[int], list[int]] = {}
    for layer, window in enumerate(layer_windows):
        kinds.setdefault(window, []).append(layer)
    if len(kinds) == 1:
        return uniform_layout(len(layer_windows), layer_windows[0])
    counts = [len(v) for v in kinds.values()]
    gcd = math.gcd(*counts)

    def padding(size: int) -> int:
        return sum(-(-n // size) * size - n for n in counts)

    size = next(s for s in range(min(counts), 0, -1)
                if s == gcd or padding(s) <= max_padding * len(layer_windows))
    order = sorted(kinds, key=lambda w: (w is not None, w or 0))
    windows: list[Optional[int]] = []
    slots: dict[int, tuple[int, int]] = {}
    for window in order:
        layers = kinds[window]
        for start in range(0, len(layers), size):
            for slot, layer in enumerate(layers[start:start + size]):
                slots[layer] = (len(windows), slot)
            windows.append(window)
    return KVCacheLayout(tuple(windows), tuple(slots[i] for i in range(len(layer_windows))), size)
