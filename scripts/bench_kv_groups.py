#!/usr/bin/env python
"""KV-cache groups against one full group, on a model mixing local and global layers, at the same KV memory.

The model is a random-weight Gemma 3 text checkpoint made here with transformers (nothing downloaded): 12 layers,
every sixth global (2 global, 10 local with a window of ``--window`` tokens), hidden 256, 4 query and 2 KV heads
of 64, the SmolLM2 tokenizer's vocabulary. Its memory behaviour is the real model family's; its tokens are noise,
so prompts are random token ids (distinct per request: no prefix hits) and every request decodes ``--max-tokens``.

For each setting, one after the other in the same process (``grouped``: the engine's default hybrid layout;
``one-group``: ``disable_hybrid_kv_cache_manager``), all ``--requests`` requests arrive at once and the engine
steps until they finish. Reported: pool blocks, the pool's max concurrency at the request length (the spec's
formula), the most requests running at once, preemptions, wall time and output tokens per second.

Usage: flock /tmp/goodserve-bench.lock scripts/bench_kv_groups.py [--out result.json]
"""

from __future__ import annotations

import argparse
import json
import random
import tempfile
import time
from pathlib import Path

from goodserve.llm import LLM
from goodserve.sampling_params import SamplingParams


def make_model(out: Path, window: int) -> str:
    """Save the random Gemma 3 checkpoint under ``out`` and return its directory."""
    import torch
    from transformers import AutoModelForCausalLM, Gemma3TextConfig, PreTrainedTokenizerFast

    from goodserve.models.loader import default_model_path

    gguf = Path(default_model_path())  # the default model's tokenizer, read from its GGUF
    layer_types = ["full_attention" if (i + 1) % 6 == 0 else "sliding_attention" for i in range(12)]
    config = Gemma3TextConfig(vocab_size=49152, hidden_size=256, intermediate_size=1024, num_hidden_layers=12,
                              num_attention_heads=4, num_key_value_heads=2, head_dim=64, sliding_window=window,
                              max_position_embeddings=8192, layer_types=layer_types)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.save_pretrained(out)
    PreTrainedTokenizerFast.from_pretrained(str(gguf.parent), gguf_file=gguf.name).save_pretrained(out)
    return str(out)


def run(model_dir: str, grouped: bool, args: argparse.Namespace) -> dict:
    """Serve the workload once; the setting's numbers."""
    llm = LLM(model_dir, dtype="float32", kv_cache_memory=args.kv_cache_memory, block_size=16,
              max_num_batched_tokens=args.budget, max_num_seqs=args.requests, log_stats_interval=0,
              disable_hybrid_kv_cache_manager=not grouped)
    engine = llm.engine
    scheduler = engine.core.scheduler
    rng = random.Random(0)
    params = SamplingParams(temperature=0, max_tokens=args.max_tokens, ignore_eos=True)
    for _ in range(args.requests):
        engine.add_request([rng.randrange(1000, 40000) for _ in range(args.prompt_len)], params)
    t0, peak, tokens = time.perf_counter(), 0, 0
    while scheduler.has_unfinished_requests():
        for out in engine.step():
            tokens += len(out.outputs[0].token_ids)
        peak = max(peak, len(scheduler.running))
    wall = time.perf_counter() - t0
    config = engine.config
    spec = config.model.kv_cache_spec(config.kv_dtype, config.cache.hybrid)
    length = args.prompt_len + args.max_tokens
    return dict(setting="grouped" if grouped else "one-group", groups=len(config.cache.group_windows),
                num_blocks=config.cache.num_blocks, pool_bytes=engine.core.runner.kv_cache_bytes,
                max_concurrency=round(engine.core.runner.kv_cache_bytes / spec.bytes_for_request(length, 16), 2),
                peak_running=peak, preemptions=scheduler.num_preemptions_total, wall_s=round(wall, 2),
                output_tok_s=round(tokens / wall, 1))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--requests", type=int, default=16)
    p.add_argument("--prompt-len", type=int, default=2048)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--window", type=int, default=256)
    p.add_argument("--budget", type=int, default=512, help="max_num_batched_tokens")
    p.add_argument("--kv-cache-memory", type=int, default=96 * 2**20, help="bytes")
    p.add_argument("--out", default=None)
    args = p.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = make_model(Path(tmp) / "gemma3-random", args.window)
        results = [run(model_dir, grouped, args) for grouped in (True, False)]
    for r in results:
        print(json.dumps(r))
    g, one = results
    print(f"grouped / one-group: max concurrency x{g['max_concurrency'] / one['max_concurrency']:.2f}, "
          f"peak running x{g['peak_running'] / one['peak_running']:.2f}, "
          f"output tok/s x{g['output_tok_s'] / one['output_tok_s']:.2f}")
    if args.out:
        Path(args.out).write_text(json.dumps(dict(args=vars(args), results=results), indent=2) + "\n")


if __name__ == "__main__":
    main()
