"""Benchmark workloads: request sizes and arrival times from public traces, with synthetic token ids.

The Azure LLM inference traces 2023 ship with the package (``workload/data/azure-llm-2023``, CC-BY 4.0;
Patel et al., "Splitwise", ISCA 2024). They give prompt and output lengths and arrival times only;
prompts are synthesised as random token ids of the given length and outputs are forced with
``ignore_eos`` + ``max_tokens``.
"""

from __future__ import annotations

import csv
import random
from dataclasses import dataclass
from datetime import datetime
from importlib import resources
from typing import Optional

AZURE_FILES = {"azure-conv": "AzureLLMInferenceTrace_conv.csv", "azure-code": "AzureLLMInferenceTrace_code.csv"}


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
                       special_ids: int = 256) -> list[RequestSpec]:
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
