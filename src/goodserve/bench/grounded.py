"""An input-grounded workload, the kind speculation by prompt lookup serves: a real source file in the
prompt, and an output that reproduces it (code completion of a given file, an edit that keeps most lines).

Lengths follow the shipped ``azure-code`` trace (Patel et al., "Splitwise", ISCA 2024; CC-BY 4.0): each
request takes a row's prompt length, clipped; half of it is a snippet of real code, the Python standard
library's own sources (always on the machine, nothing downloaded; one module per request, chosen by the
seed). The prompt shows the snippet, asks for it again and opens the copy; the output is forced
(``ignore_eos``) to the snippet's length, clipped.
"""

from __future__ import annotations

import random
import sysconfig
from pathlib import Path
from typing import Any

from goodserve.workload.datasets import clip_specs, load_azure

HEADER = "Here is a Python file:\n\n```python\n"
ASK = "\n```\n\nThe same file, copied exactly:\n\n```python\n"


def stdlib_sources(limit: int = 400) -> list[Path]:
    """Python files of the standard library, sorted (the same list on every run of one Python)."""
    root = Path(sysconfig.get_paths()["stdlib"])
    files = sorted(p for p in root.glob("*.py") if p.stat().st_size > 4000)
    return files[:limit]


def build_code_copy(num_prompts: int, tokenizer: Any, max_model_len: int, max_input_len: int = 1024,
                    max_output_len: int = 256, seed: int = 0) -> list[tuple[str, int, int]]:
    """``(prompt text, prompt tokens, output tokens)`` per request.

    Raises:
        ValueError: if the standard library's sources are not found.
    """
    files = stdlib_sources()
    if not files:
        raise ValueError("code-copy needs the Python standard library's sources (none found)")
    specs = clip_specs(load_azure("azure-code", num_prompts, max_model_len), max_model_len, max_input_len,
                       max_output_len)
    rng = random.Random(seed)
    overhead = len(tokenizer.encode(HEADER + ASK, add_special_tokens=False))
    out = []
    for spec in specs:
        source = rng.choice(files).read_text(errors="replace")
        ids = tokenizer.encode(source, add_special_tokens=False)
        budget = max(16, (spec.prompt_len - overhead) // 2)
        snippet = tokenizer.decode(ids[:budget])
        prompt = HEADER + snippet + ASK
        out.append((prompt, len(tokenizer.encode(prompt, add_special_tokens=False)), min(budget, max_output_len)))
    return out
