"""Serving-benchmark workloads: which prompts to send, how long each output must be, and (for traces) when.

Datasets:

* ``random`` — uniform lengths around ``--input-len`` / ``--output-len`` (``workloads.random_lengths``).
* ``azure-conv``, ``azure-code`` — the Azure LLM inference traces 2023 shipped with the package
  (``workloads.load_azure``; CC-BY 4.0, Patel et al., "Splitwise", ISCA 2024).
* ``mooncake`` — the Mooncake FAST'25 conversation trace shipped in ``workload/data/mooncake-fast25``
  (Apache-2.0; Qin et al., FAST 2025). Lengths are multiplied by ``length_scale`` and clipped to the
  context; prompts reproduce the trace's prefix sharing (the same hash id gives the same token block).
* ``sharegpt-file`` — a ShareGPT JSON file: the first human turn is the prompt, the first gpt turn's token
  length is the output length.
* ``jsonl`` — one JSON object per line: ``prompt`` (text or token ids, optional), ``prompt_len`` (optional
  when ``prompt`` is given), ``output_len``, and optionally ``arrival`` (seconds) or ``timestamp`` (ms).

Length-only datasets get random token-id prompts of the exact length (``/v1/completions`` accepts ids);
for the chat endpoint those ids are decoded to text, so the server's count may differ slightly.
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass, replace
from importlib import resources
from typing import Any, Optional, Sequence, Union

from goodserve.workload.datasets import AZURE_FILES, RequestSpec, load_azure, random_lengths, synthesise_prompts

DATASETS = ("random", *sorted(AZURE_FILES), "mooncake", "sharegpt-file", "jsonl")
MOONCAKE_BLOCK = 512  # tokens per hash id in the Mooncake trace
SPECIAL_IDS = 256  # lowest token ids are left out of synthetic prompts (special tokens live there)


@dataclass(frozen=True)
class BenchRequest:
    """One request of a serving benchmark.

    Attributes:
        prompt: Token ids (sent as-is to ``/v1/completions``) or text.
        prompt_len: Prompt length in tokens (of the ids; for text, as counted by the tokenizer).
        output_len: Forced output length in tokens (``max_tokens`` with ``ignore_eos``).
        arrival: The trace's arrival offset in seconds (0 for datasets without a clock).
    """

    prompt: Union[str, tuple[int, ...]]
    prompt_len: int
    output_len: int
    arrival: float = 0.0


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
                   text_prompts: bool = False, seed: int = 0) -> list[BenchRequest]:
    """Build the benchmark's requests.

    Args:
        dataset: One of ``DATASETS``.
        num_prompts: How many requests.
        tokenizer: A ``transformers`` tokenizer (``encode``/``decode``); only the text datasets and
            ``text_prompts`` use it.
        vocab_size: Token ids of synthetic prompts are drawn from ``[256, vocab_size)``.
        max_model_len: The server's context length; every request fits in it.
        dataset_path: File of ``sharegpt-file``/``jsonl`` (or another Mooncake-format trace).
        input_len, output_len, range_ratio: Lengths of the ``random`` dataset.
        max_input_len, max_output_len: Clip prompt / output lengths (tokens).
        length_scale: Mooncake length multiplier.
        start: First row of a trace.
        text_prompts: Decode synthetic token ids to text (for the chat endpoint).
        seed: Seed of lengths and synthetic prompts.

    Raises:
        ValueError: for an unknown dataset, a missing ``dataset_path`` or a short file.
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
