"""The sparse mixture-of-experts MLP of Mixtral and Qwen3-MoE, experts computed grouped by expert.

A router (one ``[num_experts, hidden]`` linear layer) scores every token; each token goes to its top-k
experts (Shazeer et al. 2017, "Outrageously Large Neural Networks", §2.1 top-k gating; Mixtral: Jiang et al.
2024, §2.1), each a SwiGLU MLP (Shazeer 2020), and the layer's output is the experts' outputs weighted by the
routing probabilities. As in transformers, the probabilities are a float32 softmax over all experts, then
the top k, renormalised to sum to 1 when the family says (Mixtral always, which equals a softmax over the k
top logits; Qwen3-MoE per ``norm_topk_prob``).

The experts run grouped by expert, not per token: the ``num_tokens * k`` (token, expert) assignments are
sorted by expert, each expert with tokens runs one gate/up and one down matmul over all its rows, and the
weighted rows go back to their (token, slot) place; each token's k slots are then summed along the slot
axis, as transformers' default ``grouped_mm`` experts do (a reshape and sum, no atomic ``index_add_``), so
the order of a token's sum does not depend on which other tokens share the step (the matmuls' rounding may:
batch-invariant mode is refused for MoE models).

Checkpoints hold one tensor per expert (``block_sparse_moe.experts.N.w1/w3/w2`` in Mixtral,
``mlp.experts.N.gate_proj/up_proj/down_proj`` in Qwen3-MoE, as transformers 5 saves them too);
:func:`stack_experts` stacks them at load into ``[num_experts, ...]`` tensors under :data:`GATE_UP` /
:data:`DOWN`, and the router under :data:`ROUTER`. llama.cpp's ``qwen3moe`` GGUFs stack them already
(``ffn_gate_exps`` / ``ffn_up_exps`` / ``ffn_down_exps``, router ``ffn_gate_inp``): :func:`join_gguf_experts`.
Experts run dense in the model's dtype, except a ``qwen3moe`` GGUF's quantized experts under ``--quantization
auto`` in bfloat16, which stay as the file's blocks on the native block kernel
(:mod:`goodserve.models.moe_blocks`); where that kernel is not built they are dequantized at load.
"""

from __future__ import annotations

import logging
from typing import Callable, Optional, Union

import torch
import torch.nn.functional as F
from torch import nn

from goodserve.config import ModelConfig
from goodserve.models.linear import dense_linear
from goodserve.models.moe_blocks import BlockExperts, StackedBlocks, runs_on_blocks
from goodserve.models.native_decode import MoeOperands

logger = logging.getLogger(__name__)

#: A step's experts over their rows: ``run(rows, counts)``, ``rows`` ``[n, hidden]`` sorted by expert with
#: ``counts[e]`` rows for expert ``e`` -> ``[n, hidden]``, each row through its expert's SwiGLU.
RunSorted = Callable[[torch.Tensor, list], torch.Tensor]

#: Per family: the layer's MLP module name, then the expert's gate, up and down projection names.
HF_EXPERT_NAMES = {"mixtral": ("block_sparse_moe", "w1", "w3", "w2"),
                   "qwen3_moe": ("mlp", "gate_proj", "up_proj", "down_proj"),
                   "deepseek_v2": ("mlp", "gate_proj", "up_proj", "down_proj")}
#: Families whose routing weights stay float32 when they scale the expert outputs (transformers' Mixtral);
#: the others cast them to the activations' dtype first (Qwen3-MoE).
FLOAT32_WEIGHTING = ("mixtral",)
#: The names :func:`stack_experts` leaves in a layer (after ``model.layers.{i}.``).
ROUTER, GATE_UP, DOWN = "moe.router.weight", "moe.experts.gate_up_proj", "moe.experts.down_proj"


def hf_layer_names(config: ModelConfig, layer: int) -> list[str]:
    """The checkpoint tensors of MoE layer ``layer`` (full HF names: the router, then each expert's three)."""
    module, gate, up, down = HF_EXPERT_NAMES[config.architecture]
    p = f"model.layers.{layer}.{module}."
    return [p + "gate.weight"] + [f"{p}experts.{e}.{w}.weight" for e in range(config.num_experts)
                                  for w in (gate, up, down)]


def stack_experts(weights: dict[str, torch.Tensor], config: ModelConfig) -> None:
    """Replace, in place, each MoE layer's per-expert tensors by ``[E, 2 * I, hidden]`` gate/up (rows gate then
    up, per expert) and ``[E, hidden, I]`` down tensors, and rename its router to :data:`ROUTER`.

    Raises:
        ValueError: naming a missing tensor.
    """
    for i in range(config.num_hidden_layers):
        if not config.is_moe_layer(i):
            continue
        names = hf_layer_names(config, i)
        missing = [n for n in names if n not in weights]
        if missing:
            raise ValueError(f"weight {missing[0]!r} missing from the checkpoint")
        p = f"model.layers.{i}."
        weights[p + ROUTER] = weights.pop(names[0])
        per_expert = [weights.pop(n) for n in names[1:]]
        gate, up, down = per_expert[0::3], per_expert[1::3], per_expert[2::3]
        weights[p + GATE_UP] = torch.stack([torch.cat([g, u]) for g, u in zip(gate, up)])
        weights[p + DOWN] = torch.stack(down)


#: llama.cpp's MoE tensors (after ``blk.N.``) -> the names the GGUF loader gives them (after ``model.layers.N.``,
#: ``.weight`` appended); :func:`join_gguf_experts` then joins gate and up.
GGUF_EXPERT_NAMES = {"ffn_gate_inp": "moe.router", "ffn_gate_exps": "moe.experts.gate_exps",
                     "ffn_up_exps": "moe.experts.up_exps", "ffn_down_exps": "moe.experts.down_exps"}


def join_gguf_experts(weights: dict[str, Union[torch.Tensor, StackedBlocks]], config: ModelConfig) -> None:
    """Replace, in place, each MoE layer's GGUF expert tensors (``[E, I, hidden]`` gate and up, ``[E, hidden,
    I]`` down, as llama.cpp stacks them) by :data:`GATE_UP` (gate rows then up rows per expert) and
    :data:`DOWN`. Experts kept as blocks (:class:`~goodserve.models.moe_blocks.StackedBlocks`) stay blocks:
    gate and up of one type fused per expert, of two types a ``[gate, up]`` list; beside a dense part, a
    part in blocks is dequantized to the dense part's dtype.

    Raises:
        ValueError: naming a missing tensor.
    """
    for i in range(config.num_hidden_layers):
        if not config.is_moe_layer(i):
            continue
        p = f"model.layers.{i}."
        names = [f"{p}moe.experts.{part}.weight" for part in ("gate_exps", "up_exps", "down_exps")]
        missing = [n for n in names if n not in weights]
        if missing:
            raise ValueError(f"weight {missing[0]!r} missing from the checkpoint")
        gate, up, down = (weights.pop(n) for n in names)
        if isinstance(gate, StackedBlocks) and isinstance(up, StackedBlocks):
            weights[p + GATE_UP] = StackedBlocks.cat_rows([gate, up]) if gate.qtype == up.qtype else [gate, up]
        else:
            dtype = (up if isinstance(gate, StackedBlocks) else gate).dtype
            weights[p + GATE_UP] = torch.cat([w.dequantize(dtype) if isinstance(w, StackedBlocks) else w
                                              for w in (gate, up)], dim=1)
        weights[p + DOWN] = down


def route(logits: torch.Tensor, top_k: int, renormalise: bool, scaling: float = 1.0,
          groups: tuple[int, int] = (1, 1)) -> tuple[torch.Tensor, torch.Tensor]:
    """Top-k routing from router logits ``[num_tokens, num_experts]``.

    With ``groups = (n_group, topk_group)`` other than ``(1, 1)`` (DeepSeek-V2's ``group_limited_greedy``,
    arXiv:2405.04434 §2.2.2), the experts are cut into ``n_group`` equal groups and a token picks its top k
    only among the ``topk_group`` groups whose best probability is highest.

    Returns:
        ``(weights, experts)``, each ``[num_tokens, top_k]``: float32 softmax probabilities of the chosen
        experts (renormalised over the k when ``renormalise``), times ``scaling``, and their int64 ids, most
        probable first.
    """
    probs = torch.softmax(logits.float(), dim=-1)
    n_group, topk_group = groups
    if n_group > 1:
        by_group = probs.view(probs.shape[0], n_group, -1)  # [num_tokens, n_group, experts per group]
        chosen = by_group.amax(dim=-1).topk(topk_group, dim=-1).indices
        keep = torch.zeros_like(by_group[..., 0], dtype=torch.bool).scatter_(1, chosen, True)
        probs = by_group.masked_fill(~keep[..., None], 0.0).view_as(probs)
    weights, experts = torch.topk(probs, top_k, dim=-1)
    if renormalise:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    if scaling != 1.0:
        weights = weights * scaling
    return weights, experts


def grouped_experts(x: torch.Tensor, weights: torch.Tensor, experts: torch.Tensor, gate_up: torch.Tensor,
                    down: torch.Tensor, weight_dtype: torch.dtype) -> torch.Tensor:
    """``sum_j weights[t, j] * SwiGLU_{experts[t, j]}(x[t])`` for every token ``t``, grouped by expert.

    Args:
        x: ``[num_tokens, hidden]`` activations.
        weights: ``[num_tokens, k]`` routing weights.
        experts: ``[num_tokens, k]`` int64 expert ids.
        gate_up: ``[num_experts, 2 * I, hidden]``, each expert's gate rows then up rows.
        down: ``[num_experts, hidden, I]``.
        weight_dtype: Dtype the expert outputs are scaled in (then cast back to ``x``'s dtype).

    Returns:
        ``[num_tokens, hidden]``; each token's k terms summed in its slot order (most probable first), in
        ``weight_dtype``.
    """
    inter = down.shape[-1]

    def expert_mlp(e: int, rows: torch.Tensor) -> torch.Tensor:
        gate, up = F.linear(rows, gate_up[e]).split(inter, dim=-1)
        return F.linear(F.silu(gate) * up, down[e])

    return grouped_by_expert(x, weights, experts, gate_up.shape[0], per_expert(expert_mlp), weight_dtype)


def per_expert(expert_mlp: Callable[[int, torch.Tensor], torch.Tensor]) -> RunSorted:
    """A :data:`RunSorted` calling ``expert_mlp(e, rows)`` (``[count, hidden]`` -> ``[count, hidden]``) once per
    expert that has rows, in expert order."""
    def run(rows: torch.Tensor, counts: list[int]) -> torch.Tensor:
        out = torch.empty_like(rows)
        start = 0
        for e, count in enumerate(counts):
            if count:
                out[start:start + count] = expert_mlp(e, rows[start:start + count])
                start += count
        return out
    return run


def grouped_by_expert(x: torch.Tensor, weights: torch.Tensor, experts: torch.Tensor, num_experts: int,
                      run: RunSorted, weight_dtype: torch.dtype) -> torch.Tensor:
    """:func:`grouped_experts` with the experts given as ``run(rows, counts)``: the ``[n * k, hidden]`` rows
    sorted by expert (``counts[e]`` of them for expert ``e``) -> each row's expert's output, in ``x``'s dtype.

    Returns:
        ``[num_tokens, hidden]`` in ``x``'s dtype (see :func:`grouped_experts`).
    """
    n, k = experts.shape
    flat = experts.reshape(-1)  # [n * k]: assignment a = t * k + slot
    by_expert = flat.argsort(stable=True)
    counts = torch.bincount(flat, minlength=num_experts).tolist()
    out = run(x.index_select(0, by_expert // k), counts)  # expert 0's rows first
    scaled = out.to(weight_dtype) * weights.reshape(-1)[by_expert, None].to(weight_dtype)
    slots = torch.empty_like(scaled).index_copy_(0, by_expert, scaled).view(n, k, -1)
    return slots.sum(dim=1).to(x.dtype)


class SparseMoeBlock(nn.Module):
    """The MoE MLP of one layer. Input/output ``[num_tokens, hidden]``.

    Attributes:
        router: ``[num_experts, hidden]``.
        router_proj: ``router`` as a linear layer (:func:`~goodserve.models.linear.dense_linear`: prepacked where
            oneDNN has a bfloat16 path, the same values as ``F.linear``), made by :meth:`load`.
        gate_up: ``[num_experts, 2 * moe_intermediate_size, hidden]``, or ``None`` when the experts run on
            ``experts``.
        down: ``[num_experts, hidden, moe_intermediate_size]``, or ``None`` likewise.
        experts: The experts kept as a GGUF's blocks on the block kernel
            (:class:`~goodserve.models.moe_blocks.BlockExperts`), or ``None``.
    """

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        e, h, i = config.num_experts, config.hidden_size, config.moe_intermediate_size
        self.router = nn.Parameter(torch.empty(e, h), requires_grad=False)
        self.gate_up = nn.Parameter(torch.empty(e, 2 * i, h), requires_grad=False)
        self.down = nn.Parameter(torch.empty(e, h, i), requires_grad=False)
        self.top_k, self.renormalise = config.num_experts_per_tok, config.norm_topk_prob
        self.scaling, self.groups = config.routed_scaling_factor, config.expert_groups  # DeepSeek-V2 only
        self.float32_weighting = config.architecture in FLOAT32_WEIGHTING
        self.experts: Optional[BlockExperts] = None
        self.router_proj: Optional[nn.Module] = None

    def load(self, dense: Callable[[str, tuple[int, ...]], nn.Parameter], prefix: str,
             weights: Optional[dict] = None, dtype: Optional[torch.dtype] = None, on_blocks: bool = False) -> None:
        """Take the stacked weights (:func:`stack_experts`, :func:`join_gguf_experts`) of the layer at ``prefix``
        through ``dense`` (name, expected shape -> parameter in the model's dtype).

        Experts a GGUF holds as blocks (``weights``' :class:`~goodserve.models.moe_blocks.StackedBlocks`) run
        on the block kernel when ``on_blocks`` (``--quantization auto``) and
        :func:`~goodserve.models.moe_blocks.runs_on_blocks` allows it for ``dtype``; else they are dequantized
        to ``dtype``.

        Raises:
            ValueError: naming a missing weight or one of the wrong shape.
        """
        self.router = dense(prefix + ROUTER, tuple(self.router.shape))
        self.router_proj = dense_linear(self.router.data)
        shapes = {GATE_UP: tuple(self.gate_up.shape), DOWN: tuple(self.down.shape)}
        held = {n: None if weights is None else weights.get(prefix + n) for n in shapes}
        parts = {n: v if isinstance(v, list) else [v] for n, v in held.items()}
        if not any(isinstance(p, StackedBlocks) for ps in parts.values() for p in ps):
            self.gate_up, self.down = (dense(prefix + n, s) for n, s in shapes.items())
            return
        for n, s in shapes.items():
            if s != (s[0], sum(p.shape[1] for p in parts[n]), s[2]) or any(p.shape[::2] != s[::2] for p in parts[n]):
                raise ValueError(f"weight {prefix + n!r} has shape {[tuple(p.shape) for p in parts[n]]}, expected {s}")
        blocks = parts[GATE_UP] + parts[DOWN]
        if on_blocks and all(isinstance(p, StackedBlocks) for p in blocks) and runs_on_blocks(blocks, dtype):
            self.experts = BlockExperts(parts[GATE_UP], held[DOWN], dtype)
            self.gate_up = self.down = None
            return
        _log_once(f"MoE experts held as GGUF blocks ({', '.join(sorted({p.qtype for p in blocks}))}) run dequantized"
                  f" to {dtype}: the block kernel takes them under --quantization auto in bfloat16 (float32 on"
                  " an AVX2-only CPU) where it is built (AVX-512 VNNI or AVX2)")
        self.gate_up, self.down = (nn.Parameter(torch.cat([p.dequantize(dtype) if isinstance(p, StackedBlocks)
                                                           else p.to(dtype) for p in parts[n]], dim=1),
                                                requires_grad=False) for n in shapes)

    def decode_operands(self) -> Optional[MoeOperands]:
        """This layer as :func:`goodserve.models.native_decode.decode_layers` runs it, when its experts run on
        the block kernel and its routing is plain top-k (no expert groups); else ``None``."""
        if self.experts is None or self.groups != (1, 1):
            return None
        return MoeOperands(self.router, self.experts.part_ptrs, self.experts.part_ints, self.experts.num_experts,
                           self.top_k, self.renormalise, self.scaling, self.float32_weighting)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.experts is not None and self.groups == (1, 1) and self.experts.takes_in_one_call(x):
            return self.experts.mlp_in_one_call(x, self.router, self.top_k, self.renormalise, self.scaling,
                                                self.float32_weighting)
        logits = F.linear(x, self.router) if self.router_proj is None else self.router_proj.forward(x)
        weights, experts = route(logits, self.top_k, self.renormalise, self.scaling, self.groups)
        weight_dtype = torch.float32 if self.float32_weighting else x.dtype
        if self.experts is not None:
            return grouped_by_expert(x, weights.to(weight_dtype), experts, self.experts.num_experts,
                                     self.experts.run_sorted, weight_dtype)
        return grouped_experts(x, weights.to(weight_dtype), experts, self.gate_up, self.down, weight_dtype)


_LOGGED: set[str] = set()


def _log_once(message: str) -> None:
    """Log ``message`` at info level the first time this process sees it (once per model, not per layer)."""
    if message not in _LOGGED:
        _LOGGED.add(message)
        logger.info(message)
