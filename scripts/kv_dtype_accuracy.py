#!/usr/bin/env python
"""Accuracy of a quantized KV cache against a reference cache dtype, on real text.

Every prompt is a chat turn asking to explain a paragraph of the Python standard library's own module
docstrings (always on the machine, nothing downloaded; the first ``--num-prompts`` modules with a long
enough docstring, in sorted order). Each KV dtype generates ``--max-tokens`` greedy tokens per prompt
(``ignore_eos``), all prompts batched as a server would.

Reported per dtype against the reference:
  * greedy agreement: the share of generated tokens, position by position, before each prompt's first
    divergence (a token after a divergence is in another context and is not compared), and the share of
    prompts whose whole output is identical;
  * mean |Δ logprob| of the chosen token over the positions where both runs had the same context (the
    common prefix), i.e. how far the quantized cache moves the model's confidence.

Usage: scripts/kv_dtype_accuracy.py --reference bfloat16 --dtypes int8 [--out result.json]
"""

from __future__ import annotations

import argparse
import ast
import json
import sysconfig
import time
from pathlib import Path

from goodserve.llm import LLM
from goodserve.sampling_params import SamplingParams


def docstring_paragraphs(count: int, min_chars: int = 300, max_chars: int = 900) -> list[str]:
    """``count`` docstring excerpts of ``min_chars``..``max_chars`` characters from the standard library."""
    out = []
    for path in sorted(Path(sysconfig.get_paths()["stdlib"]).glob("*.py")):
        try:
            doc = ast.get_docstring(ast.parse(path.read_text(encoding="utf-8")))
        except (SyntaxError, UnicodeDecodeError, ValueError):
            continue
        if doc and len(doc) >= min_chars:
            out.append(f"{path.stem}:\n{doc[:max_chars]}")
        if len(out) == count:
            return out
    raise SystemExit(f"only {len(out)} standard-library docstrings of >= {min_chars} characters")


def run(llm: LLM, dtype: str, prompts: list[list[int]], args: argparse.Namespace) -> dict:
    """Greedy outputs and chosen-token logprobs of every prompt on ``llm`` (an engine with ``dtype`` KV)."""
    params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens, ignore_eos=True, logprobs=1)
    t0 = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    seconds = time.perf_counter() - t0
    return {"dtype": dtype, "seconds": seconds,
            "tokens": [o.outputs[0].token_ids for o in outs], "logprobs": [o.outputs[0].logprobs for o in outs]}


def compare(ref: dict, other: dict) -> dict:
    """Agreement and mean |Δ logprob| of ``other`` against ``ref`` (see the module docstring)."""
    agreed = total = identical = 0
    deltas = []
    for rt, ot, rl, ol in zip(ref["tokens"], other["tokens"], ref["logprobs"], other["logprobs"]):
        total += len(rt)
        n = next((i for i, (a, b) in enumerate(zip(rt, ot)) if a != b), min(len(rt), len(ot)))
        agreed += n
        identical += n == len(rt) == len(ot)
        deltas += [abs(a - b) for a, b in zip(rl[:n], ol[:n])]
    return {"dtype": other["dtype"], "reference": ref["dtype"], "prompts": len(ref["tokens"]),
            "tokens": total, "agreement": agreed / total, "identical_outputs": identical / len(ref["tokens"]),
            "mean_abs_dlogprob": sum(deltas) / len(deltas) if deltas else 0.0,
            "seconds": other["seconds"], "reference_seconds": ref["seconds"]}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=None, help="GGUF file or HF directory (default: the default model)")
    p.add_argument("--dtype", default="auto", help="compute --dtype of every run (default: auto)")
    p.add_argument("--reference", default="bfloat16", help="reference --kv-cache-dtype (default: bfloat16)")
    p.add_argument("--dtypes", default="int8", help="comma-separated --kv-cache-dtype values to compare")
    p.add_argument("--num-prompts", type=int, default=50)
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--out", default=None, help="write the comparison as JSON here")
    args = p.parse_args()
    texts = docstring_paragraphs(args.num_prompts)
    engine = lambda dtype: LLM(args.model, kv_cache_dtype=dtype, dtype=args.dtype)  # noqa: E731
    ref_llm = engine(args.reference)
    tokenizer = ref_llm.get_tokenizer()
    prompts = [list(tokenizer.apply_chat_template(
        [{"role": "user", "content": f"Explain this in plain words:\n\n{t}"}], add_generation_prompt=True,
        tokenize=True, return_dict=False)) for t in texts]
    ref = run(ref_llm, args.reference, prompts, args)
    del ref_llm
    results = [compare(ref, run(engine(d), d, prompts, args)) for d in args.dtypes.split(",")]
    for r in results:
        print(f"{r['dtype']} vs {r['reference']}: {r['prompts']} prompts x {args.max_tokens} tokens, "
              f"greedy agreement {r['agreement']:.1%} (identical outputs {r['identical_outputs']:.0%}), "
              f"mean |dlogprob| {r['mean_abs_dlogprob']:.4f}; {r['seconds']:.1f} s vs {r['reference_seconds']:.1f} s")
    if args.out:
        Path(args.out).write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
