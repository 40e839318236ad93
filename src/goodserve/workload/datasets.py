"""Length-only workloads: request sizes and arrival times from public traces, with synthetic token ids.

Shipped traces (in ``workload/data``):

* The Azure LLM inference traces 2023 (``azure-llm-2023``, CC-BY 4.0; Patel et al., "Splitwise",
  ISCA 2024): prompt and output lengths and arrival times only (:func:`load_azure`).
* The Mooncake FAST'25 conversation trace (``mooncake-fast25``, Apache-2.0; Qin et al., FAST 2025):
  lengths, arrival times and the hash ids of the prompt's 512-token blocks, so prefix sharing can be
  reproduced (:func:`load_mooncake`, :func:`synthesise_shared_prompts`).

Synthetic shared-prefix prompts (:func:`prefix_repetition`: system prompts and questions, vLLM's
``prefix-repetition`` shape) need no trace. Prompts are synthesised as random token ids of the given length; a benchmark forces the outputs with
``ignore_eos`` + ``max_tokens``. The serving benchmark and the simulator clip lengths with the same
:func:`clip_specs`, so the same flags give both the same workload.
"""

from __future__ import annotations

import csv
import json
import random
from dataclasses import dataclass, replace
from datetime import datetime
from importlib import resources
from typing import Optional, Sequence

AZURE_FILES = {"azure-conv": "AzureLLMInferenceTrace_conv.csv", "azure-code": "AzureLLMInferenceTrace_code.csv"}
MOONCAKE_BLOCK = 512  # tokens per hash id in the Mooncake trace
SPECIAL_IDS = 256  # lowest token ids are left out of synthetic prompts (special tokens live there)


@dataclass(frozen=True)
class RequestSpec:
    """One benchmark request.

    Attributes:
        prompt_len: Prompt length in tokens.
        output_len: Forced output length in tokens.
        arrival: Arrival offset from the trace start in seconds.
        prompt_token_ids: Synthesised prompt (``prompt_len`` ids), or ``None`` before synthesis.
    """

    prompt_len: int
    output_len: int
    arrival: float = 0.0
    prompt_token_ids: Optional[tuple[int, ...]] = None


def load_azure(dataset: str = "azure-conv", num_prompts: int = 256, max_model_len: int = 8192,
               start: int = 0) -> list[RequestSpec]:
    """Read ``num_prompts`` consecutive requests of an Azure 2023 trace, lengths clipped to the context.

    Clipping: the output is kept (at least 1 token) and the prompt shortened so that
    ``prompt_len + output_len <= max_model_len``.

    Args:
        dataset: ``"azure-conv"`` or ``"azure-code"``.
        num_prompts: How many requests.
        max_model_len: The model's context length in tokens.
        start: Row to start at.

    Raises:
        ValueError: for an unknown dataset, a negative ``start`` or a trace shorter than asked.
    """
    if dataset not in AZURE_FILES:
        raise ValueError(f"unknown dataset {dataset!r}; choose from {sorted(AZURE_FILES)}")
    if start < 0:
        raise ValueError(f"the first row of a trace must be >= 0, got {start}")
    path = resources.files("goodserve.workload") / "data" / "azure-llm-2023" / AZURE_FILES[dataset]
    with path.open() as f:
        rows = list(csv.DictReader(f))[start:start + num_prompts]
    if len(rows) < num_prompts:
        raise ValueError(f"{dataset} has only {len(rows)} requests from row {start}, asked for {num_prompts}")
    t0 = _parse_time(rows[0]["TIMESTAMP"])
    specs = []
    for row in rows:
        out = max(1, min(int(row["GeneratedTokens"]), max_model_len // 2))
        prompt = max(1, min(int(row["ContextTokens"]), max_model_len - out))
        specs.append(RequestSpec(prompt, out, (_parse_time(row["TIMESTAMP"]) - t0).total_seconds()))
    return specs


def _parse_time(text: str) -> datetime:
    # The trace's timestamps carry 7 fractional digits; datetime takes at most 6.
    head, _, frac = text.partition(".")
    return datetime.fromisoformat(f"{head}.{(frac + '000000')[:6]}")


def random_lengths(num_prompts: int, input_len: int, output_len: int, range_ratio: float = 0.0,
                   seed: int = 0) -> list[RequestSpec]:
    """Uniform lengths in ``[len * (1 - range_ratio), len * (1 + range_ratio)]`` (tokens)."""
    rng = random.Random(seed)

    def draw(n: int) -> int:
        return max(1, rng.randint(int(n * (1 - range_ratio)), int(n * (1 + range_ratio))))

    return [RequestSpec(draw(input_len), draw(output_len)) for _ in range(num_prompts)]


def synthesise_prompts(specs: list[RequestSpec], vocab_size: int, seed: int = 0,
                       special_ids: int = SPECIAL_IDS) -> list[RequestSpec]:
    """Fill each spec with random token ids, avoiding the lowest ``special_ids`` ids (special tokens).

    Raises:
        ValueError: if the vocabulary has no ordinary ids.
    """
    if vocab_size <= special_ids:
        raise ValueError(f"vocab_size {vocab_size} leaves no ids above the {special_ids} reserved ones")
    rng = random.Random(seed)
    return [RequestSpec(s.prompt_len, s.output_len, s.arrival,
                        tuple(rng.randrange(special_ids, vocab_size) for _ in range(s.prompt_len)))
            for s in specs]


def clip_specs(specs: Sequence[RequestSpec], max_model_len: int, max_input_len: Optional[int] = None,
               max_output_len: Optional[int] = None) -> list[RequestSpec]:
    """Clip lengths: outputs to ``max_output_len``, prompts to ``max_input_len`` and then to the room left.

    Every request keeps at least one prompt and one output token, and ``prompt + output <= max_model_len``.

    Raises:
        ValueError: if ``max_model_len < 2`` or a limit is below 1.
    """
    if max_model_len < 2:
        raise ValueError(f"max_model_len must be >= 2, got {max_model_len}")
    for name, v in (("max_input_len", max_input_len), ("max_output_len", max_output_len)):
        if v is not None and v < 1:
            raise ValueError(f"{name} must be >= 1, got {v}")
    out = []
    for s in specs:
        o = max(1, min(s.output_len, max_output_len or s.output_len, max_model_len - 1))
        p = max(1, min(s.prompt_len, max_input_len or s.prompt_len, max_model_len - o))
        ids = s.prompt_token_ids[:p] if s.prompt_token_ids is not None else None
        out.append(RequestSpec(p, o, s.arrival, ids))
    return out

def load_mooncake(num_prompts: int, length_scale: float = 1.0, start: int = 0,
                  path: Optional[str] = None) -> list[tuple[RequestSpec, tuple[int, ...]]]:
    """Read the Mooncake conversation trace: ``(spec, hash_ids)`` per request, lengths scaled.

    Args:
        num_prompts: How many consecutive requests.
        length_scale: Multiplies prompt and output lengths (each stays >= 1); the trace's mean prompt is
            ~12k tokens, so small models and CPUs want e.g. ``0.05``.
        start: Line to start at.
        path: Another trace file of the same format (default: the shipped conversation trace).

    Raises:
        ValueError: for a non-positive scale or a trace shorter than asked.
    """
    if not length_scale > 0:
        raise ValueError(f"length_scale must be > 0, got {length_scale}")
    if path is None:
        src = resources.files("goodserve.workload") / "data" / "mooncake-fast25" / "conversation_trace.jsonl"
        lines = src.read_text().splitlines()
    else:
        with open(path) as f:
            lines = f.read().splitlines()
    lines = [ln for ln in lines if ln.strip()][start:start + num_prompts]
    if len(lines) < num_prompts:
        raise ValueError(f"mooncake trace has only {len(lines)} requests from line {start}, asked for {num_prompts}")
    out = []
    for line in lines:
        row = json.loads(line)
        spec = RequestSpec(max(1, round(row["input_length"] * length_scale)),
                           max(1, round(row["output_length"] * length_scale)), row["timestamp"] / 1000.0)
        out.append((spec, tuple(row.get("hash_ids", ()))))
    return out

def synthesise_shared_prompts(rows: Sequence[tuple[RequestSpec, tuple[int, ...]]], vocab_size: int,
                              block_len: int, seed: int = 0) -> list[RequestSpec]:
    """Random prompts where equal hash ids give equal ``block_len``-token blocks (prefix sharing kept).

    Tokens past the hash blocks (a prompt longer than its blocks) are random and private to the request.

    Raises:
        ValueError: if the vocabulary has no ordinary ids or ``block_len < 1``.
    """
    if vocab_size <= SPECIAL_IDS:
        raise ValueError(f"vocab_size {vocab_size} leaves no ids above the {SPECIAL_IDS} reserved ones")
    if block_len < 1:
        raise ValueError(f"block_len must be >= 1, got {block_len}")
    blocks: dict[int, list[int]] = {}
    rng = random.Random(seed)
    out = []
    for spec, hash_ids in rows:
        ids: list[int] = []
        for h in hash_ids:
            if len(ids) >= spec.prompt_len:
                break
            if h not in blocks:
                brng = random.Random(f"{seed}-{h}")
                blocks[h] = [brng.randrange(SPECIAL_IDS, vocab_size) for _ in range(block_len)]
            ids.extend(blocks[h])
        ids = ids[:spec.prompt_len]
        ids.extend(rng.randrange(SPECIAL_IDS, vocab_size) for _ in range(spec.prompt_len - len(ids)))
        out.append(replace(spec, prompt_token_ids=tuple(ids)))
    return out


def prefix_repetition(num_prompts: int, prefix_len: int, suffix_len: int, num_prefixes: int, output_len: int,
                      vocab_size: int, max_model_len: int, seed: int = 0) -> list[tuple[int, ...]]:
    """Token-id prompts sharing ``num_prefixes`` prefixes (the ``prefix-repetition`` dataset).

    Prefix ``i`` serves requests ``i, i + num_prefixes, ...`` before a seeded shuffle, so every prefix serves
    ``num_prompts // num_prefixes`` or one more requests, in random order. Distinct prefixes start with
    distinct tokens (they share no leading token, hence no cached block); suffixes are pairwise distinct.
    Ids are drawn from ``[SPECIAL_IDS, vocab_size)``; the same arguments give the same prompts.

    Args:
        num_prompts: How many prompts.
        prefix_len: Tokens of each shared prefix.
        suffix_len: Tokens of each request's private suffix.
        num_prefixes: How many distinct prefixes.
        output_len: Output tokens per request (only checked against the context here).
        vocab_size: Vocabulary size; ids come from ``[SPECIAL_IDS, vocab_size)``.
        max_model_len: Context length in tokens.
        seed: Seed of the prefixes, suffixes and order.

    Returns:
        ``num_prompts`` prompts of ``prefix_len + suffix_len`` token ids each.

    Raises:
        ValueError: if a length or count is below 1, ``num_prefixes > num_prompts`` (a prefix would go unused),
            ``prefix_len + suffix_len + output_len > max_model_len``, or the vocabulary's ordinary ids are too
            few for distinct first tokens or distinct suffixes.
    """
    for name, v in (("num_prompts", num_prompts), ("prefix_len", prefix_len), ("suffix_len", suffix_len),
                    ("num_prefixes", num_prefixes), ("output_len", output_len)):
        if v < 1:
            raise ValueError(f"prefix-repetition: {name} must be >= 1, got {v}")
    if num_prefixes > num_prompts:
        raise ValueError(f"prefix-repetition: num_prefixes ({num_prefixes}) must be <= num_prompts ({num_prompts}), "
                         "or some prefixes are never sent")
    if prefix_len + suffix_len + output_len > max_model_len:
        raise ValueError(f"prefix-repetition: prefix_len + suffix_len + output_len = {prefix_len} + {suffix_len} + "
                         f"{output_len} = {prefix_len + suffix_len + output_len} tokens exceeds max_model_len "
                         f"{max_model_len}")
    ordinary = vocab_size - SPECIAL_IDS
    if ordinary < num_prefixes:
        raise ValueError(f"prefix-repetition: vocab_size {vocab_size} has {max(ordinary, 0)} ids above the "
                         f"{SPECIAL_IDS} reserved ones, fewer than num_prefixes ({num_prefixes}) distinct first tokens")
    n_suffixes = ordinary ** min(suffix_len, 64)  # >= 2**64 unless ordinary == 1: the cap changes no answer
    if n_suffixes < num_prompts:
        raise ValueError(f"prefix-repetition: {ordinary} ordinary ids make only {n_suffixes} distinct "
                         f"{suffix_len}-token suffixes, fewer than num_prompts ({num_prompts})")
    rng = random.Random(seed)
    firsts = rng.sample(range(SPECIAL_IDS, vocab_size), num_prefixes)
    prefixes = [(f, *(rng.randrange(SPECIAL_IDS, vocab_size) for _ in range(prefix_len - 1))) for f in firsts]
    order = [i % num_prefixes for i in range(num_prompts)]
    rng.shuffle(order)
    seen: set[tuple[int, ...]] = set()
    out = []
    for i in order:
        suffix = tuple(rng.randrange(SPECIAL_IDS, vocab_size) for _ in range(suffix_len))
        while suffix in seen:
            suffix = tuple(rng.randrange(SPECIAL_IDS, vocab_size) for _ in range(suffix_len))
        seen.add(suffix)
        out.append(prefixes[i] + suffix)
    return out
