"""The scheduler's decision for one step: the only thing the model runner (or the simulator's cost model)
receives; and its :class:`StepShape`, the few figures that decide what the step costs."""

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


@dataclass(frozen=True)
class StepShape:
    """The figures of one step that decide its cost.

    Attributes:
        num_tokens: Tokens computed (prefill chunks + decodes).
        num_sampled: Requests that sample a token (LM head rows).
        attention_pairs: Causal query-key pairs, summed over requests:
            ``sum(n · c + n · (n + 1) / 2)`` for ``n`` new tokens after ``c`` cached ones.
        kv_tokens_read: Context tokens whose K/V attention reads: ``sum(c + n)``.
        num_seqs: Requests in the step.
    """

    num_tokens: int
    num_sampled: int
    attention_pairs: int
    kv_tokens_read: int
    num_seqs: int

    @classmethod
    def of(cls, out: SchedulerOutput) -> "StepShape":
        """The shape of one scheduler decision."""
        tokens = sampled = pairs = kv = 0
        for s in out.scheduled:
            n, c = s.num_new_tokens, s.num_computed_tokens
            tokens += n
            sampled += s.sample
            pairs += n * c + n * (n + 1) // 2
            kv += c + n
        return cls(tokens, sampled, pairs, kv, len(out.scheduled))

    def to_dict(self) -> dict:
        return {"tokens": self.num_tokens, "sampled": self.num_sampled, "attention_pairs": self.attention_pairs,
                "kv_tokens_read": self.kv_tokens_read, "seqs": self.num_seqs}

    @classmethod
    def from_dict(cls, d: dict) -> "StepShape":
        """Inverse of :meth:`to_dict`.

        Raises:
            KeyError, TypeError, ValueError: if a field is missing or not an integer.
        """
        return cls(int(d["tokens"]), int(d["sampled"]), int(d["attention_pairs"]), int(d["kv_tokens_read"]),
                   int(d["seqs"]))
