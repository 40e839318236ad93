"""Token sampler: logits of the last position of each sequence -> one token per sequence.

Per row, in this order:

1. ``min_tokens``: while a request has produced fewer than ``min_tokens`` tokens, its EOS ids and
   ``stop_token_ids`` are set to ``-inf`` (whatever ``ignore_eos`` says).
2. Penalties: the repetition penalty of CTRL (Keskar et al. 2019, §4.1; Hugging Face semantics) over
   the distinct prompt and output tokens, then the OpenAI presence and frequency penalties over the
   output tokens.
3. ``logit_bias`` (OpenAI): each listed token's bias is added to its logit.
4. Structured outputs: tokens a row's grammar does not allow next are set to ``-inf`` (xgrammar's
   bitmask, only on the constrained rows).

   Logprobs (when asked for) are the log-softmax of the logits at this point: the model's distribution
   after the logit processors above, before temperature and the filters below (as OpenAI and vLLM report
   them). The sampled token's logprob and its entry in the top logprobs are therefore the same number, and
   neither moves with temperature, top-k, top-p or min-p (case C16).
5. Greedy rows (``temperature == 0``): argmax.
6. Sampled rows: divide by the temperature, then top-k, top-p (nucleus sampling, Holtzman et al.
   2020), min-p (Nguyen et al. 2024), then draw one token with the exponential race
   ``argmax(probs / q)``, ``q ~ Exp(1)``, which picks token ``i`` with probability ``probs[i]``.

Seeded rows draw their noise from a generator seeded by ``(seed, len(output_token_ids))`` only, so
a request's tokens depend on its own seed and prompt, never on its batch neighbours or its position
in the batch, and a preempted request that is recomputed samples the same tokens again. Unseeded
rows share the engine-wide generator and draw their noise in one call.

Batch invariance: every op above gives a row the same bits whatever the batch's size, the row's position in
it and its neighbours (tested in ``tests/test_sampler_invariance.py``). The logit processors touch only their
own rows' entries; log-softmax, softmax, cumsum, top-k/sort values, max and argmax/argmin reduce each row
alone in PyTorch's CPU kernels. Two things needed care: ``torch.logsumexp`` (a generic reduction) splits a
lone row's sum across threads when its output has one element, so a batch of one rounds differently from a
larger batch; :func:`row_logsumexp` reads the sum from the row's log-softmax instead. And the order of tied
top logprobs depends on how many ``torch.topk`` is asked for, so every row asks for
:data:`~goodserve.sampling_params.MAX_LOGPROBS` and keeps its own count. Only unseeded rows, which share
the engine-wide generator, may depend on their batch.

All the per-batch bookkeeping (which rows are greedy, which need penalties, logprobs) is done once in
:meth:`SamplingMetadata.from_requests` (:mod:`goodserve.runner.sampling_metadata`, re-exported here
with :class:`SamplingRow`), so that the common cases stay cheap: an all-greedy batch is one argmax; a
batch without penalties, top-k, top-p or min-p skips that work.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional

import torch

from goodserve.models import native
from goodserve.runner.sampling_metadata import SamplingMetadata, SamplingRow
from goodserve.sampling_params import MAX_LOGPROBS

__all__ = ["Sampler", "SamplerOutput", "SamplingMetadata", "SamplingRow", "apply_min_tokens", "apply_penalties",
           "row_logsumexp"]


@dataclass
class SamplerOutput:
    """The sampled tokens of one step.

    Attributes:
        token_ids: ``[num_seqs]`` sampled token per row.
        logprobs: ``[num_seqs]`` log-probability of each sampled token under the log-softmax of the
            processed logits (after min_tokens, penalties, logit_bias and the grammar mask; before
            temperature and the filters); ``None`` when no row asked for logprobs.
        top_logprobs: Per row, the ``logprobs`` most likely ``(token_id, logprob)`` of the same
            distribution, most likely first (empty for rows that asked none); ``None`` when no row
            asked for any.
    """

    token_ids: list[int]
    logprobs: Optional[list[float]] = None
    top_logprobs: Optional[list[list[tuple[int, float]]]] = None


def _apply_min_tokens_(logits: torch.Tensor, metadata: SamplingMetadata) -> None:
    """Set blocked EOS / stop-token logits to ``-inf`` in place. ``logits: [num_seqs, vocab_size]``."""
    if metadata.min_tokens_block is not None:
        logits.index_put_(metadata.min_tokens_block, torch.tensor(-math.inf, device=logits.device))


def _apply_penalties_(logits: torch.Tensor, metadata: SamplingMetadata) -> None:
    """Apply repetition, then presence and frequency penalties, in place.

    Args:
        logits: ``[num_seqs, vocab_size]`` float32, modified in place.
        metadata: The step's metadata.
    """
    if metadata.repetition_entries is not None:
        # CTRL (Keskar et al. 2019), HF semantics: shrink positive logits, push negative ones down.
        rows, toks, pen = metadata.repetition_entries
        v = logits[rows, toks]  # [n]
        logits[rows, toks] = torch.where(v > 0, v / pen, v * pen)
    if metadata.additive_entries is not None:
        # OpenAI: logit -= presence * (count > 0) + frequency * count, over the output.
        rows, toks, amount = metadata.additive_entries
        logits.index_put_((rows, toks), -amount, accumulate=True)


def _apply_logit_bias_(logits: torch.Tensor, metadata: SamplingMetadata) -> None:
    """Add each row's OpenAI ``logit_bias`` in place. ``logits: [num_seqs, vocab_size]`` float32."""
    if metadata.logit_bias_entries is not None:
        rows, toks, bias = metadata.logit_bias_entries
        logits.index_put_((rows, toks), bias, accumulate=True)


def _apply_grammar_(logits: torch.Tensor, metadata: SamplingMetadata) -> None:
    """Set the tokens each constrained row's grammar forbids next to ``-inf``, in place (only those rows)."""
    if metadata.grammar_rows is not None:
        from goodserve.runner.structured_output import apply_bitmask_

        apply_bitmask_(logits, metadata.grammar_bitmask, metadata.grammar_rows)


def greedy(logits: torch.Tensor) -> torch.Tensor:
    """``logits.argmax(dim=-1)`` (``[B]`` int64: each row's first maximum, or its first NaN), on the native
    kernel where it runs (CPU, float32 or bfloat16 rows; :func:`goodserve.models.native.argmax`: ~2.7x faster
    than PyTorch's CPU argmax on the engine's float32 logits at batch 16-64)."""
    if logits.shape[1] > 0 and logits.stride(1) == 1 and native.supports(logits):
        return native.argmax(logits)
    return logits.argmax(dim=-1)


def apply_min_tokens(logits: torch.Tensor, metadata: SamplingMetadata) -> torch.Tensor:
    """Return a float32 copy of ``logits`` ``[num_seqs, vocab_size]`` with EOS/stop ids blocked."""
    out = logits.to(torch.float32, copy=True)
    _apply_min_tokens_(out, metadata)
    return out


def apply_penalties(logits: torch.Tensor, metadata: SamplingMetadata) -> torch.Tensor:
    """Return a float32 copy of ``logits`` with the repetition, presence and frequency penalties.

    Args:
        logits: ``[num_seqs, vocab_size]``, any float dtype; not modified.
        metadata: The step's metadata.

    Returns:
        ``[num_seqs, vocab_size]`` float32 penalised logits.
    """
    out = logits.to(torch.float32, copy=True)
    _apply_penalties_(out, metadata)
    return out


def row_logsumexp(x: torch.Tensor, argmax: torch.Tensor) -> torch.Tensor:
    """Each row's logsumexp, rounded the same whatever the batch around the row.

    ``torch.logsumexp`` over a single row splits the row's sum across threads (a generic reduction with one
    output), while over several rows each thread sums whole rows: a row's logsumexp then depends on the
    batch's size. The log-softmax kernel always reduces a row in one pass, and at a row's maximum it is
    exactly ``-log(sum(exp(x - max)))``, so ``max - log_softmax[argmax]`` is ``max + log(sum)`` rounded once.

    Args:
        x: ``[n, W]`` float32, each row holding at least one finite value (``-inf`` entries count as 0).
        argmax: ``[n, 1]`` int64, the index of a maximum of each row.

    Returns:
        ``[n, 1]`` float32.
    """
    return x.gather(1, argmax) - x.log_softmax(dim=-1).gather(1, argmax)


_TOP_P_CANDIDATES = 256  # top-p first looks for its cut among this many best tokens


def _top_p_cutoff(sorted_vals: torch.Tensor, full_lse: torch.Tensor, top_k: Optional[torch.Tensor],
                  top_p: torch.Tensor, vocab_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Find, per row, the smallest logit kept by top-k then top-p (Holtzman et al. 2020).

    Args:
        sorted_vals: ``[m, W]`` the ``W`` largest logits of each row, descending (``W <= V``).
        full_lse: ``[m, 1]`` logsumexp of each whole row.
        top_k: ``[m]`` int64 (``vocab_size`` = off) or ``None``.
        top_p: ``[m]`` float32 (1 = off).
        vocab_size: ``V``.

    Returns:
        ``cutoff [m, 1]``: keep tokens with ``logit >= cutoff``; and ``exact [m]`` bool: whether the
        kept set provably lies within the ``W`` given logits (always True when ``W == V``).
        Whether a row is exact depends on that row alone, so a row takes the same path, and gets
        the same cut to the bit, whatever its batch.
    """
    neg_inf = -math.inf
    width = sorted_vals.shape[1]
    kth = torch.full_like(full_lse, neg_inf)  # [m, 1]
    lse = full_lse
    if top_k is not None:
        on = (top_k < vocab_size).unsqueeze(1)  # [m, 1]
        kth = sorted_vals.gather(1, (top_k.clamp(max=width) - 1).unsqueeze(1)).masked_fill(~on, neg_inf)
        sorted_vals = sorted_vals.masked_fill(sorted_vals < kth, neg_inf)
        first = torch.zeros_like(kth, dtype=torch.int64)  # [m, 1]: a sorted row's maximum is its first entry
        lse = torch.where(on, row_logsumexp(sorted_vals, first), full_lse)
    probs = (sorted_vals - lse).exp()  # [m, W], renormalised over the top-k set
    cum = probs.cumsum(dim=-1)
    mass_before = torch.nn.functional.pad(cum[:, :-1], (1, 0))  # [m, W] exclusive, monotone
    keep = (mass_before < top_p.unsqueeze(1)) & (sorted_vals > neg_inf)
    keep[:, 0] = True  # the top token always stays
    # The kept tokens are a prefix of the sorted row: the cut is its last logit.
    cutoff = sorted_vals.gather(1, keep.sum(dim=-1, keepdim=True) - 1)  # [m, 1]
    top_p_off = top_p >= 1.0
    cutoff = torch.where(top_p_off.unsqueeze(1), kth, cutoff)
    if width >= vocab_size:
        return cutoff, torch.ones_like(top_p_off)
    if top_k is None:
        return cutoff, top_p_off | (cum[:, -1] >= top_p)
    k_on = top_k < vocab_size
    return cutoff, torch.where(k_on, top_k <= width, top_p_off | (cum[:, -1] >= top_p))


def _apply_filters(logits: torch.Tensor, top_k: Optional[torch.Tensor], max_top_k: int,
                   top_p: Optional[torch.Tensor], min_p: Optional[torch.Tensor]) -> torch.Tensor:
    """Mask tokens outside top-k, top-p and min-p with ``-inf``.

    Args:
        logits: ``[n, vocab_size]`` float32 temperature-scaled logits (not modified).
        top_k: ``[n]`` int64 (``vocab_size`` = off) or ``None``.
        max_top_k: The largest ``top_k`` below ``vocab_size`` in the batch.
        top_p: ``[n]`` float32 (1 = off) or ``None``. Applied to the top-k renormalised
            distribution; keeps the smallest prefix whose mass reaches ``top_p`` (Holtzman et al. 2020).
            The cut is first sought among the best 256 tokens (``torch.topk``); only rows whose
            nucleus (or top-k) is wider are fully sorted.
        min_p: ``[n]`` float32 (0 = off) or ``None``. Drops ``p < min_p * p_max`` (Nguyen et al.
            2024), i.e. ``logit < max_logit + log(min_p)``; renormalising never changes that ratio.

    Returns:
        ``[n, vocab_size]`` masked logits. Ties with the k-th logit are kept.
    """
    neg_inf = -math.inf
    vocab_size = logits.shape[1]
    if top_p is not None:
        width = min(vocab_size, _TOP_P_CANDIDATES)  # fixed, so a row's path never depends on its batch
        if width < vocab_size:
            candidates, order = logits.topk(width, dim=-1)  # [n, W], descending
        else:
            candidates, order = logits.sort(dim=-1, descending=True)  # [n, V]
        full_lse = row_logsumexp(logits, order[:, :1])  # [n, 1]
        cutoff, exact = _top_p_cutoff(candidates, full_lse, top_k, top_p, vocab_size)
        if not bool(exact.all()):
            redo = (~exact).nonzero().squeeze(1)  # [m] rows whose nucleus is wider than W
            cutoff[redo] = _top_p_cutoff(
                logits[redo].sort(dim=-1, descending=True).values, full_lse[redo],
                None if top_k is None else top_k[redo], top_p[redo], vocab_size)[0]
        logits = logits.masked_fill(logits < cutoff, neg_inf)
    elif top_k is not None:
        max_k = max(1, min(max_top_k, logits.shape[1]))
        top_vals = logits.topk(max_k, dim=-1).values  # [n, max_k]
        kth = top_vals.gather(1, (top_k.clamp(max=max_k) - 1).unsqueeze(1))  # [n, 1]
        kth = kth.masked_fill((top_k >= logits.shape[1]).unsqueeze(1), neg_inf)
        logits = logits.masked_fill(logits < kth, neg_inf)
    if min_p is not None:
        floor = logits.amax(dim=-1, keepdim=True) + min_p.log().unsqueeze(1)  # [n, 1]; -inf when off
        logits = logits.masked_fill(logits < floor, neg_inf)
    return logits


class Sampler:
    """Turns one step's logits into tokens; see the module docstring for the order of operations.

    Args:
        seed: Seed of the engine-wide generator used by rows without ``SamplingParams.seed``;
            ``None`` seeds it from the OS.
    """

    def __init__(self, seed: Optional[int] = None) -> None:
        self.seed = seed
        self._generators: dict[torch.device, torch.Generator] = {}

    def _generator(self, device: torch.device) -> torch.Generator:
        gen = self._generators.get(device)
        if gen is None:
            gen = torch.Generator(device=device)
            if self.seed is None:
                gen.seed()
            else:
                gen.manual_seed(self.seed)
            self._generators[device] = gen
        return gen

    def __call__(self, logits: torch.Tensor, metadata: SamplingMetadata) -> SamplerOutput:
        """Sample one token per row.

        Args:
            logits: ``[num_seqs, vocab_size]``, any float dtype (computed in float32; not modified).
            metadata: Built by :meth:`SamplingMetadata.from_requests` for the same rows.

        Returns:
            The sampled tokens and, when asked, their logprobs.

        Raises:
            ValueError: If ``logits`` does not match the metadata's shape.
        """
        if logits.dim() != 2 or logits.shape[0] != metadata.num_seqs:
            raise ValueError(f"logits must be [{metadata.num_seqs}, vocab_size], got {tuple(logits.shape)}")
        if (metadata.min_tokens_block is None and metadata.no_penalties and metadata.logit_bias_entries is None
                and metadata.grammar_rows is None):
            logits = logits.float()  # no copy when already float32; never modified in place below
        else:
            logits = logits.to(torch.float32, copy=True)
            _apply_min_tokens_(logits, metadata)
            _apply_penalties_(logits, metadata)
            _apply_logit_bias_(logits, metadata)
            _apply_grammar_(logits, metadata)

        raw_logprobs = logits.log_softmax(dim=-1) if metadata.need_logprobs else None  # [B, V]

        if metadata.all_greedy:
            tokens = greedy(logits)  # [B]
        else:
            rows = None if metadata.all_random else metadata.random_rows
            sampled = self._sample(logits if rows is None else logits[rows], metadata, rows)
            if metadata.all_random:
                tokens = sampled
            else:
                tokens = greedy(logits)
                tokens[rows] = sampled

        token_ids = tokens.tolist()
        out = SamplerOutput(token_ids=token_ids)
        if raw_logprobs is not None:
            lp = raw_logprobs.gather(1, tokens.unsqueeze(1)).squeeze(1)  # [B]
            out.logprobs = lp.tolist()
            if metadata.max_num_logprobs > 0:
                # The same k for every batch: which of several tied tokens topk lists first depends on k.
                k = min(max(MAX_LOGPROBS, metadata.max_num_logprobs), metadata.vocab_size)
                top = raw_logprobs.topk(k, dim=-1)  # [B, k] values, indices, most likely first
                vals, ids = top.values.tolist(), top.indices.tolist()
                # A token the logit processors ruled out (-inf: a grammar, min_tokens) is not "likely": left out.
                out.top_logprobs = [[(t, v) for t, v in zip(ids[i][:n], vals[i][:n]) if v != -math.inf]
                                    for i, n in enumerate(metadata.num_logprobs)]
        return out

    def _sample(self, logits: torch.Tensor, metadata: SamplingMetadata,
                rows: Optional[torch.Tensor]) -> torch.Tensor:
        """Sample the temperature > 0 rows.

        Args:
            logits: ``[num_random, vocab_size]`` float32 penalised logits of the sampled rows.
            metadata: The step's metadata.
            rows: ``[num_random]`` batch indices of these rows, or ``None`` when all rows are sampled.

        Returns:
            ``[num_random]`` int64 tokens.
        """
        def pick(t: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
            return t if t is None or rows is None else t[rows]

        logits = logits / pick(metadata.temperatures).unsqueeze(1)
        logits = _apply_filters(logits, pick(metadata.top_k), metadata.max_top_k,
                                pick(metadata.top_p), pick(metadata.min_p))
        probs = logits.softmax(dim=-1)  # [n, V]

        # Exponential race: argmax(p / E) with E ~ Exp(1) draws token i with probability p_i.
        # With E = -log(u), u ~ U[0, 1): argmax(p / E) = argmin(p / log(u)), one pass fewer.
        # u = 0 gives log(u) = -inf and p / -inf = -0: that token simply cannot win.
        u = torch.empty_like(probs)  # [n, V]
        if metadata.unseeded is not None:
            gen = self._generator(probs.device)
            if metadata.unseeded.numel() == probs.shape[0]:
                u.uniform_(generator=gen)
            else:
                u[metadata.unseeded] = torch.empty(
                    (metadata.unseeded.numel(), probs.shape[1]), device=probs.device
                ).uniform_(generator=gen)
        for pos, step_seed in metadata.seeded:
            gen = torch.Generator(device=probs.device).manual_seed(step_seed)
            u[pos].uniform_(generator=gen)
        return probs.div_(u.log_()).argmin(dim=-1)  # [n]
