#!/usr/bin/env python
"""Accuracy of a quantized KV cache against a reference cache dtype, on real text.

Every prompt is a chat turn asking to explain a paragraph of the Python standard library's own module
docstrings (always on the machine, nothing downloaded; the first ``--num-prompts`` modules with a long
enough docstring, in sorted order). Each KV dtype generates ``--max-tokens`` greedy tokens per prompt
(``ignore_eos``), all prompts batched as a server would.

Reported per dtype against the reference:
  * teacher-forced greedy-token agreement: the reference's sequences (prompt + its greedy output) are scored
    again with each KV dtype in chunks of ``--chunk`` tokens (``max_num_batched_tokens``, prefix caching off),
    so every chunk reads its context from the cache as a decode does; the share of output positions whose
    top-1 token equals the reference's, and the mean |Δ logprob| of the reference's token there;
  * free-running agreement, the strictest view: the share of generated tokens before each prompt's first
    divergence (after it the contexts differ and nothing is compared), and the share of identical outputs.

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


def score(args: argparse.Namespace, dtype: str, seqs: list[list[int]], prompt_lens: list[int]) -> list[list[tuple]]:
    """Per output position of each sequence, ``(logprob of the sequence's token, top-1 token id)`` with
    ``dtype`` KV, the sequence prefilled in chunks of ``args.chunk`` tokens that read their context from the
    cache."""
    llm = LLM(args.model, kv_cache_dtype=dtype, dtype=args.dtype, max_num_batched_tokens=args.chunk,
              enable_prefix_caching=False)
    outs = llm.generate(seqs, SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=1), use_tqdm=False)
    return [[(lp, top[0][0]) for lp, top in o.prompt_logprobs[n:]] for o, n in zip(outs, prompt_lens)]


def compare(ref: dict, other: dict, ref_scored: list, other_scored: list) -> dict:
    """Agreement and mean |Δ logprob| of ``other`` against ``ref`` (see the module docstring)."""
    agreed = total = identical = 0
    for rt, ot in zip(ref["tokens"], other["tokens"]):
        total += len(rt)
        n = next((i for i, (a, b) in enumerate(zip(rt, ot)) if a != b), min(len(rt), len(ot)))
        agreed += n
        identical += n == len(rt) == len(ot)
    pairs = [(a, b) for ra, rb in zip(ref_scored, other_scored) for a, b in zip(ra, rb)]
    return {"dtype": other["dtype"], "reference": ref["dtype"], "prompts": len(ref["tokens"]), "tokens": total,
            "teacher_forced_agreement": sum(a[1] == b[1] for a, b in pairs) / len(pairs),
            "mean_abs_dlogprob": sum(abs(a[0] - b[0]) for a, b in pairs) / len(pairs),
            "max_abs_dlogprob": max(abs(a[0] - b[0]) for a, b in pairs),
            "free_running_agreement": agreed / total, "identical_outputs": identical / len(ref["tokens"]),
            "seconds": other["seconds"], "reference_seconds": ref["seconds"]}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=None, help="GGUF file or HF directory (default: the default model)")
    p.add_argument("--dtype", default="auto", help="compute --dtype of every run (default: auto)")
    p.add_argument("--reference", default="bfloat16", help="reference --kv-cache-dtype (default: bfloat16)")
    p.add_argument("--dtypes", default="int8", help="comma-separated --kv-cache-dtype values to compare")
    p.add_argument("--num-prompts", type=int, default=50)
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--chunk", type=int, default=16, help="prefill chunk (tokens) of the teacher-forced scoring")
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
    seqs = [p + t for p, t in zip(prompts, ref["tokens"])]
    lens = [len(p) for p in prompts]
    ref_scored = score(args, args.reference, seqs, lens)
    results = []
    for d in args.dtypes.split(","):
        free = run(engine(d), d, prompts, args)
        results.append(compare(ref, free, ref_scored, score(args, d, seqs, lens)))
    for r in results:
        print(f"{r['dtype']} vs {r['reference']}: {r['prompts']} prompts x {args.max_tokens} tokens; teacher-forced: "
              f"top-1 agreement {r['teacher_forced_agreement']:.2%}, mean |dlogprob| {r['mean_abs_dlogprob']:.4f} "
              f"(max {r['max_abs_dlogprob']:.3f}); free-running: {r['free_running_agreement']:.1%} of tokens before "
              f"the first divergence, {r['identical_outputs']:.0%} identical outputs; "
              f"{r['seconds']:.1f} s vs {r['reference_seconds']:.1f} s")
    if args.out:
        Path(args.out).write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
