"""``goodserve bench micro``: step times read against this machine's limits, measured in the same run.

- Decode step time at batch 1 and 64 against the memory-bandwidth bound: weight bytes read per step
  divided by the GEMV bandwidth measured here (gpt-fast's way of reading tokens/s against GB/s).
- Prefill tokens/s for one 1024-token prompt against the matmul FLOP/s measured here (MFU).
"""

from __future__ import annotations

import argparse
import json
import time

import torch
import torch.nn.functional as F

from goodserve.engine.args import EngineArgs


def add_micro_parser(sub) -> None:
    """Register ``bench micro`` on an argparse subparsers object."""
    p = sub.add_parser("micro", help="decode step vs bandwidth bound, prefill vs matmul FLOP/s")
    p.add_argument("--prefill-len", type=int, default=1024)
    p.add_argument("--decode-batches", default="1,64")
    p.add_argument("--decode-context", type=int, default=128, help="prompt tokens of each decoding request")
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--output-json", default=None)
    EngineArgs.add_cli_args(p)
    p.set_defaults(func=run_micro, max_num_batched_tokens=2048)


def _best_time(fn, repeat: int = 10) -> float:
    fn()
    best = float("inf")
    for _ in range(repeat):
        t = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t)
    return best


def measure_gemv_bandwidth(dtype: torch.dtype, mib: int = 256) -> float:
    """Effective bytes/s of a batch-1 matrix-vector product over a ``mib``-MiB weight matrix."""
    k = 4096
    n = mib * 2**20 // (k * torch.tensor([], dtype=dtype).element_size())
    w = torch.randn(n, k).to(dtype)
    x = torch.randn(1, k).to(dtype)
    t = _best_time(lambda: F.linear(x, w))
    return w.numel() * w.element_size() / t


def measure_matmul_flops(dtype: torch.dtype, n: int = 2048) -> float:
    """FLOP/s of an ``n x n x n`` matmul."""
    a, b = torch.randn(n, n).to(dtype), torch.randn(n, n).to(dtype)
    t = _best_time(lambda: a @ b, repeat=5)
    return 2 * n**3 / t


def weight_bytes_per_step(model) -> tuple[int, int]:
    """``(bytes of weights a batch-1 decode step reads, parameters of the linear layers)``.

    Every linear layer counts, the LM head included: quantized ones their codes and scales (what the kernel
    reads), prepacked ones their packed weight, others their weight. Norms are left out (a few KB); the
    input embedding is a lookup of one row.
    """
    from goodserve.models.invariant import InvariantLinear
    from goodserve.models.linear import PackedLinear
    from goodserve.models.quant import QuantLinear

    weight_bytes = linear_params = 0
    for module in model.modules():
        if isinstance(module, (QuantLinear, PackedLinear, InvariantLinear)):
            weight_bytes += module.nbytes
        elif isinstance(module, torch.nn.Linear):
            weight_bytes += module.weight.numel() * module.weight.element_size()
        else:
            continue
        linear_params += module.in_features * module.out_features
    return weight_bytes, linear_params


def run_micro(args: argparse.Namespace) -> int:
    """Measure and print; returns an exit code."""
    from goodserve.llm import LLM
    from goodserve.models.quant import make_dense_copies
    from goodserve.runner.model_runner import DTYPES
    from goodserve.sampling_params import SamplingParams

    eargs = EngineArgs.from_cli_args(args)
    eargs.log_stats_interval = 0
    llm = LLM(**vars(eargs))
    engine = llm.engine
    dtype = DTYPES[engine.config.dtype]
    model = engine.core.runner.model
    make_dense_copies(model)  # as a server does before its first step: no measured step makes them
    weight_bytes, linear_params = weight_bytes_per_step(model)
    bandwidth = measure_gemv_bandwidth(dtype)
    flops = measure_matmul_flops(dtype)
    result = {"dtype": engine.config.dtype, "quantization": eargs.quantization, "weight_bytes": weight_bytes, "gemv_bandwidth_GBps": bandwidth / 1e9,
              "matmul_TFLOPs": flops / 1e12, "decode": [], "threads": torch.get_num_threads()}
    bound = weight_bytes / bandwidth
    print(f"weights read per decode step: {weight_bytes / 1e6:.1f} MB; GEMV bandwidth {bandwidth / 1e9:.1f} GB/s "
          f"-> bound {bound * 1e3:.2f} ms/step; matmul {flops / 1e9:.0f} GFLOP/s ({engine.config.dtype}, "
          f"quantization {eargs.quantization})")

    vocab = engine.config.model.vocab_size
    for batch in (int(b) for b in args.decode_batches.split(",")):
        params = SamplingParams(temperature=0, max_tokens=args.steps + 8, ignore_eos=True)
        for i in range(batch):
            engine.add_request([256 + (i * 7 + j) % (vocab - 256) for j in range(args.decode_context)], params)
        while engine.make_stats().num_tokens_waiting:  # until every prompt is in and sampled its first token
            engine.step()
        times = []
        for _ in range(args.steps):
            t = time.perf_counter()
            engine.step()
            times.append(time.perf_counter() - t)
        engine.abort_all()
        step = sorted(times)[len(times) // 2]
        mean = sum(times) / len(times)  # llama-batched-bench's figure: generation time over tokens
        result["decode"].append({"batch": batch, "step_ms": step * 1e3, "mean_step_ms": mean * 1e3,
                                 "bound_ms": bound * 1e3, "ratio_to_bound": step / bound, "tok_s": batch / step,
                                 "mean_tok_s": batch / mean})
        print(f"decode batch {batch:>3}: {step * 1e3:7.2f} ms/step = {step / bound:.2f}x the bound, "
              f"{batch / step:8.1f} tok/s (mean over contexts {args.decode_context}->"
              f"{args.decode_context + args.steps}: {mean * 1e3:.2f} ms/step, {batch / mean:.1f} tok/s)")

    n = args.prefill_len
    prompt = [256 + (j * 13) % (vocab - 256) for j in range(n)]
    times = []
    for _ in range(3):
        engine.add_request(prompt, SamplingParams(temperature=0, max_tokens=1))
        t = time.perf_counter()
        while engine.has_unfinished_requests():
            engine.step()
        times.append(time.perf_counter() - t)
        engine.reset_prefix_cache()
    t = min(times)
    c = engine.config.model
    attn_flops = 2 * 2 * c.num_hidden_layers * c.num_attention_heads * c.head_dim * n * n / 2
    head = c.hidden_size * c.vocab_size  # the LM head runs on the last token only
    prefill_flops = 2 * (linear_params - head) * n + attn_flops + 2 * head
    mfu = prefill_flops / t / flops
    result["prefill"] = {"tokens": n, "seconds": t, "tok_s": n / t, "flops": prefill_flops, "mfu": mfu}
    print(f"prefill {n} tokens: {t * 1e3:.0f} ms = {n / t:.0f} tok/s, {prefill_flops / t / 1e9:.0f} GFLOP/s "
          f"= {100 * mfu:.0f}% of measured matmul FLOP/s")
    if args.output_json:
        with open(args.output_json, "w") as f:
            json.dump(result, f, indent=2)
    return 0
