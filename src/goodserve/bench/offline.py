"""``goodserve bench offline``: in-process throughput through ``LLM.generate``, against HF static batches.

All requests are submitted at once; output lengths are forced (``ignore_eos``). The HF baseline runs the
same requests (or the first ``--hf-num-prompts`` of them) in the same process, so the result is a ratio
measured on one machine in one run.
"""

from __future__ import annotations

import argparse
import json
import logging
import time
from dataclasses import asdict

from goodserve.engine.args import EngineArgs
from goodserve.workload.datasets import AZURE_FILES, load_azure, random_lengths, synthesise_prompts

logger = logging.getLogger(__name__)


def add_offline_parser(sub) -> None:
    """Register ``bench offline`` on an argparse subparsers object."""
    p = sub.add_parser("offline", help="in-process throughput via LLM.generate (+ HF static-batch baseline)")
    p.add_argument("--dataset", default="azure-conv", choices=sorted(AZURE_FILES) + ["random"])
    p.add_argument("--num-prompts", type=int, default=256)
    p.add_argument("--input-len", type=int, default=1024, help="random dataset: prompt tokens")
    p.add_argument("--output-len", type=int, default=128, help="random dataset: output tokens")
    p.add_argument("--hf-baseline", action="store_true", help="also run HF transformers static batches")
    p.add_argument("--hf-num-prompts", type=int, default=None, help="HF runs only the first N requests")
    p.add_argument("--hf-batch-sizes", default="16,32", help="comma-separated; the best is reported")
    p.add_argument("--output-json", default=None)
    EngineArgs.add_cli_args(p)
    p.set_defaults(func=run_offline)


def run_offline(args: argparse.Namespace) -> int:
    """Run the benchmark and print a summary table; returns an exit code."""
    import torch

    from goodserve.llm import LLM
    from goodserve.sampling_params import SamplingParams

    eargs = EngineArgs.from_cli_args(args)
    llm = LLM(**vars(eargs))
    engine = llm.engine
    max_len = engine.max_model_len
    if args.dataset == "random":
        specs = random_lengths(args.num_prompts, args.input_len, args.output_len)
    else:
        specs = load_azure(args.dataset, args.num_prompts, max_len)
    specs = synthesise_prompts(specs, engine.config.model.vocab_size)
    params = [SamplingParams(temperature=0.0, max_tokens=s.output_len, ignore_eos=True) for s in specs]
    prompt_tokens = sum(s.prompt_len for s in specs)
    output_tokens = sum(s.output_len for s in specs)
    print(f"{len(specs)} requests: {prompt_tokens} prompt + {output_tokens} output tokens "
          f"(mean {prompt_tokens / len(specs):.0f} / {output_tokens / len(specs):.0f})")

    start = time.perf_counter()
    outs = llm.generate([list(s.prompt_token_ids) for s in specs], params)
    elapsed = time.perf_counter() - start
    assert sum(len(o.token_ids) for o in outs) == output_tokens
    result = {"engine": {"elapsed_s": elapsed, "requests": len(specs), "output_tok_s": output_tokens / elapsed,
                         "total_tok_s": (prompt_tokens + output_tokens) / elapsed,
                         "preemptions": engine.make_stats().num_preemptions_total,
                         "dtype": engine.config.dtype, "max_num_batched_tokens": eargs.max_num_batched_tokens,
                         "max_num_seqs": eargs.max_num_seqs}}
    rows = [("goodserve", len(specs), elapsed, output_tokens / elapsed, (prompt_tokens + output_tokens) / elapsed)]

    if args.hf_baseline:
        from goodserve.bench.hf_baseline import build_hf_model, run_static_batches
        from goodserve.runner.model_runner import DTYPES

        hf_specs = specs[: args.hf_num_prompts or len(specs)]
        del llm, engine
        model = build_hf_model(engine_path(eargs), DTYPES[result["engine"]["dtype"]])
        best = None
        for bs in (int(x) for x in args.hf_batch_sizes.split(",")):
            r = run_static_batches(model, hf_specs, bs)
            rows.append((f"HF generate, static b{bs}", r.num_requests, r.elapsed, r.output_throughput,
                         r.total_throughput))
            result.setdefault("hf", []).append(asdict(r) | {"output_tok_s": r.output_throughput,
                                                            "total_tok_s": r.total_throughput})
            if best is None or r.output_throughput > best.output_throughput:
                best = r
        result["ratio_output_tok_s"] = result["engine"]["output_tok_s"] / best.output_throughput
        result["ratio_total_tok_s"] = result["engine"]["total_tok_s"] / best.total_throughput
    print(f"\n{'system':<26} {'requests':>8} {'elapsed s':>10} {'output tok/s':>13} {'total tok/s':>12}")
    for name, n, t, o, tot in rows:
        print(f"{name:<26} {n:>8} {t:>10.1f} {o:>13.1f} {tot:>12.1f}")
    if "ratio_output_tok_s" in result:
        print(f"\ngoodserve / best HF: output tok/s x{result['ratio_output_tok_s']:.2f}, "
              f"total tok/s x{result['ratio_total_tok_s']:.2f}")
    print(f"torch {torch.__version__}, threads {torch.get_num_threads()}")
    if args.output_json:
        with open(args.output_json, "w") as f:
            json.dump(result, f, indent=2)
    return 0


def engine_path(eargs: EngineArgs) -> str:
    """The model path the engine serves (the default model when none was given)."""
    from goodserve.models.loader import default_model_path

    return eargs.model or default_model_path()
