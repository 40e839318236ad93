"""Small factories shared by the KV-cache and scheduler tests (no torch, no model)."""

from __future__ import annotations

from typing import Optional, Sequence

from goodserve.config import CacheConfig, SchedulerConfig
from goodserve.request import Request
from goodserve.request_options import RequestOptions
from goodserve.sampling_params import SamplingParams
from goodserve.scheduler.output import SampledToken, SchedulerOutput
from goodserve.scheduler.scheduler import Scheduler

EOS = 2
FAKE_TOKEN = 7  # what the fake "model" samples: never EOS


def create_scheduler(block_size: int = 4, num_blocks: int = 64, max_num_batched_tokens: int = 64,
                     max_num_seqs: int = 16, max_model_len: int = 1024, policy: str = "fcfs",
                     enable_prefix_caching: bool = True, mode: str = "chunked") -> Scheduler:
    """A scheduler over a small pool."""
    return Scheduler(SchedulerConfig(max_num_batched_tokens=max_num_batched_tokens, max_num_seqs=max_num_seqs,
                                     max_model_len=max_model_len, policy=policy, mode=mode),
                     CacheConfig(num_blocks=num_blocks, block_size=block_size,
                                 enable_prefix_caching=enable_prefix_caching))


def create_requests(num_requests: int, prompt_len: int = 8, max_tokens: int = 4, *,
                    prompt_token_ids: Optional[Sequence[int]] = None, same_prompt: bool = False,
                    prefix: str = "r", start: int = 0, priorities: Optional[Sequence[int]] = None,
                    arrival: float = 0.0, cache_salt: Optional[str] = None, **params) -> list[Request]:
    """``num_requests`` requests ``{prefix}{i}`` with distinct prompts (unless ``same_prompt``/given ids).

    Prompt tokens start at 100 so they never collide with :data:`EOS` or :data:`FAKE_TOKEN`.
    """
    reqs = []
    for i in range(start, start + num_requests):
        if prompt_token_ids is not None:
            ids = list(prompt_token_ids)
        elif same_prompt:
            ids = [100 + t for t in range(prompt_len)]
        else:
            ids = [100 + 1000 * i + t for t in range(prompt_len)]
        priority = priorities[i - start] if priorities is not None else 0
        reqs.append(Request(f"{prefix}{i}", ids, SamplingParams(max_tokens=max_tokens, **params),
                            arrival_time=arrival + i * 1e-3, eos_token_ids=(EOS,),
                            options=RequestOptions(priority=priority, cache_salt=cache_salt)))
    return reqs


def fake_step(scheduler: Scheduler, now: float,
              token: int = FAKE_TOKEN) -> tuple[SchedulerOutput, list[str]]:
    """One engine step with a fake model that samples ``token`` for every request that samples.

    Returns:
        The step, and the ids of the requests it finished.
    """
    out = scheduler.schedule(now)
    results = scheduler.update_from_output(out, sampled_tokens(out, token), now)
    return out, [r.request_id for r in results if r.finished]


def sampled_tokens(out: SchedulerOutput, token: int = FAKE_TOKEN) -> dict[str, SampledToken]:
    """The fake model's answer: ``token`` for every request of ``out`` that samples."""
    return {s.request_id: SampledToken(token) for s in out.sampling()}


def run_to_completion(scheduler: Scheduler, max_steps: int = 10_000, check: bool = True
                      ) -> list[SchedulerOutput]:
    """Step until nothing is left, checking the KV invariants after every step; returns the steps."""
    outs = []
    for step in range(max_steps):
        if not scheduler.has_unfinished_requests():
            return outs
        out, _ = fake_step(scheduler, now=float(step))
        outs.append(out)
        if check:
            scheduler.kv_cache_manager.check_integrity()
    raise AssertionError(f"not finished after {max_steps} steps")
