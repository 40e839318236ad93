"""Per-step sampling metadata: the batch's sampling parameters as tensors, built once per step.

:meth:`SamplingMetadata.from_requests` does all the per-batch bookkeeping (which rows are greedy, which
need penalties, which draw from their own seeded generator, what logprobs to return) so that the
sampler's common cases stay cheap: an all-greedy batch is one argmax; a batch without penalties, top-k,
top-p or min-p skips that work. Optional tensors are ``None`` when no row needs them.

Seeded rows draw their noise from a generator seeded by ``(seed, len(output_token_ids))`` only
(:func:`_step_seed`), so a request's tokens depend on its own seed and prompt, never on its batch
neighbours or its position in the batch, and a preempted request that is recomputed samples the same
tokens again.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional

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
        grammar: The request's grammar matcher (:class:`~goodserve.runner.structured_output.GrammarState`)
            when its output is constrained, else ``None``.
    """

    params: SamplingParams
    prompt_token_ids: list[int]
    output_token_ids: list[int]
    eos_token_ids: tuple[int, ...] = ()
    grammar: Optional[Any] = None


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
    # Distinct (row, token) with an OpenAI logit_bias and the bias to add: [n] int64, [n] int64, [n] float32.
    logit_bias_entries: Optional[tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = None
    # Constrained rows (structured outputs): their batch indices, and the allowed tokens as xgrammar's packed
    # bitmask [num_seqs, ceil(V / 32)] int32 (bit t of row i set: token t allowed; only the constrained rows'
    # entries are filled or read). None when no row of the batch is constrained, so such batches pay nothing.
    grammar_rows: Optional[list[int]] = None
    grammar_bitmask: Optional[torch.Tensor] = None
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
            The metadata for :class:`~goodserve.runner.sampler.Sampler`.

        Raises:
            ValueError: If ``rows`` is empty.
        """
        if not rows:
            raise ValueError("rows must not be empty")
        device = torch.device(device)
        params = [r.params for r in rows]
        greedy = [p.greedy for p in params]
        random_idx = [i for i, g in enumerate(greedy) if not g]
        top_k, max_top_k, top_p, min_p = _filters(params, greedy, vocab_size, device)
        rep_pen, pres_pen, freq_pen, repetition_entries, additive_entries = _penalties(rows, vocab_size, device)
        seeded, unseeded = _generator_rows(rows, random_idx)
        num_logprobs = [p.logprobs or 0 for p in params]
        grammar_rows, grammar_bitmask = _grammar_bitmask(rows, vocab_size, device)
        return cls(
            num_seqs=len(rows),
            vocab_size=vocab_size,
            all_greedy=all(greedy),
            all_random=not any(greedy),
            no_penalties=repetition_entries is None and additive_entries is None,
            logit_bias_entries=_logit_bias_entries(rows, vocab_size, device),
            grammar_rows=grammar_rows,
            grammar_bitmask=grammar_bitmask,
            temperatures=_f32([1.0 if g else float(p.temperature) for g, p in zip(greedy, params)], device),
            greedy_mask=torch.tensor(greedy, dtype=torch.bool, device=device),
            random_rows=_i64(random_idx, device),
            top_k=top_k,
            max_top_k=max_top_k,
            top_p=top_p,
            min_p=min_p,
            repetition_penalties=rep_pen,
            presence_penalties=pres_pen,
            frequency_penalties=freq_pen,
            min_tokens_block=_min_tokens_block(rows, vocab_size, device),
            repetition_entries=repetition_entries,
            additive_entries=additive_entries,
            seeded=seeded,
            unseeded=_i64(unseeded, device) if unseeded else None,
            num_logprobs=num_logprobs,
            need_logprobs=any(p.logprobs is not None for p in params),
            max_num_logprobs=max(num_logprobs),
        )


def _f32(values: list[float], device: torch.device) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.float32, device=device)


def _i64(values: list[int], device: torch.device) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.int64, device=device)


def _filters(params: list[SamplingParams], greedy: list[bool], vocab_size: int, device: torch.device
             ) -> tuple[Optional[torch.Tensor], int, Optional[torch.Tensor], Optional[torch.Tensor]]:
    """Top-k, its batch maximum, top-p and min-p; filters only matter on sampled rows.

    Returns:
        ``top_k [n]`` int64 (``vocab_size`` = off) or ``None``; the largest ``top_k`` below ``vocab_size``
        (0 when none); ``top_p [n]`` float32 (1 = off) or ``None``; ``min_p [n]`` float32 (0 = off) or
        ``None``. A tensor is ``None`` when no sampled row uses its filter.
    """
    V = vocab_size
    ks = [V if g or p.top_k <= 0 else min(p.top_k, V) for g, p in zip(greedy, params)]
    ps = [1.0 if g else float(p.top_p) for g, p in zip(greedy, params)]
    mps = [0.0 if g else float(p.min_p) for g, p in zip(greedy, params)]
    top_k = _i64(ks, device) if any(k < V for k in ks) else None
    top_p = _f32(ps, device) if any(p < 1.0 for p in ps) else None
    min_p = _f32(mps, device) if any(m > 0.0 for m in mps) else None
    return top_k, max((k for k in ks if k < V), default=0), top_p, min_p


def _min_tokens_block(rows: list[SamplingRow], vocab_size: int, device: torch.device
                      ) -> Optional[tuple[torch.Tensor, torch.Tensor]]:
    """``(rows [n], tokens [n])`` int64 to block: EOS and stop ids of rows still below ``min_tokens``."""
    blk_rows: list[int] = []
    blk_toks: list[int] = []
    for i, r in enumerate(rows):
        p = r.params
        if len(r.output_token_ids) < p.min_tokens:
            toks = {t for t in (*r.eos_token_ids, *p.stop_token_ids) if 0 <= t < vocab_size}
            blk_rows.extend([i] * len(toks))
            blk_toks.extend(toks)
    return (_i64(blk_rows, device), _i64(blk_toks, device)) if blk_rows else None


_Entries = tuple[torch.Tensor, torch.Tensor, torch.Tensor]  # (rows [n] int64, tokens [n] int64, values [n] f32)


def _penalties(rows: list[SamplingRow], vocab_size: int, device: torch.device
               ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, Optional[_Entries], Optional[_Entries]]:
    """The per-row penalties and their sparse ``(row, token)`` entries; ``torch.unique`` de-duplicates.

    Returns:
        ``(repetition [n], presence [n], frequency [n], repetition_entries, additive_entries)``: the raw
        float32 per-row penalties, then the entries as :class:`SamplingMetadata` describes them (``None``
        when no row needs them).
    """
    V = vocab_size
    params = [r.params for r in rows]
    rep_keys: list[int] = []
    add_keys: list[int] = []
    for i, (r, p) in enumerate(zip(rows, params)):
        base = i * V
        if p.repetition_penalty != 1.0:
            rep_keys.extend(base + t for t in r.prompt_token_ids if 0 <= t < V)
            rep_keys.extend(base + t for t in r.output_token_ids if 0 <= t < V)
        if p.presence_penalty != 0.0 or p.frequency_penalty != 0.0:
            add_keys.extend(base + t for t in r.output_token_ids if 0 <= t < V)
    rep_pen = _f32([float(p.repetition_penalty) for p in params], device)
    pres_pen = _f32([float(p.presence_penalty) for p in params], device)
    freq_pen = _f32([float(p.frequency_penalty) for p in params], device)
    repetition_entries = None
    if rep_keys:
        keys = torch.unique(_i64(rep_keys, device))  # [n]
        r_idx = keys // V
        repetition_entries = (r_idx, keys % V, rep_pen[r_idx])
    additive_entries = None
    if add_keys:
        keys, counts = torch.unique(_i64(add_keys, device), return_counts=True)  # [n], [n]
        r_idx = keys // V
        amount = pres_pen[r_idx] + freq_pen[r_idx] * counts.to(torch.float32)
        additive_entries = (r_idx, keys % V, amount)
    return rep_pen, pres_pen, freq_pen, repetition_entries, additive_entries


def _generator_rows(rows: list[SamplingRow], random_idx: list[int]) -> tuple[list[tuple[int, int]], list[int]]:
    """Seeded sampled rows get their own generator per step; the rest share the engine's.

    Returns:
        ``seeded``: ``(position within random_rows, generator seed for this step)``; ``unseeded``: the
        positions within ``random_rows`` that use the engine-wide generator.
    """
    seeded: list[tuple[int, int]] = []
    unseeded: list[int] = []
    for pos, i in enumerate(random_idx):
        seed = rows[i].params.seed
        if seed is None:
            unseeded.append(pos)
        else:
            seeded.append((pos, _step_seed(seed, len(rows[i].output_token_ids))))
    return seeded, unseeded


def _logit_bias_entries(rows: list[SamplingRow], vocab_size: int, device: torch.device
                        ) -> Optional[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    """``(rows [n], tokens [n], bias [n])`` of every row's ``logit_bias`` (token ids ``>= V`` ignored)."""
    r_idx: list[int] = []
    toks: list[int] = []
    bias: list[float] = []
    for i, r in enumerate(rows):
        for t, b in (r.params.logit_bias or {}).items():
            if 0 <= t < vocab_size:
                r_idx.append(i)
                toks.append(t)
                bias.append(float(b))
    return (_i64(r_idx, device), _i64(toks, device), _f32(bias, device)) if r_idx else None


def _grammar_bitmask(rows: list[SamplingRow], vocab_size: int, device: torch.device
                     ) -> tuple[Optional[list[int]], Optional[torch.Tensor]]:
    """The constrained rows and the next-token bitmask, each filled by its row's grammar matcher."""
    constrained = [i for i, r in enumerate(rows) if r.grammar is not None]
    if not constrained:
        return None, None
    from goodserve.runner.structured_output import allocate_bitmask

    bitmask = allocate_bitmask(len(rows), vocab_size)  # [num_seqs, ceil(V / 32)] int32, CPU
    for i in constrained:
        rows[i].grammar.fill_bitmask(bitmask, i)
    return constrained, bitmask.to(device)
