"""The scheduler's decision for one step: the only thing the model runner (or the simulator's cost model)
receives."""

from __future__ import annotations

from dataclasses import dataclass, field

from goodserve.request import Request


@dataclass
class ScheduledRequest:
    """One request's share of a step.

    Attributes:
        request: The request (read-only downstream; the scheduler alone mutates it).
        num_computed_tokens: Tokens whose K/V were already cached before this step; the first scheduled
            token sits at this position.
        num_new_tokens: Tokens computed this step:
            ``request.all_token_ids[num_computed_tokens : num_computed_tokens + num_new_tokens]``.
        block_ids: The request's block table after allocation, covering at least
            ``num_computed_tokens + num_new_tokens`` slots.
        sample: Whether this step reaches the request's last token, so the runner samples a new token
            from the logits of that position (false for every prefill chunk but the last).
    """

    request: Request
    num_computed_tokens: int
    num_new_tokens: int
    block_ids: list[int]
    sample: bool

    @property
    def request_id(self) -> str:
        return self.request.request_id

    @property
    def is_decode(self) -> bool:
        """A single-token step that samples: the decode phase."""
        return self.num_new_tokens == 1 and self.sample


@dataclass
class SchedulerOutput:
    """What one engine step computes.

    Attributes:
        scheduled: Requests advanced this step, in batch order.
        total_num_scheduled_tokens: Sum of ``num_new_tokens``; never above ``max_num_batched_tokens``.
        preempted_request_ids: Requests preempted while building this step (their blocks were freed).
        num_prefix_cached_tokens: Prompt tokens found in the prefix cache for requests admitted this step.
    """

    scheduled: list[ScheduledRequest] = field(default_factory=list)
    total_num_scheduled_tokens: int = 0
    preempted_request_ids: list[str] = field(default_factory=list)
    num_prefix_cached_tokens: int = 0

    @property
    def is_empty(self) -> bool:
        return not self.scheduled

    @property
    def num_prefill_tokens(self) -> int:
        """Tokens of prompt (or recompute) chunks in this step."""
        return sum(s.num_new_tokens for s in self.scheduled if not s.is_decode)

    @property
    def num_decode_tokens(self) -> int:
        """Tokens of decode steps in this step."""
        return sum(1 for s in self.scheduled if s.is_decode)
