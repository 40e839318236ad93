"""A request's state inside the scheduler: its tokens and its progress. The scheduler is its only writer.

There are no phases. A request holds ``num_tokens`` tokens (prompt + generated so far) of which the first
``num_computed_tokens`` have their K/V in the paged cache. Prefill, chunked prefill, a prefix-cache hit and
a recompute after preemption are all the same rule: schedule tokens until ``num_computed_tokens`` catches up
with ``num_tokens``; when it does, the step samples one more token.
"""

from __future__ import annotations

import enum
from typing import Optional

from goodserve.kv_transfer.params import KVTransferParams
from goodserve.sampling_params import SamplingParams


class RequestStatus(enum.Enum):
    """Where a request is in its life."""

    WAITING = "waiting"
    WAITING_FOR_REMOTE_KVS = "waiting_for_remote_kvs"  # its blocks are allocated; its prompt's K/V is being pulled
    RUNNING = "running"
    PREEMPTED = "preempted"
    FINISHED_STOPPED = "stop"
    FINISHED_LENGTH = "length"
    FINISHED_ABORTED = "abort"
    FINISHED_ERROR = "error"  # its own processing raised (our fault); the engine serves on without it
    FINISHED_SHED = "shed"  # refused while queued: its TTFT SLO could no longer be met (``slo`` + shed_load)

    @property
    def is_finished(self) -> bool:
        return self in (RequestStatus.FINISHED_STOPPED, RequestStatus.FINISHED_LENGTH,
                        RequestStatus.FINISHED_ABORTED, RequestStatus.FINISHED_ERROR, RequestStatus.FINISHED_SHED)

    @property
    def finish_reason(self) -> Optional[str]:
        """``stop`` | ``length`` (OpenAI's), ``abort`` | ``error`` | ``shed`` (ours), ``None`` while unfinished."""
        return self.value if self.is_finished else None


class Request:
    """One generation request.

    Args:
        request_id: Unique id.
        prompt_token_ids: The prompt, ``[num_prompt_tokens]`` token ids (at least one).
        sampling_params: Sampling and stopping parameters.
        arrival_time: Seconds (monotonic clock) when it arrived.
        priority: Lower runs first under the ``priority`` policy.
        eos_token_ids: Token ids that end generation unless ``ignore_eos``.
        max_tokens: Resolved output limit in tokens (``sampling_params.max_tokens`` or what the context
            leaves).
        cache_salt: Isolates prefix-cache entries: only requests with the same salt share KV blocks.
        slo_ttft: TTFT SLO in seconds (``None``: none); the ``slo`` policy schedules by it.
        slo_tpot: TPOT SLO in seconds (``None``: none); the ``slo`` policy schedules by it.
        kv_transfer_params: Its part in a disaggregated hand-off (``None``: an ordinary request).

    Raises:
        ValueError: on an empty prompt or an SLO that is not a positive finite number.
    """

    def __init__(self, request_id: str, prompt_token_ids: list[int], sampling_params: SamplingParams,
                 arrival_time: float, priority: int = 0, eos_token_ids: tuple[int, ...] = (),
                 max_tokens: Optional[int] = None, cache_salt: Optional[str] = None,
                 slo_ttft: Optional[float] = None, slo_tpot: Optional[float] = None,
                 kv_transfer_params: Optional[KVTransferParams] = None) -> None:
        if len(prompt_token_ids) == 0:
            raise ValueError("the prompt must contain at least one token")
        for name, value in (("slo_ttft", slo_ttft), ("slo_tpot", slo_tpot)):
            if value is not None and not 0 < value < float("inf"):
                raise ValueError(f"{name} must be a positive number of seconds, got {value!r}")
        self.request_id = request_id
        self.prompt_token_ids = list(prompt_token_ids)
        self.output_token_ids: list[int] = []
        self.all_token_ids: list[int] = list(prompt_token_ids)
        self.sampling_params = sampling_params
        self.priority = priority
        self.eos_token_ids = tuple(eos_token_ids)
        self.max_tokens = max_tokens if max_tokens is not None else sampling_params.max_tokens
        self.status = RequestStatus.WAITING
        self.num_computed_tokens = 0
        self.num_cached_tokens = 0  # prompt tokens served from the prefix cache at first admission
        self.num_preemptions = 0
        self.arrival_time = arrival_time  # seconds, monotonic: orders the waiting queue
        self.first_scheduled_time: Optional[float] = None  # when a step first scheduled it
        self.first_token_time: Optional[float] = None  # when its first output token was sampled
        self.slo_ttft = slo_ttft
        self.slo_tpot = slo_tpot
        self.slo_late = False  # ``slo`` policy: its TTFT SLO can no longer be met (queued behind the others)
        self.stop_reason: Optional[int] = None  # the stop token id that ended it
        self.cache_salt = cache_salt  # mixed into every block hash (kv_cache.hashing)
        self.kv_transfer_params = kv_transfer_params
        self.kv_transfer: Optional[tuple[int, float]] = None  # (bytes, seconds) of its pull, once done

    @property
    def num_tokens(self) -> int:
        """Prompt plus generated tokens."""
        return len(self.all_token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def is_finished(self) -> bool:
        return self.status.is_finished

    def append_output_token(self, token_id: int) -> None:
        """Record one sampled token."""
        self.output_token_ids.append(token_id)
        self.all_token_ids.append(token_id)

    def __repr__(self) -> str:
        return (f"Request({self.request_id!r}, status={self.status.name}, "
                f"computed={self.num_computed_tokens}/{self.num_tokens})")
