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
from goodserve.request_options import DEFAULT_OPTIONS, RequestOptions
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
        eos_token_ids: Token ids that end generation unless ``ignore_eos``.
        max_tokens: Resolved output limit in tokens (``sampling_params.max_tokens`` or what the context
            leaves).
        options: Its priority, prefix-cache salt, SLOs and hand-off (:class:`RequestOptions`), as built where
            it entered; read through the properties below.

    Raises:
        ValueError: on an empty prompt.
    """

    def __init__(self, request_id: str, prompt_token_ids: list[int], sampling_params: SamplingParams,
                 arrival_time: float, eos_token_ids: tuple[int, ...] = (), max_tokens: Optional[int] = None,
                 options: RequestOptions = DEFAULT_OPTIONS) -> None:
        if len(prompt_token_ids) == 0:
            raise ValueError("the prompt must contain at least one token")
        self.options = options
        self.request_id = request_id
        self.prompt_token_ids = list(prompt_token_ids)
        self.output_token_ids: list[int] = []
        self.all_token_ids: list[int] = list(prompt_token_ids)
        self.sampling_params = sampling_params
        self.eos_token_ids = tuple(eos_token_ids)
        self.max_tokens = max_tokens if max_tokens is not None else sampling_params.max_tokens
        self.status = RequestStatus.WAITING
        self.num_computed_tokens = 0
        self.num_cached_tokens = 0  # prompt tokens served from the prefix cache at first admission
        self.num_preemptions = 0
        self.arrival_time = arrival_time  # seconds, monotonic: orders the waiting queue
        self.first_scheduled_time: Optional[float] = None  # when a step first scheduled it
        self.first_token_time: Optional[float] = None  # when its first output token was sampled
        self.slo_late = False  # ``slo`` policy: its TTFT SLO can no longer be met (queued behind the others)
        self.stop_reason: Optional[int] = None  # the stop token id that ended it
        self.kv_transfer: Optional[tuple[int, float]] = None  # (bytes, seconds) of its pull, once done
        self.spec_token_ids: list[int] = []  # draft tokens proposed for its next step (speculation)

    @property
    def priority(self) -> int:
        """Lower runs first under the ``priority`` policy."""
        return self.options.priority

    @property
    def cache_salt(self) -> Optional[str]:
        """Mixed into every block hash (:mod:`goodserve.kv_cache.hashing`)."""
        return self.options.cache_salt

    @property
    def slo_ttft(self) -> Optional[float]:
        """TTFT SLO in seconds, or ``None``."""
        return self.options.slo_ttft

    @property
    def slo_tpot(self) -> Optional[float]:
        """TPOT SLO in seconds, or ``None``."""
        return self.options.slo_tpot

    @property
    def kv_transfer_params(self) -> Optional[KVTransferParams]:
        """Its part in a disaggregated hand-off, or ``None``."""
        return self.options.kv_transfer_params

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
