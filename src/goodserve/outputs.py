"""What the engine hands back for a request: text, tokens, finish reason and latency metrics."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

from goodserve.request import Request


@dataclass
class RequestMetrics:
    """Timestamps (seconds, engine monotonic clock) and the latencies derived from them.

    Attributes:
        arrival_time: When the request was added.
        first_scheduled_time: When a step first scheduled it (queueing ends).
        first_token_time: When its first output token was sampled.
        last_token_time: When its latest output token was sampled.
        finished_time: When it finished, or ``None`` while it runs.
        num_preemptions: How many times it was preempted and recomputed.
        num_cached_tokens: Prompt tokens served from the prefix cache.
    """

    arrival_time: float
    first_scheduled_time: Optional[float]
    first_token_time: Optional[float]
    last_token_time: Optional[float]
    finished_time: Optional[float]
    num_preemptions: int
    num_output_tokens: int
    num_cached_tokens: int = 0

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

    @classmethod
    def from_request(cls, request: Request) -> "RequestMetrics":
        t = request.times
        return cls(t.arrival, t.first_scheduled, t.first_token, t.last_token, t.finished,
                   request.num_preemptions, request.num_output_tokens, request.num_cached_tokens)


@dataclass
class CompletionOutput:
    """One generated sequence.

    Attributes:
        index: Position among the request's sequences.
        text: Detokenised output (stop string excluded; held back while it may still become one).
        token_ids: Generated token ids (a matching stop token id is included).
        finish_reason: ``"stop"``, ``"length"``, ``"abort"``, ``"error"`` or ``None`` while running.
        stop_reason: The stop string or stop token id that ended it, if any.
        logprobs: Per generated token, the sampled token's logprob (when asked for).
        top_logprobs: Per generated token, the most likely ``(token_id, logprob)`` (when asked for).
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
    """The state of one request after a step (``finished`` once it is done).

    Attributes:
        request_id: Its id.
        prompt: The prompt text, if given as text.
        prompt_token_ids: The prompt token ids.
        outputs: Its generated sequence(s).
        finished: Whether it is done.
        metrics: Timestamps and latencies.
        error: Why the request failed, when its own processing raised (``finish_reason`` is then
            ``"error"``); ``None`` otherwise.
    """

    request_id: str
    prompt: Optional[str]
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    metrics: RequestMetrics = field(repr=False, default=None)  # type: ignore[assignment]
    error: Optional[str] = None

    @property
    def text(self) -> str:
        """The first sequence's text."""
        return self.outputs[0].text

    @property
    def token_ids(self) -> list[int]:
        """The first sequence's token ids."""
        return self.outputs[0].token_ids

    @property
    def finish_reason(self) -> Optional[str]:
        return self.outputs[0].finish_reason
