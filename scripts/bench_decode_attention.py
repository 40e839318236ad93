"""Decode attention over the paged KV cache: the portable PyTorch backend (gather, then fused SDPA) against
the native CPU kernel (blocks read in place), in one process, alternating call by call so that both see the
same machine (issue 15, part 3).

Two measurements, bf16, the default model's shapes (9 query heads, 3 KV heads, head_dim 64, 16-token blocks):

1. One layer's attention call (``AttentionBackend.__call__``: KV write + attention) on scattered blocks, at
   batch 1 and 64 and 1k and 4k tokens of context (plus batch 16 at 384, a serving shape).
2. Whole decode steps of the default model (``Engine.step``), the runner's backend swapped step by step.

Usage (under the benchmark lock)::

    flock /tmp/goodserve-bench.lock .venv/bin/python scripts/bench_decode_attention.py [--steps 30]
"""

from __future__ import annotations

import argparse
import random
import statistics
import time

import torch

from goodserve.models.attention import AttentionMetadata, NativeAttentionBackend, TorchAttentionBackend

LAYER_SHAPES = [(1, 1024), (1, 4096), (16, 384), (64, 1024), (64, 4096)]
STEP_SHAPES = [(1, 1024), (1, 4096), (16, 384), (16, 1024), (64, 1024)]


def _alternate(fns: dict, rounds: int) -> dict:
    """Median seconds of each callable, called in turn ``rounds`` times after one warm-up round."""
    times = {name: [] for name in fns}
    for r in range(rounds + 1):
        for name, fn in fns.items():
            t = time.perf_counter()
            fn()
            if r:
                times[name].append(time.perf_counter() - t)
    return {name: statistics.median(v) for name, v in times.items()}


def layer_calls(rounds: int) -> None:
    bs, heads, kv, d = 16, 9, 3, 64
    print("one layer's decode attention, ms per call (KV write included), bf16, scattered blocks")
    print(f"{'batch':>5} {'context':>7} {'torch':>8} {'native':>8} {'torch/native':>12}")
    for n, ctx in LAYER_SHAPES:
        per = -(-ctx // bs)
        ids = list(range(n * per + 1))
        random.Random(0).shuffle(ids)
        tables = [ids[i * per:(i + 1) * per] for i in range(n)]
        k_cache = torch.randn(n * per + 1, bs, kv, d).bfloat16()
        v_cache = torch.randn_like(k_cache)
        slots = torch.tensor([t[(ctx - 1) // bs] * bs + (ctx - 1) % bs for t in tables])
        q = torch.randn(n, heads, d).bfloat16()
        k, v = torch.randn(n, kv, d).bfloat16(), torch.randn(n, kv, d).bfloat16()
        fns = {}
        for backend in (TorchAttentionBackend(), NativeAttentionBackend()):
            meta = AttentionMetadata.build(bs, tables, [ctx] * n, [], slots, torch.device("cpu"),
                                           decode_groups=backend.uses_decode_groups)
            fns[type(backend).__name__] = (lambda b=backend, m=meta: b(q, k, v, k_cache, v_cache, m))
        t = _alternate(fns, rounds)
        a, b = t["TorchAttentionBackend"] * 1e3, t["NativeAttentionBackend"] * 1e3
        print(f"{n:>5} {ctx:>7} {a:>8.3f} {b:>8.3f} {a / b:>11.2f}x", flush=True)


def engine_steps(steps: int) -> None:
    from goodserve.llm import LLM
    from goodserve.sampling_params import SamplingParams

    engine = LLM(num_blocks=max(n * (-(-ctx // 16) + 8) for n, ctx in STEP_SHAPES)).engine
    runner = engine.core.runner
    vocab = engine.config.model.vocab_size
    backends = {"torch": TorchAttentionBackend(), "native": NativeAttentionBackend()}
    print("decode step of the default model (Q4_1 GGUF, bf16, --quantization auto), ms, backends alternating")
    print(f"{'batch':>5} {'context':>7} {'torch':>8} {'native':>8} {'torch/native':>12}")
    for n, ctx in STEP_SHAPES:
        params = SamplingParams(temperature=0, max_tokens=steps + 8, ignore_eos=True)
        for i in range(n):
            engine.add_request([256 + (i * 7 + j) % (vocab - 256) for j in range(ctx)], params)
        while engine.make_stats().num_tokens_waiting:
            engine.step()

        def step(name: str) -> None:
            runner.attn = backends[name]
            engine.step()

        t = _alternate({name: (lambda nm=name: step(nm)) for name in backends}, steps // 2)
        engine.abort_all()
        a, b = t["torch"] * 1e3, t["native"] * 1e3
        print(f"{n:>5} {ctx:>7} {a:>8.2f} {b:>8.2f} {a / b:>11.2f}x", flush=True)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=50, help="calls per backend per layer shape")
    p.add_argument("--steps", type=int, default=30, help="engine steps per shape (half per backend)")
    args = p.parse_args()
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads")
    layer_calls(args.rounds)
    engine_steps(args.steps)


if __name__ == "__main__":
    main()
