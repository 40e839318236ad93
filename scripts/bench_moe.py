"""Decode step time of a random-weight mixture of experts against the dense model of the same active parameters.

The MoE is Qwen3-30B-A3B's routing (128 experts, top 8, renormalised; per-head q/k norms) scaled to fit a small
CPU: hidden 512, 8 layers, expert width 192 (Qwen3-30B-A3B: hidden 2048, 48 layers, width 768, the same
width / hidden ratio), 8 query heads and 2 KV heads of 64. The dense model is a Llama with the same attention
and an MLP of width ``top_k * expert width`` (1536): the same MLP weights per token, 1/16 of the MoE's in all.
Both are written as GGUFs in one type (``--qtype``, default Q4_0: projections, experts and the tied embedding)
by :func:`goodserve.bench.random_gguf.write_random_gguf`, with a 512-token vocabulary (the LM head is
small beside the layers), and each runs twice in bfloat16: ``--quantization auto`` (the file's blocks on the
native block kernel: the MoE's experts per expert, :mod:`goodserve.models.moe_blocks`) and ``none`` (the
weights dequantized to dense bfloat16).

Decode: ``batch`` requests of ``--context`` prompt tokens are prefilled, then ``--steps`` decode steps are
timed; the table shows the mean step time (llama-batched-bench's: generation time over steps), the JSON
also the median. With
``--llama-bin DIR`` llama.cpp's ``llama-bench -p 0 -n 128 -t THREADS`` runs on the same two files (tg128,
batch 1).

Run (prints a markdown table, ``--json`` writes the results)::

    python scripts/bench_moe.py --steps 32 --json /tmp/bench_moe.json [--llama-bin DIR]
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import subprocess
import sys
import tempfile
import time

import torch


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--hidden", type=int, default=512)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--experts", type=int, default=128)
    p.add_argument("--top-k", type=int, default=8)
    p.add_argument("--moe-intermediate", type=int, default=192)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--kv-heads", type=int, default=2)
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--vocab", type=int, default=512)
    p.add_argument("--qtype", default="Q4_0", help="GGUF type of both files (a type gguf.quants writes)")
    p.add_argument("--batches", default="1,16,64")
    p.add_argument("--steps", type=int, default=32, help="timed decode steps per batch")
    p.add_argument("--context", type=int, default=64, help="prompt tokens of each request")
    p.add_argument("--threads", type=int, default=torch.get_num_threads())
    p.add_argument("--dir", default=None, help="where the GGUFs are written (default: a temporary folder)")
    p.add_argument("--llama-bin", default=None, help="llama.cpp's bin folder: also run llama-bench tg128")
    p.add_argument("--json", default=None, help="write the results here")
    return p.parse_args(argv)


def decode_step_ms(path: str, quantization: str, batches: list[int], steps: int, context: int,
                   vocab: int) -> tuple[dict[int, dict[str, float]], dict]:
    """Mean and median decode step time (ms) per batch of the GGUF at ``path`` in bfloat16, and what the model holds
    (expert layers on blocks, their bytes and dense copies after the run)."""
    from goodserve import LLM, SamplingParams
    from goodserve.models.moe_blocks import BlockExperts

    llm = LLM(path, dtype="bfloat16", quantization=quantization, log_stats_interval=0,
              num_blocks=max(batches) * -(-(context + steps + 8) // 16) + 16, block_size=16,
              max_num_seqs=max(batches), max_num_batched_tokens=max(2048, max(batches) * context))
    engine = llm.engine
    out = {}
    for batch in batches:
        params = SamplingParams(temperature=0, max_tokens=steps + 4, ignore_eos=True)
        for i in range(batch):
            engine.add_request([17 + (i * 7 + j * 13) % (vocab - 17) for j in range(context)], params)
        while engine.make_stats().num_tokens_waiting:  # every prompt in and its first token sampled
            engine.step()
        times = []
        for _ in range(steps):
            t = time.perf_counter()
            engine.step()
            times.append(time.perf_counter() - t)
        engine.abort_all()
        out[batch] = {"mean_ms": 1e3 * sum(times) / len(times), "median_ms": 1e3 * sorted(times)[len(times) // 2]}
    experts = [m for m in engine.core.runner.model.modules() if isinstance(m, BlockExperts)]
    held = {"expert_layers_on_blocks": len(experts), "expert_block_MB": sum(m.nbytes for m in experts) / 1e6,
            "expert_dense_copies": sum(m.dense_copies() for m in experts)}
    return out, held


def llama_bench(bin_dir: str, path: str, threads: int) -> float:
    """llama.cpp's tg128 tokens/s on ``path`` (``llama-bench -p 0 -n 128 -t threads -o json``)."""
    cmd = [os.path.join(bin_dir, "llama-bench"), "-m", path, "-p", "0", "-n", "128", "-t", str(threads), "-o", "json"]
    env = {**os.environ, "LD_LIBRARY_PATH": bin_dir + os.pathsep + os.environ.get("LD_LIBRARY_PATH", "")}
    run = subprocess.run(cmd, capture_output=True, text=True, env=env, check=True)
    return float(json.loads(run.stdout)[0]["avg_ts"])


def main(argv: list[str]) -> int:
    from goodserve.bench.random_gguf import RandomShape, write_random_gguf

    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    batches = [int(b) for b in args.batches.split(",")]
    common = dict(hidden=args.hidden, layers=args.layers, heads=args.heads, kv_heads=args.kv_heads,
                  head_dim=args.head_dim, vocab=args.vocab)
    shapes = {"moe": RandomShape(**common, experts=args.experts, top_k=args.top_k,
                                 moe_intermediate=args.moe_intermediate),
              "dense": RandomShape(**common, intermediate=args.top_k * args.moe_intermediate)}
    folder = args.dir or tempfile.mkdtemp(prefix="bench_moe-")
    os.makedirs(folder, exist_ok=True)
    command = "python scripts/bench_moe.py " + " ".join(shlex.quote(a) for a in argv)
    result = {"command": command, "threads": args.threads, "qtype": args.qtype, "steps": args.steps,
              "context": args.context, "models": {}}
    for name, shape in shapes.items():
        path = os.path.join(folder, f"{name}-{args.qtype}.gguf")
        if not os.path.exists(path):
            write_random_gguf(path, shape, qtype=args.qtype)
        entry = result["models"][name] = {"file": path, "file_MB": os.path.getsize(path) / 1e6,
                                          "active_mlp_params_per_layer": shape.active_mlp_params()}
        for quantization in ("auto", "none"):
            ms, held = decode_step_ms(path, quantization, batches, args.steps, args.context, args.vocab)
            entry[quantization] = {"step_ms": ms, **held}
        if args.llama_bin:
            entry["llama_bench_tg128_tok_s"] = llama_bench(args.llama_bin, path, args.threads)

    print(f"`{command}` ({args.threads} threads, {args.steps} timed steps after {args.context}-token prompts)\n")
    header = "| model | weights | " + " | ".join(f"batch {b} ms/step" for b in batches) + " |"
    print(header)
    print("|" + "---|" * (2 + len(batches)))
    for name, entry in result["models"].items():
        for quantization, label in (("auto", f"{args.qtype} blocks"), ("none", "bfloat16 dense")):
            ms = entry[quantization]["step_ms"]
            print(f"| {name} | {label} | " + " | ".join(f"{ms[b]['mean_ms']:.2f}" for b in batches) + " |")
        if "llama_bench_tg128_tok_s" in entry:
            tg = entry["llama_bench_tg128_tok_s"]
            print(f"| {name} | llama.cpp tg128 ({args.qtype}) | {1e3 / tg:.2f} |" + " |" * (len(batches) - 1))
    moe = result["models"]["moe"]["auto"]
    print(f"\nMoE on blocks: {moe['expert_layers_on_blocks']} expert layers, {moe['expert_block_MB']:.1f} MB of "
          f"expert blocks, {moe['expert_dense_copies']} dense expert copies after the run")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
