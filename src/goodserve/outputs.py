"""What the engine hands back for a request: text, tokens, finish reason and latency metrics.

Outputs are deltas by default (``SamplingParams.output_kind``): each holds the text, token ids and logprobs
that are new since the request's previous output; ``CUMULATIVE`` outputs hold everything so far, and
``FINAL_ONLY`` requests get one output, when they finish.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Optional



@dataclass
class RequestMetrics:
    """The one record of a request's timestamps (seconds, engine monotonic clock) and the latencies derived
    from them, kept by the output processor.

    Attributes:
        arrival_time: When the request was added.
        first_scheduled_time: When a step first scheduled it (queueing ends).
        first_token_time: When its first output token was sampled.
        last_token_time: When its latest output token was sampled.
        finished_time: When it finished, or ``None`` while it runs.
        num_preemptions: How many times it was preempted and recomputed.
        num_output_tokens: Tokens generated so far.
        num_cached_tokens: Prompt tokens served from the prefix cache.
        kv_transfer_bytes: Bytes of its prompt's K/V pulled from a producer (disaggregated serving), else ``None``.
        kv_transfer_seconds: How long that pull took (seconds), else ``None``.
    """

    arrival_time: float
    first_scheduled_time: Optional[float] = None
    first_token_time: Optional[float] = None
    last_token_time: Optional[float] = None
    finished_time: Optional[float] = None
    num_preemptions: int = 0
    num_output_tokens: int = 0
    num_cached_tokens: int = 0
    kv_transfer_bytes: Optional[int] = None
    kv_transfer_seconds: Optional[float] = None

    def snapshot(self) -> "RequestMetrics":
        """A copy (outputs carry one, so a later step never changes what a consumer holds)."""
        return dataclasses.replace(self)

    @property
    def ttft(self) -> Optional[float]:
        """Time to first token: ``first_token_time - arrival_time`` (seconds)."""
        if self.first_token_time is None:
            return None
        return self.first_token_time - self.arrival_time

    @property
    def tpot(self) -> Optional[float]:
        """Time per output token after the first: ``(last - first) / (n - 1)`` (seconds), ``None`` if n < 2."""
        if self.first_token_time is None or self.last_token_time is None or self.num_output_tokens < 2:
            return None
        return (self.last_token_time - self.first_token_time) / (self.num_output_tokens - 1)

    @property
    def e2e_latency(self) -> Optional[float]:
        """``finished_time - arrival_time`` (seconds)."""
        return None if self.finished_time is None else self.finished_time - self.arrival_time

    @property
    def queue_time(self) -> Optional[float]:
        """``first_scheduled_time - arrival_time`` (seconds)."""
        return None if self.first_scheduled_time is None else self.first_scheduled_time - self.arrival_time


@dataclass
class CompletionOutput:
    """One generated sequence.

    Attributes:
        index: Position among the request's sequences.
        text: Detokenised output, new since the previous output unless the request asked for cumulative or
            final-only outputs (stop string excluded; text that may still become one is held back).
        token_ids: Generated token ids, new or all likewise (a matching stop token id is included).
        finish_reason: ``"stop"``, ``"length"``, ``"abort"``, ``"error"`` or ``None`` while running.
        stop_reason: The stop string or stop token id that ended it, if any.
        logprobs: Per token of ``token_ids``, the sampled token's logprob (when asked for).
        top_logprobs: Per token of ``token_ids``, the most likely ``(token_id, logprob)`` (when asked for).
    """

    index: int
    text: str
    token_ids: list[int]
    finish_reason: Optional[str] = None
    stop_reason: Optional[int | str] = None
    logprobs: Optional[list[float]] = None
    top_logprobs: Optional[list[list[tuple[int, float]]]] = None


@dataclass
class RequestOutput:
    """One request's output after a step (``finished`` once it is done).

    Attributes:
        request_id: Its id.
        prompt: The prompt text, if given as text.
        prompt_token_ids: The prompt token ids.
        outputs: Its generated sequence(s).
        finished: Whether it is done.
        metrics: Timestamps and latencies.
        error: Why the request failed, when its own processing raised (``finish_reason`` is then
            ``"error"``); ``None`` otherwise.
        prompt_logprobs: When asked for (``SamplingParams.prompt_logprobs``), per prompt token: ``None`` for
            the first, then ``(logprob, [(token_id, logprob), ...])``; set on the first output that has them
            (every output for cumulative ones), else ``None``.
        kv_transfer_params: On a producer (disaggregated serving), with the finished output: the handle of the
            request's KV blocks, held for a consumer's pull; else ``None``.
    """

    request_id: str
    prompt: Optional[str]
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    metrics: RequestMetrics = field(repr=False, default=None)  # type: ignore[assignment]
    error: Optional[str] = None
    prompt_logprobs: Optional[list[Optional[tuple[float, list[tuple[int, float]]]]]] = None
    kv_transfer_params: Optional[dict] = None

    @property
    def text(self) -> str:
        """The first sequence's text (new text for a delta output)."""
        return self.outputs[0].text

    @property
    def token_ids(self) -> list[int]:
        """The first sequence's token ids."""
        return self.outputs[0].token_ids

    @property
    def finish_reason(self) -> Optional[str]:
        return self.outputs[0].finish_reason
