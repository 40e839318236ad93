"""Token sampler: logits of the last position of each sequence -> one token per sequence.

Per row, in this order:

1. ``min_tokens``: while a request has produced fewer than ``min_tokens`` tokens, its EOS ids and
   ``stop_token_ids`` are set to ``-inf`` (whatever ``ignore_eos`` says).
2. Penalties: the repetition penalty of CTRL (Keskar et al. 2019, §4.1; Hugging Face semantics) over
   the distinct prompt and output tokens, then the OpenAI presence and frequency penalties over the
   output tokens.
3. Greedy rows (``temperature == 0``): argmax.
4. Sampled rows: divide by the temperature, then top-k, top-p (nucleus sampling, Holtzman et al.
   2020), min-p (Nguyen et al. 2024), then draw one token with the exponential race
   ``argmax(probs / q)``, ``q ~ Exp(1)``, which picks token ``i`` with probability ``probs[i]``.

Seeded rows draw their noise from a generator seeded by ``(seed, len(output_token_ids))`` only, so
a request's tokens depend on its own seed and prompt, never on its batch neighbours or its position
in the batch, and a preempted request that is recomputed samples the same tokens again. Unseeded
rows share the engine-wide generator and draw their noise in one call.

All the per-batch bookkeeping (which rows are greedy, which need penalties, sorting, logprobs) is
done once in :meth:`SamplingMetadata.from_requests`, so that the common cases stay cheap: an
all-greedy batch is one argmax; a batch without penalties, top-k, top-p or min-p skips that work.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Optional

import torch

from goodserve.sampling_params import SamplingParams

_MASK64 = (1 << 64) - 1


def _step_seed(seed: int, step: int) -> int:
    """Mix a request seed and a step number into one 63-bit generator seed (SplitMix64 finaliser).

    Args:
        seed: The request's ``SamplingParams.seed`` (any Python int, negative allowed).
        step: Number of tokens the request has generated so far.

    Returns:
        A seed in ``[0, 2**63)``, a pure function of ``(seed, step)``.
    """
    z = ((seed & _MASK64) * 0x9E3779B97F4A7C15 + step + 0x632BE59BD9B4E019) & _MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    return (z ^ (z >> 31)) >> 1


@dataclass
class SamplingRow:
    """What the sampler needs to know about one sequence of the batch.

    Attributes:
        params: The request's sampling parameters.
        prompt_token_ids: Prompt tokens (for the repetition penalty).
        output_token_ids: Tokens generated so far (penalties, ``min_tokens``, seeded step number).
        eos_token_ids: The model's end-of-sequence ids, blocked while below ``min_tokens``.
    """

    params: SamplingParams
    prompt_token_ids: list[int]
    output_token_ids: list[int]
    eos_token_ids: tuple[int, ...] = ()


@dataclass
class SamplingMetadata:
    """Batch tensors and flags for one sampling step, built by :meth:`from_requests`.

    Optional tensors are ``None`` when no row of the batch needs them, and the sampler then skips
    that stage altogether.
    """

    num_seqs: int
    vocab_size: int
    # Flags for the fast paths.
    all_greedy: bool
    all_random: bool
    no_penalties: bool
    # [num_seqs] float32; 1.0 on greedy rows so that a division never meets a zero.
    temperatures: torch.Tensor
    # [num_seqs] bool; True where the row takes the argmax.
    greedy_mask: torch.Tensor
    # [num_random] int64; batch indices of the sampled (temperature > 0) rows, in batch order.
    random_rows: torch.Tensor
    # [num_seqs] int64; vocab_size where top-k is off. None when no sampled row uses top-k.
    top_k: Optional[torch.Tensor]
    # Largest top_k among rows that use it (0 when none); bounds the torch.topk call.
    max_top_k: int
    # [num_seqs] float32; 1.0 where off. None when no sampled row uses top-p.
    top_p: Optional[torch.Tensor]
    # [num_seqs] float32; 0.0 where off. None when no sampled row uses min-p.
    min_p: Optional[torch.Tensor]
    # [num_seqs] float32 each: the raw per-row penalties (1.0 / 0.0 / 0.0 when off).
    repetition_penalties: torch.Tensor
    presence_penalties: torch.Tensor
    frequency_penalties: torch.Tensor
    # Entries (row, token) to set to -inf for rows still below min_tokens: two [n] int64 tensors.
    min_tokens_block: Optional[tuple[torch.Tensor, torch.Tensor]]
    # Distinct (row, token) over prompt+output for rows with repetition_penalty != 1, and the
    # penalty of each entry: [n] int64, [n] int64, [n] float32.
    repetition_entries: Optional[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]
    # Distinct (row, token) over the output for rows with presence/frequency penalties, and the
    # amount to subtract: presence + frequency * count. [n] int64, [n] int64, [n] float32.
    additive_entries: Optional[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]
    # Sampled rows with a seed: (position within random_rows, generator seed for this step).
    seeded: list[tuple[int, int]] = field(default_factory=list)
    # [num_unseeded] int64; positions within random_rows that use the engine-wide generator.
    unseeded: Optional[torch.Tensor] = None
    # Requested top-logprob counts per row (0 where none), and whether to return logprobs at all.
    num_logprobs: list[int] = field(default_factory=list)
    need_logprobs: bool = False
    max_num_logprobs: int = 0

    @classmethod
    def from_requests(cls, rows: list[SamplingRow], vocab_size: int,
                      device: torch.device | str = "cpu") -> "SamplingMetadata":
        """Precompute the batch tensors for one step.

        Args:
            rows: One entry per sequence, in batch (logits row) order.
            vocab_size: ``V``, the width of the logits. Token ids ``>= V`` are ignored.
            device: Device of the logits.

        Returns:
            The metadata for :class:`Sampler`.

        Raises:
            ValueError: If ``rows`` is empty.
        """
        if not rows:
            raise ValueError("rows must not be empty")
        device = torch.device(device)
        n = len(rows)
        V = vocab_size
        params = [r.params for r in rows]

        greedy = [p.greedy for p in params]
        all_greedy = all(greedy)
        all_random = not any(greedy)
        temps = [1.0 if g else float(p.temperature) for g, p in zip(greedy, params)]
        random_idx = [i for i, g in enumerate(greedy) if not g]

        def f32(values: list[float]) -> torch.Tensor:
            return torch.tensor(values, dtype=torch.float32, device=device)

        def i64(values: list[int]) -> torch.Tensor:
            return torch.tensor(values, dtype=torch.int64, device=device)

        # Filters only matter on sampled rows.
        ks = [V if g or p.top_k <= 0 else min(p.top_k, V) for g, p in zip(greedy, params)]
        ps = [1.0 if g else float(p.top_p) for g, p in zip(greedy, params)]
        mps = [0.0 if g else float(p.min_p) for g, p in zip(greedy, params)]
        top_k = i64(ks) if any(k < V for k in ks) else None
        top_p = f32(ps) if any(p < 1.0 for p in ps) else None
        min_p = f32(mps) if any(m > 0.0 for m in mps) else None

        # (1) min_tokens: block EOS and stop ids.
        blk_rows: list[int] = []
        blk_toks: list[int] = []
        for i, (r, p) in enumerate(zip(rows, params)):
            if len(r.output_token_ids) < p.min_tokens:
                toks = {t for t in (*r.eos_token_ids, *p.stop_token_ids) if 0 <= t < V}
                blk_rows.extend([i] * len(toks))
                blk_toks.extend(toks)
        min_tokens_block = (i64(blk_rows), i64(blk_toks)) if blk_rows else None

        # (2) penalties, as sparse (row, token) entries; torch.unique does the de-duplication.
        rep_keys: list[int] = []
        add_keys: list[int] = []
        for i, (r, p) in enumerate(zip(rows, params)):
            base = i * V
            if p.repetition_penalty != 1.0:
                rep_keys.extend(base + t for t in r.prompt_token_ids if 0 <= t < V)
                rep_keys.extend(base + t for t in r.output_token_ids if 0 <= t < V)
            if p.presence_penalty != 0.0 or p.frequency_penalty != 0.0:
                add_keys.extend(base + t for t in r.output_token_ids if 0 <= t < V)
        rep_pen = f32([float(p.repetition_penalty) for p in params])
        pres_pen = f32([float(p.presence_penalty) for p in params])
        freq_pen = f32([float(p.frequency_penalty) for p in params])
        repetition_entries = None
        if rep_keys:
            keys = torch.unique(i64(rep_keys))  # [n]
            r_idx = keys // V
            repetition_entries = (r_idx, keys % V, rep_pen[r_idx])
        additive_entries = None
        if add_keys:
            keys, counts = torch.unique(i64(add_keys), return_counts=True)  # [n], [n]
            r_idx = keys // V
            amount = pres_pen[r_idx] + freq_pen[r_idx] * counts.to(torch.float32)
            additive_entries = (r_idx, keys % V, amount)

        # Generators: seeded sampled rows get their own per step; the rest share the engine's.
        seeded: list[tuple[int, int]] = []
        unseeded: list[int] = []
        for pos, i in enumerate(random_idx):
            seed = params[i].seed
            if seed is None:
                unseeded.append(pos)
            else:
                seeded.append((pos, _step_seed(seed, len(rows[i].output_token_ids))))

        num_logprobs = [p.logprobs or 0 for p in params]
        return cls(
            num_seqs=n,
            vocab_size=V,
            all_greedy=all_greedy,
            all_random=all_random,
            no_penalties=repetition_entries is None and additive_entries is None,
            temperatures=f32(temps),
            greedy_mask=torch.tensor(greedy, dtype=torch.bool, device=device),
            random_rows=i64(random_idx),
            top_k=top_k,
            max_top_k=max((k for k in ks if k < V), default=0),
            top_p=top_p,
            min_p=min_p,
            repetition_penalties=rep_pen,
            presence_penalties=pres_pen,
            frequency_penalties=freq_pen,
            min_tokens_block=min_tokens_block,
            repetition_entries=repetition_entries,
            additive_entries=additive_entries,
            seeded=seeded,
            unseeded=i64(unseeded) if unseeded else None,
            num_logprobs=num_logprobs,
            need_logprobs=any(p.logprobs is not None for p in params),
            max_num_logprobs=max(num_logprobs),
        )


@dataclass
class SamplerOutput:
    """The sampled tokens of one step.

    Attributes:
        token_ids: ``[num_seqs]`` sampled token per row.
        logprobs: ``[num_seqs]`` log-probability of each sampled token under the distribution it
            was drawn from (greedy rows: the log-softmax of the penalised logits); ``None`` when no
            row asked for logprobs.
        top_logprobs: Per row, the ``logprobs`` most likely ``(token_id, logprob)`` of the
            log-softmax of the penalised logits, most likely first (empty for rows that asked
            none); ``None`` when no row asked for any.
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
        lse = torch.where(on, sorted_vals.logsumexp(dim=-1, keepdim=True), full_lse)
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
            candidates = logits.topk(width, dim=-1).values  # [n, W], descending
        else:
            candidates = logits.sort(dim=-1, descending=True).values  # [n, V]
        full_lse = logits.logsumexp(dim=-1, keepdim=True)  # [n, 1]
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
        if metadata.min_tokens_block is None and metadata.no_penalties:
            logits = logits.float()  # no copy when already float32; never modified in place below
        else:
            logits = logits.to(torch.float32, copy=True)
            _apply_min_tokens_(logits, metadata)
            _apply_penalties_(logits, metadata)

        raw_logprobs = logits.log_softmax(dim=-1) if metadata.need_logprobs else None  # [B, V]

        if metadata.all_greedy:
            tokens = logits.argmax(dim=-1)  # [B]
            sampled_logprobs = None
        else:
            rows = None if metadata.all_random else metadata.random_rows
            sampled, sampled_logprobs = self._sample(logits if rows is None else logits[rows],
                                                     metadata, rows)
            if metadata.all_random:
                tokens = sampled
            else:
                tokens = logits.argmax(dim=-1)
                tokens[rows] = sampled

        token_ids = tokens.tolist()
        out = SamplerOutput(token_ids=token_ids)
        if raw_logprobs is not None:
            lp = raw_logprobs.gather(1, tokens.unsqueeze(1)).squeeze(1)  # [B]
            if sampled_logprobs is not None:
                if metadata.all_random:
                    lp = sampled_logprobs
                else:
                    lp[metadata.random_rows] = sampled_logprobs
            out.logprobs = lp.tolist()
            if metadata.max_num_logprobs > 0:
                k = min(metadata.max_num_logprobs, metadata.vocab_size)
                top = raw_logprobs.topk(k, dim=-1)  # [B, k] values, indices, most likely first
                vals, ids = top.values.tolist(), top.indices.tolist()
                out.top_logprobs = [list(zip(ids[i][:n], vals[i][:n]))
                                    for i, n in enumerate(metadata.num_logprobs)]
        return out

    def _sample(self, logits: torch.Tensor, metadata: SamplingMetadata,
                rows: Optional[torch.Tensor]) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
        """Sample the temperature > 0 rows.

        Args:
            logits: ``[num_random, vocab_size]`` float32 penalised logits of the sampled rows.
            metadata: The step's metadata.
            rows: ``[num_random]`` batch indices of these rows, or ``None`` when all rows are sampled.

        Returns:
            ``[num_random]`` int64 tokens and, when logprobs are wanted, ``[num_random]`` float32
            log-probabilities under the filtered distribution they were drawn from.
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
        tokens = probs.div_(u.log_()).argmin(dim=-1)  # [n]

        lp = None
        if metadata.need_logprobs:
            lp = logits.gather(1, tokens.unsqueeze(1)).squeeze(1) - logits.logsumexp(dim=-1)
        return tokens, lp
