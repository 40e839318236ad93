"""``goodserve bench prefix``: what automatic prefix caching buys, caching off vs on in the same run.

In process, through :class:`Engine` (one engine per mode, built one after the other with the same
arguments). TTFT is read from each request's :class:`RequestMetrics` (first token time minus arrival
time, so queueing counts); throughput is prompt plus output tokens over the workload's wall time. Outputs
are greedy with forced lengths (``ignore_eos``), so both modes do the same amount of decoding. Three
workloads, all with synthetic token ids:

- ``shared-system``: one long system prompt followed by N short distinct questions, submitted at once
  (or at a fixed ``--request-rate``).
- ``multi-turn``: C conversations of T turns; each turn resends the whole history (previous prompt, the
  model's reply, a new user message). Conversations run concurrently, turns of one conversation in order.
- ``mooncake``: the sharing pattern of the Mooncake conversation trace (Qin et al., FAST 2025;
  Apache-2.0, shipped in ``workload/data/mooncake-fast25``): each ``hash_id`` names a 512-token block, equal ids
  mean equal content. Blocks are synthesised as ``--trace-block-tokens`` random ids seeded by the hash id
  (512 -> 32 tokens by default, the prompt length and output length scaled by the same factor), prompts are
  capped, and requests arrive at the trace's timestamps (times ``--trace-time-scale``).
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import random
import time
from dataclasses import dataclass, field

import numpy as np

from goodserve.engine.args import EngineArgs
from goodserve.workload.datasets import load_mooncake

logger = logging.getLogger(__name__)

WORKLOADS = ("shared-system", "multi-turn", "mooncake")
_SPECIAL_IDS = 256  # random ids start above the tokenizer's special tokens


def add_prefix_parser(sub) -> None:
    """Register ``bench prefix`` on an argparse subparsers object."""
    p = sub.add_parser("prefix", help="prefix caching off vs on: TTFT, throughput, hit rate")
    p.add_argument("--workloads", default=",".join(WORKLOADS), help=f"comma-separated subset of {WORKLOADS}")
    g = p.add_argument_group("shared-system")
    g.add_argument("--num-questions", type=int, default=64)
    g.add_argument("--system-len", type=int, default=1000, help="system prompt tokens")
    g.add_argument("--question-len", type=int, default=24, help="mean question tokens (+-50%%)")
    g.add_argument("--output-len", type=int, default=16, help="output tokens per question")
    g.add_argument("--request-rate", type=float, default=0.0, help="requests/s; 0 = all at once")
    g = p.add_argument_group("multi-turn")
    g.add_argument("--conversations", type=int, default=8)
    g.add_argument("--turns", type=int, default=6)
    g.add_argument("--opener-len", type=int, default=200, help="first user message tokens")
    g.add_argument("--user-len", type=int, default=32, help="later user message tokens")
    g.add_argument("--reply-len", type=int, default=32, help="assistant reply tokens")
    g = p.add_argument_group("mooncake")
    g.add_argument("--trace", default=None, help="conversation_trace.jsonl (default: the packaged copy)")
    g.add_argument("--trace-requests", type=int, default=200, help="first N requests of the trace")
    g.add_argument("--trace-block-tokens", type=int, default=32, help="tokens standing for one 512-token block")
    g.add_argument("--trace-max-prompt-len", type=int, default=2048)
    g.add_argument("--trace-time-scale", type=float, default=1.0, help="multiply arrival times")
    p.add_argument("--workload-seed", type=int, default=0, help="seed of the synthetic tokens")
    p.add_argument("--output-json", default=None)
    EngineArgs.add_cli_args(p)
    p.set_defaults(func=run_prefix, log_stats_interval=0.0)


# ------------------------------------------------------------------------------------------ workloads
@dataclass
class Submission:
    """One request of an open-loop workload: arrival offset (s), prompt ids and forced output length."""

    offset: float
    prompt: list[int]
    output_len: int


def _random_ids(rng: random.Random, n: int, vocab: int) -> list[int]:
    return [rng.randrange(_SPECIAL_IDS, vocab) for _ in range(n)]


def shared_system_workload(args: argparse.Namespace, vocab: int) -> list[Submission]:
    """One ``system_len``-token system prompt + ``num_questions`` distinct short questions."""
    rng = random.Random(args.workload_seed)
    system = _random_ids(rng, args.system_len, vocab)
    out = []
    for i in range(args.num_questions):
        q = _random_ids(rng, max(1, rng.randint(args.question_len // 2, args.question_len * 3 // 2)), vocab)
        offset = i / args.request_rate if args.request_rate > 0 else 0.0
        out.append(Submission(offset, system + q, args.output_len))
    return out


def mooncake_workload(args: argparse.Namespace, vocab: int, max_model_len: int,
                      block_size: int) -> tuple[list[Submission], float]:
    """Synthetic prompts with the trace's block sharing; also returns the ideal (unbounded-cache) hit rate.

    Block ``h`` is ``trace_block_tokens`` ids drawn from a generator seeded by ``h``, so equal ids give equal
    tokens. A prompt is its blocks concatenated, cut to ``input_length`` scaled by ``block_tokens / 512``
    and to ``trace_max_prompt_len``; outputs are scaled the same way. The ideal hit rate is computed at
    the engine's ``block_size``.
    """
    rows = load_mooncake(args.trace_requests, path=args.trace)
    bt = args.trace_block_tokens
    scale = bt / 512
    blocks: dict[int, list[int]] = {}
    subs = []
    for spec, hash_ids in rows:
        ids: list[int] = []
        for h in hash_ids:
            if h not in blocks:
                blocks[h] = _random_ids(random.Random((args.workload_seed << 32) + h), bt, vocab)
            ids.extend(blocks[h])
        out_len = max(1, round(spec.output_len * scale))
        n = max(1, min(math.ceil(spec.prompt_len * scale), len(ids), args.trace_max_prompt_len,
                       max_model_len - out_len))
        subs.append(Submission(spec.arrival * args.trace_time_scale, ids[:n], out_len))
    return subs, ideal_hit_rate([s.prompt for s in subs], block_size)


def ideal_hit_rate(prompts: list[list[int]], block_size: int) -> float:
    """Fraction of prompt tokens an unbounded cache of ``block_size``-token blocks could serve, in order.

    Same rule as the engine: full blocks only, and the block holding a prompt's last token is recomputed.
    """
    seen: set[int] = set()
    hit = total = 0
    for p in prompts:
        total += len(p)
        key = 0
        missed = False
        for i in range(len(p) // block_size):
            key = hash((key, tuple(p[i * block_size:(i + 1) * block_size])))
            if not missed and i < (len(p) - 1) // block_size and key in seen:
                hit += block_size
            else:
                missed = True
            seen.add(key)
    return hit / total if total else 0.0


# ---------------------------------------------------------------------------------------------- drivers
@dataclass
class RunResult:
    """Per-request metrics of one workload in one mode."""

    ttfts: list[float] = field(default_factory=list)
    prompt_tokens: int = 0
    output_tokens: int = 0
    cached_tokens: int = 0
    elapsed: float = 0.0
    preemptions: int = 0

    def add(self, out) -> None:
        m = out.metrics
        self.ttfts.append(m.ttft)
        self.prompt_tokens += len(out.prompt_token_ids)
        self.output_tokens += len(out.token_ids)
        self.cached_tokens += m.num_cached_tokens
        self.preemptions += m.num_preemptions

    def summary(self) -> dict:
        t = np.array(self.ttfts)
        return {"requests": len(self.ttfts), "prompt_tokens": self.prompt_tokens,
                "output_tokens": self.output_tokens, "cached_tokens": self.cached_tokens,
                "hit_rate": self.cached_tokens / self.prompt_tokens if self.prompt_tokens else 0.0,
                "ttft_mean_s": float(t.mean()), "ttft_p50_s": float(np.percentile(t, 50)),
                "ttft_p99_s": float(np.percentile(t, 99)), "elapsed_s": self.elapsed,
                "total_tok_s": (self.prompt_tokens + self.output_tokens) / self.elapsed,
                "output_tok_s": self.output_tokens / self.elapsed, "preemptions": self.preemptions}


def _params(n: int):
    from goodserve.sampling_params import RequestOutputKind, SamplingParams

    return SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True, output_kind=RequestOutputKind.FINAL_ONLY)


def run_open_loop(engine, subs: list[Submission], tag: str) -> RunResult:
    """Add each request at its arrival time (arrival_time = the scheduled time) and step until all finish."""
    res = RunResult()
    order = sorted(range(len(subs)), key=lambda i: subs[i].offset)
    t0 = time.monotonic()
    nxt = 0
    done = 0
    while done < len(subs):
        now = time.monotonic()
        while nxt < len(order) and t0 + subs[order[nxt]].offset <= now:
            s = subs[order[nxt]]
            engine.add_request(s.prompt, _params(s.output_len), request_id=f"{tag}-{order[nxt]}",
                               arrival_time=t0 + s.offset)
            nxt += 1
        if engine.has_unfinished_requests():
            for out in engine.step():
                if out.finished:
                    res.add(out)
                    done += 1
        elif nxt < len(order):
            time.sleep(max(0.0, t0 + subs[order[nxt]].offset - time.monotonic()))
    res.elapsed = time.monotonic() - t0
    return res


def run_multi_turn(engine, args: argparse.Namespace, vocab: int) -> RunResult:
    """Closed loop: each conversation sends its next turn (whole history) as soon as the last one finishes."""
    rng = random.Random(args.workload_seed + 1)
    users = [[_random_ids(rng, args.opener_len if t == 0 else args.user_len, vocab) for t in range(args.turns)]
             for _ in range(args.conversations)]
    res = RunResult()
    history: dict[int, list[int]] = {}

    def send(c: int, turn: int) -> None:
        history[c] = history.get(c, []) + users[c][turn]
        engine.add_request(history[c], _params(args.reply_len), request_id=f"chat-{c}-{turn}")

    t0 = time.monotonic()
    for c in range(args.conversations):
        send(c, 0)
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                res.add(out)
                _, c, turn = out.request_id.rsplit("-", 2)
                c, turn = int(c), int(turn)
                history[c] = history[c] + list(out.token_ids)
                if turn + 1 < args.turns:
                    send(c, turn + 1)
    res.elapsed = time.monotonic() - t0
    return res


# ------------------------------------------------------------------------------------------------- main
def _warm_up(engine, vocab: int) -> None:
    rng = random.Random(12345)
    for n in (64, 300):
        engine.add_request(_random_ids(rng, n, vocab), _params(4))
        while engine.has_unfinished_requests():
            engine.step()
    engine.reset_prefix_cache()


def run_prefix(args: argparse.Namespace) -> int:
    """Run each workload with caching off, then on; print a table; returns an exit code."""
    import torch

    from goodserve.engine.engine import Engine

    workloads = [w.strip() for w in args.workloads.split(",") if w.strip()]
    unknown = set(workloads) - set(WORKLOADS)
    if unknown:
        raise SystemExit(f"unknown workload(s) {sorted(unknown)}; choose from {WORKLOADS}")
    results: dict[str, dict] = {w: {} for w in workloads}
    info: dict[str, dict] = {}
    for mode in ("off", "on"):
        eargs = EngineArgs.from_cli_args(args)
        eargs.enable_prefix_caching = mode == "on"
        engine = Engine(eargs)
        vocab = engine.config.model.vocab_size
        _warm_up(engine, vocab)
        for w in workloads:
            engine.reset_prefix_cache()  # every workload starts cold
            if w == "shared-system":
                res = run_open_loop(engine, shared_system_workload(args, vocab), f"sys-{mode}")
            elif w == "multi-turn":
                res = run_multi_turn(engine, args, vocab)
            else:
                subs, ideal = mooncake_workload(args, vocab, engine.max_model_len, eargs.block_size)
                info["mooncake"] = {"ideal_hit_rate": ideal, "requests": len(subs),
                                    "trace_span_s": max(s.offset for s in subs)}
                res = run_open_loop(engine, subs, f"moon-{mode}")
            results[w][mode] = res.summary()
            s = results[w][mode]
            print(f"[{w} / caching {mode}] {s['requests']} requests, TTFT mean {s['ttft_mean_s']:.3f} s, "
                  f"p99 {s['ttft_p99_s']:.3f} s, {s['total_tok_s']:.0f} tok/s, hit rate {s['hit_rate']:.1%}",
                  flush=True)
        info["engine"] = {"num_blocks": engine.config.cache.num_blocks, "block_size": eargs.block_size,
                          "dtype": engine.config.dtype, "max_num_batched_tokens": eargs.max_num_batched_tokens}
        del engine

    print(f"\n{'workload':<14} {'caching':<8} {'reqs':>5} {'prompt tok':>10} {'hit rate':>8} "
          f"{'TTFT mean s':>11} {'TTFT p99 s':>10} {'total tok/s':>11} {'elapsed s':>9}")
    for w in workloads:
        for mode in ("off", "on"):
            s = results[w][mode]
            print(f"{w:<14} {mode:<8} {s['requests']:>5} {s['prompt_tokens']:>10} {s['hit_rate']:>8.1%} "
                  f"{s['ttft_mean_s']:>11.3f} {s['ttft_p99_s']:>10.3f} {s['total_tok_s']:>11.0f} "
                  f"{s['elapsed_s']:>9.1f}")
        off, on = results[w]["off"], results[w]["on"]
        results[w]["ttft_mean_speedup"] = off["ttft_mean_s"] / on["ttft_mean_s"]
        results[w]["ttft_p99_speedup"] = off["ttft_p99_s"] / on["ttft_p99_s"]
        results[w]["throughput_ratio"] = on["total_tok_s"] / off["total_tok_s"]
        print(f"{'':<14} on/off: mean TTFT x{results[w]['ttft_mean_speedup']:.2f} lower, p99 TTFT "
              f"x{results[w]['ttft_p99_speedup']:.2f} lower, throughput x{results[w]['throughput_ratio']:.2f}")
    if "mooncake" in info:
        print(f"mooncake: {info['mooncake']['requests']} requests over {info['mooncake']['trace_span_s']:.0f} s; "
              f"ideal hit rate with an unbounded cache {info['mooncake']['ideal_hit_rate']:.1%}")
    print(f"engine: {info['engine']}; torch {torch.__version__}, threads {torch.get_num_threads()}")
    if args.output_json:
        with open(args.output_json, "w") as f:
            json.dump({"results": results, "info": info}, f, indent=2)
    return 0
