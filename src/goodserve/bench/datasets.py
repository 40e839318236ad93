"""Serving-benchmark workloads: which prompts to send, how long each output must be, and (for traces) when.

The length-only datasets come from :mod:`goodserve.workload.datasets` (shared with the simulator); this
module adds the text datasets, which need a tokenizer, and builds the benchmark's request list.

Datasets:

* ``random`` — uniform lengths around ``--input-len`` / ``--output-len`` (``datasets.random_lengths``).
* ``azure-conv``, ``azure-code`` — the Azure LLM inference traces 2023 shipped with the package
  (``datasets.load_azure``; CC-BY 4.0, Patel et al., "Splitwise", ISCA 2024).
* ``mooncake`` — the Mooncake FAST'25 conversation trace shipped in ``workload/data/mooncake-fast25``
  (Apache-2.0; Qin et al., FAST 2025). Lengths are multiplied by ``length_scale`` and clipped to the
  context; prompts reproduce the trace's prefix sharing (the same hash id gives the same token block).
* ``sharegpt-file`` — a ShareGPT JSON file: the first human turn is the prompt, the first gpt turn's token
  length is the output length.
* ``code-copy`` — input-grounded (:mod:`goodserve.bench.grounded`): a real source file in the prompt and
  an output that reproduces it, with ``azure-code``'s lengths; the workload of speculation by prompt lookup.
* ``prefix-repetition`` — shared-prefix prompts in the shape of vLLM's benchmark dataset of that name: each
  prompt is one of ``num_prefixes`` random "system prompts" of ``prefix_len`` tokens followed by a private
  random "question" of ``suffix_len`` tokens; output ``output_len`` tokens (:func:`prefix_repetition`).
* ``jsonl`` — one JSON object per line: ``prompt`` (text or token ids, optional), ``prompt_len`` (optional
  when ``prompt`` is given), ``output_len``, and optionally ``arrival`` (seconds) or ``timestamp`` (ms).

Length-only datasets get random token-id prompts of the exact length (``/v1/completions`` accepts ids);
for the chat endpoint those ids are decoded to text, so the server's count may differ slightly.
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass
from typing import Any, Optional, Union

from goodserve.workload.datasets import (AZURE_FILES, MOONCAKE_BLOCK, SPECIAL_IDS, clip_specs, load_azure,
                                        load_mooncake, prefix_repetition, random_lengths, synthesise_prompts,
                                        synthesise_shared_prompts)

DATASETS = ("random", *sorted(AZURE_FILES), "mooncake", "prefix-repetition", "code-copy", "sharegpt-file", "jsonl")


@dataclass(frozen=True)
class BenchRequest:
    """One request of a serving benchmark.

    Attributes:
        prompt: Token ids (sent as-is to ``/v1/completions``) or text.
        prompt_len: Prompt length in tokens (of the ids; for text, as counted by the tokenizer).
        output_len: Forced output length in tokens (``max_tokens`` with ``ignore_eos``).
        arrival: The trace's arrival offset in seconds (0 for datasets without a clock).
        slo_class: The server-side SLO class to name in the body (``slo_class``), or ``None``.
    """

    prompt: Union[str, tuple[int, ...]]
    prompt_len: int
    output_len: int
    arrival: float = 0.0
    slo_class: Optional[str] = None


def load_sharegpt(path: str, num_prompts: int, tokenizer: Any, max_model_len: int,
                  max_input_len: Optional[int] = None, max_output_len: Optional[int] = None) -> list[BenchRequest]:
    """The first ``num_prompts`` usable conversations of a ShareGPT JSON file.

    A conversation is usable when it has a human turn followed by a gpt turn; the human text is the
    prompt and the gpt answer's token count (clipped to ``max_output_len``) the output length. Prompts
    longer than ``max_input_len`` or than the room the output leaves in the context are skipped.

    Raises:
        ValueError: if the file holds fewer usable conversations than asked.
    """
    with open(path) as f:
        data = json.load(f)
    out: list[BenchRequest] = []
    for item in data:
        if len(out) >= num_prompts:
            break
        turns = item.get("conversations") or item.get("conversation") or []
        human = next((i for i, t in enumerate(turns) if t.get("from") in ("human", "user")), None)
        if human is None:
            continue
        answer = next((t for t in turns[human + 1:] if t.get("from") in ("gpt", "assistant")), None)
        if answer is None:
            continue
        prompt = turns[human].get("value", "")
        prompt_len = len(tokenizer.encode(prompt, add_special_tokens=False))
        output_len = len(tokenizer.encode(answer.get("value", ""), add_special_tokens=False))
        output_len = min(output_len, max_output_len or output_len)
        if prompt_len < 1 or output_len < 1:
            continue
        if prompt_len > (max_input_len or prompt_len) or prompt_len + output_len > max_model_len:
            continue
        out.append(BenchRequest(prompt, prompt_len, output_len))
    if len(out) < num_prompts:
        raise ValueError(f"{path} has only {len(out)} usable conversations, asked for {num_prompts}")
    return out


def load_jsonl(path: str, num_prompts: int, tokenizer: Any, vocab_size: int, seed: int = 0) -> list[BenchRequest]:
    """Requests from a JSON-lines file (see the module docstring for the fields).

    Raises:
        ValueError: for a line without ``output_len``, without both ``prompt`` and ``prompt_len``, or a file
            shorter than asked.
    """
    rng = random.Random(seed)
    out: list[BenchRequest] = []
    with open(path) as f:
        for n, line in enumerate(f, 1):
            if len(out) >= num_prompts:
                break
            if not line.strip():
                continue
            row = json.loads(line)
            if "output_len" not in row:
                raise ValueError(f"{path}:{n}: missing 'output_len'")
            prompt = row.get("prompt")
            if isinstance(prompt, list):
                prompt = tuple(int(t) for t in prompt)
                prompt_len = len(prompt)
            elif isinstance(prompt, str):
                prompt_len = int(row.get("prompt_len") or len(tokenizer.encode(prompt, add_special_tokens=False)))
            elif "prompt_len" in row:
                prompt_len = int(row["prompt_len"])
                prompt = tuple(rng.randrange(SPECIAL_IDS, vocab_size) for _ in range(prompt_len))
            else:
                raise ValueError(f"{path}:{n}: give 'prompt' or 'prompt_len'")
            arrival = float(row["arrival"]) if "arrival" in row else float(row.get("timestamp", 0)) / 1000.0
            out.append(BenchRequest(prompt, prompt_len, int(row["output_len"]), arrival))
    if len(out) < num_prompts:
        raise ValueError(f"{path} has only {len(out)} requests, asked for {num_prompts}")
    return out


def build_workload(dataset: str, num_prompts: int, *, tokenizer: Any, vocab_size: int, max_model_len: int,
                   dataset_path: Optional[str] = None, input_len: int = 512, output_len: int = 128,
                   range_ratio: float = 0.0, max_input_len: Optional[int] = None,
                   max_output_len: Optional[int] = None, length_scale: float = 1.0, start: int = 0,
                   text_prompts: bool = False, seed: int = 0, prefix_len: int = 256, suffix_len: int = 32,
                   num_prefixes: int = 4) -> list[BenchRequest]:
    """Build the benchmark's requests.

    Args:
        dataset: One of ``DATASETS``.
        num_prompts: How many requests.
        tokenizer: A ``transformers`` tokenizer (``encode``/``decode``); only the text datasets and
            ``text_prompts`` use it.
        vocab_size: Token ids of synthetic prompts are drawn from ``[256, vocab_size)``.
        max_model_len: The server's context length; every request fits in it.
        dataset_path: File of ``sharegpt-file``/``jsonl`` (or another Mooncake-format trace).
        input_len, output_len, range_ratio: Lengths of the ``random`` dataset (``output_len`` is also
            ``prefix-repetition``'s output length).
        max_input_len, max_output_len: Clip prompt / output lengths (tokens); ``prefix-repetition`` ignores them.
        length_scale: Mooncake length multiplier.
        start: First row of a trace.
        text_prompts: Decode synthetic token ids to text (for the chat endpoint).
        seed: Seed of lengths and synthetic prompts.
        prefix_len, suffix_len, num_prefixes: ``prefix-repetition``: tokens of each shared prefix, tokens of
            each request's own suffix, and how many distinct prefixes (see :func:`prefix_repetition`).

    Raises:
        ValueError: for an unknown dataset, a missing ``dataset_path``, a short file, or ``prefix-repetition``
            lengths that are below 1 or do not fit in ``max_model_len`` (see :func:`prefix_repetition`).
    """
    if dataset not in DATASETS:
        raise ValueError(f"unknown dataset {dataset!r}; choose from {DATASETS}")
    if num_prompts < 1:
        raise ValueError(f"num_prompts must be >= 1, got {num_prompts}")
    if dataset in ("sharegpt-file", "jsonl"):
        if not dataset_path:
            raise ValueError(f"--dataset {dataset} needs --dataset-path")
        if dataset == "sharegpt-file":
            return load_sharegpt(dataset_path, num_prompts, tokenizer, max_model_len, max_input_len, max_output_len)
        return load_jsonl(dataset_path, num_prompts, tokenizer, vocab_size, seed)
    if dataset == "code-copy":
        from goodserve.bench.grounded import build_code_copy

        rows = build_code_copy(num_prompts, tokenizer, max_model_len, max_input_len or 1024, max_output_len or 256,
                               seed)
        return [BenchRequest(prompt, n_in, n_out) for prompt, n_in, n_out in rows]
    if dataset == "prefix-repetition":
        ids = prefix_repetition(num_prompts, prefix_len, suffix_len, num_prefixes, output_len, vocab_size,
                                max_model_len, seed)
        return [BenchRequest(tokenizer.decode(list(p)) if text_prompts else p, len(p), output_len) for p in ids]
    if dataset == "mooncake":
        rows = load_mooncake(num_prompts, length_scale, start, dataset_path)
        clipped = clip_specs([s for s, _ in rows], max_model_len, max_input_len, max_output_len)
        block = max(1, round(MOONCAKE_BLOCK * length_scale))
        specs = synthesise_shared_prompts(list(zip(clipped, (h for _, h in rows))), vocab_size, block, seed)
    else:
        if dataset == "random":
            specs = random_lengths(num_prompts, input_len, output_len, range_ratio, seed)
        else:
            specs = load_azure(dataset, num_prompts, max_model_len, start)
        specs = synthesise_prompts(clip_specs(specs, max_model_len, max_input_len, max_output_len),
                                   vocab_size, seed, SPECIAL_IDS)
    out = []
    for s in specs:
        prompt: Union[str, tuple[int, ...]] = s.prompt_token_ids or ()
        if text_prompts:
            prompt = tokenizer.decode(list(prompt))
        out.append(BenchRequest(prompt, s.prompt_len, s.output_len, s.arrival))
    return out
