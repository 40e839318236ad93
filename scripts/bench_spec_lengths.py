"""Speculation lengths in a closed batch: n-gram ``auto`` against fixed lengths, in one process, one after another.

Each length runs the same code-copy requests (``goodserve.bench.grounded``) submitted at once, at most
``--max-num-seqs`` running, greedy, output lengths forced, on the default model in bfloat16 with
batch-invariant kernels (a server's default on a host with AMX); reports output tokens/s, and for ``auto`` the
lengths it chose (steps with and without a prompt chunk; a step chosen again after a preemption counts once),
its acceptance rates and learned draft costs. Run it under ``flock /tmp/goodserve-bench.lock`` (BENCHMARKS.md,
issue 33).
"""

from __future__ import annotations

import argparse
import collections
import inspect
import json
import time

from goodserve.bench.grounded import build_code_copy
from goodserve.llm import LLM
from goodserve.sampling_params import SamplingParams


def run(length: str, num: int, seqs: int, seed: int, k_max: int) -> dict:
    """One length's run: output tokens/s, and what ``auto`` chose."""
    config = json.dumps({"method": "ngram", "num_speculative_tokens": k_max})
    llm = LLM(None, speculative_config=config, speculative_length=length, batch_invariant=True, dtype="bfloat16",
              max_num_seqs=seqs, log_stats_interval=0)
    specs = build_code_copy(num + 1, llm.get_tokenizer(), 4096, seed=seed)
    spec = llm.engine.core.scheduler.speculator
    chosen: collections.Counter = collections.Counter()
    begin, signature = spec.begin_step, inspect.signature(spec.begin_step)

    def counted(*args, **kwargs):
        begin(*args, **kwargs)
        bound = signature.bind(*args, **kwargs).arguments
        if not bound.get("again", False):
            chosen[f"k={spec.length}{' +chunk' if bound.get('prompt_tokens', 0) > 0 else ''}"] += 1

    spec.begin_step = counted
    llm.generate([specs[0][0]], SamplingParams(max_tokens=16, temperature=0), use_tqdm=False)  # warm up
    chosen.clear()
    params = [SamplingParams(max_tokens=o, temperature=0, ignore_eos=True) for _, _, o in specs[1:]]
    start = time.perf_counter()
    outs = llm.generate([p for p, _, _ in specs[1:]], params, use_tqdm=False)
    seconds = time.perf_counter() - start
    tokens = sum(len(o.outputs[0].token_ids) for o in outs)
    costs, beside = spec.cost.costs(), spec.cost_beside.costs()
    return dict(length=length, out_tok_s=tokens / seconds, seconds=seconds, steps=dict(sorted(chosen.items())),
                run_positions=spec.run_positions, lower_rates=[round(r, 3) for r in spec.stats.lower_rates()],
                costs_ms=costs and [round(c * 1e3, 3) for c in costs],
                beside_ms=beside and [round(c * 1e3, 3) for c in beside])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--lengths", default="auto,4,8", help="comma-separated: auto or a fixed number of drafts")
    ap.add_argument("--num-prompts", type=int, default=32)
    ap.add_argument("--max-num-seqs", type=int, default=16)
    ap.add_argument("--k-max", type=int, default=8, help="num_speculative_tokens")
    ap.add_argument("--rounds", type=int, default=1, help="rounds over the lengths (each its own prompts)")
    ap.add_argument("--out", help="write the results as JSON here")
    args = ap.parse_args()
    results = []
    for seed in range(args.rounds):
        for length in args.lengths.split(","):
            r = run(length, args.num_prompts, args.max_num_seqs, seed, args.k_max)
            results.append(dict(round=seed, **r))
            print(json.dumps(results[-1]), flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
