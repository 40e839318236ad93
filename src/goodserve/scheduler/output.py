"""The scheduler's messages, all plain data (picklable, no live objects), so either side of them could run in
another process:

* :class:`SchedulerOutput`: the step it decided, the only thing the model runner (or the simulator's cost
  model) receives. A request's static data (:class:`NewRequestData`) travels once, the first time it is
  scheduled; after that only per-step diffs do (:class:`ScheduledRequest`: new block ids, computed tokens,
  resumed-after-preemption). The runner keeps its own per-request state up to date from them (vLLM v1's
  ``NewRequestData`` / ``CachedRequestData`` play the same part).
* :class:`SampledToken`: the runner's answer for one request of the step.
* :class:`EngineCoreOutput`: what the scheduler hands back per request after a step (new tokens, finish,
  logprobs, timestamps), the only way results leave the engine core.
* :class:`StepShape`: the few figures of a step that decide what it costs.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Iterator, Optional

from goodserve.kv_transfer.messages import KVLoadSpec
from goodserve.sampling_params import SamplingParams

if TYPE_CHECKING:
    from goodserve.request import Request


@dataclass
class NewRequestData:
    """What the runner must know about a request, sent once: in the step that first schedules it.

    Attributes:
        request_id: Its id.
        prompt_token_ids: ``[num_prompt_tokens]`` token ids.
        sampling_params: How it samples.
        eos_token_ids: Token ids that end it (blocked by the sampler while below ``min_tokens``).
    """

    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    eos_token_ids: tuple[int, ...]


@dataclass
class ScheduledRequest:
    """One request's share of a step.

    Attributes:
        request_id: The request.
        num_computed_tokens: Tokens whose K/V were cached before this step; the first scheduled token sits at
            this position.
        num_new_tokens: Tokens computed this step: positions ``[num_computed_tokens, + num_new_tokens)`` of
            the request's prompt followed by its sampled tokens.
        sample: Whether this step reaches the request's last token, so the runner samples a new token from
            the logits of that position (false for every prefill chunk but the last).
        new_block_ids: Block ids appended to the request's block table this step. For a request scheduled
            for the first time or resumed after preemption, its whole table.
        resumed_from_preemption: The request was preempted (its blocks freed) since it was last scheduled:
            ``new_block_ids`` replaces the table instead of extending it.
        spec_token_ids: Speculation: draft tokens verified after the request's last token; the step computes
            ``num_new_tokens = 1 + len(spec_token_ids)`` positions and samples at each of them.
        num_lookahead: Speculation: draft tokens the runner proposes for the request after this step.
        num_kept_blocks: The runner's table keeps only its first this many entries before ``new_block_ids``
            extend it (the slots of rejected draft tokens were freed); ``None``: all of them.
    """

    request_id: str
    num_computed_tokens: int
    num_new_tokens: int
    sample: bool
    new_block_ids: list[int] = field(default_factory=list)
    resumed_from_preemption: bool = False
    spec_token_ids: list[int] = field(default_factory=list)
    num_lookahead: int = 0
    num_kept_blocks: Optional[int] = None

    @property
    def is_decode(self) -> bool:
        """A single-token step that samples: the decode phase."""
        return self.num_new_tokens == 1 and self.sample


@dataclass
class SchedulerOutput:
    """What one engine step computes.

    Attributes:
        scheduled: Requests advanced this step, in batch order.
        new_requests: Static data of the requests in ``scheduled`` that the runner has not seen before.
        finished_req_ids: Requests that finished (or were aborted) since the previous step: the runner drops
            their state.
        preempted_req_ids: Requests preempted while building this step (their blocks were freed).
        total_num_scheduled_tokens: Sum of ``num_new_tokens``; never above ``max_num_batched_tokens``.
        num_prefix_cached_tokens: Prompt tokens found in the prefix cache for requests admitted this step.
        kv_loads: Pulls of prompt K/V from producers for the KV connector to start (consumer side); the
            requests they fill are not in ``scheduled``.
        kv_cancels: Requests aborted while their pull runs: the connector gives the pulls up and releases the
            producers' holds (their blocks are freed once it reports the pulls ended).
    """

    scheduled: list[ScheduledRequest] = field(default_factory=list)
    new_requests: list[NewRequestData] = field(default_factory=list)
    finished_req_ids: list[str] = field(default_factory=list)
    preempted_req_ids: list[str] = field(default_factory=list)
    total_num_scheduled_tokens: int = 0
    num_prefix_cached_tokens: int = 0
    kv_loads: list[KVLoadSpec] = field(default_factory=list)
    kv_cancels: list[str] = field(default_factory=list)

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

    def sampling(self) -> Iterator[ScheduledRequest]:
        """The scheduled requests that sample a token this step, in batch order."""
        return (s for s in self.scheduled if s.sample)


@dataclass
class SampledToken:
    """The runner's result for one request that sampled in a step.

    Attributes:
        token_id: The token (``-1`` when ``error`` is set).
        logprob: Its log-probability, or ``None`` when not asked for.
        top_logprobs: ``(token_id, logprob)`` of the most likely tokens when ``logprobs`` was asked for.
        error: Why this request's row could not be sampled (its own processing raised), else ``None``.
        prompt_logprobs: With its first sampled token, when asked for: per prompt token from the second
            on, ``(logprob, [(token_id, logprob), ...])``.
        accepted: Speculation: the verified draft tokens accepted before ``token_id``, in order (each with its
            logprobs), so the step's tokens are ``accepted + [this]``.
        spec_token_ids: Speculation: draft tokens proposed for the request's next step.
    """

    token_id: int
    logprob: Optional[float] = None
    top_logprobs: Optional[list[tuple[int, float]]] = None
    error: Optional[str] = None
    prompt_logprobs: Optional[list[tuple[float, list[tuple[int, float]]]]] = None
    accepted: list["SampledToken"] = field(default_factory=list)
    spec_token_ids: list[int] = field(default_factory=list)


@dataclass
class EngineCoreOutput:
    """One request's result of one step, as the scheduler hands it back (plain data).

    Attributes:
        request_id: The request.
        new_token_ids: Tokens sampled this step (one, or none for a request that failed).
        timestamp: When the step ended (seconds, the engine's monotonic clock).
        first_scheduled_time: When a step first scheduled the request (its queueing ended).
        finish_reason: ``"stop"``, ``"length"``, ``"error"`` or ``"shed"`` if it finished this step, else
            ``None``.
        stop_reason: The stop token id that ended it, if one did.
        logprobs: Per new token, its logprob (when asked for).
        top_logprobs: Per new token, the most likely ``(token_id, logprob)`` (when asked for).
        num_cached_tokens: Prompt tokens served from the prefix cache at its first admission.
        num_preemptions: Times it was preempted and recomputed so far.
        error: Why it failed (``finish_reason == "error"``).
        prompt_logprobs: With the first token, when asked for (see :class:`SampledToken`).
        kv_transfer_params: Producer side, when it finished: the handle of its blocks, held for a consumer's
            pull (see :class:`goodserve.kv_transfer.KVTransferParams`).
        kv_transfer: Consumer side, with its first token: ``(bytes, seconds)`` of the pull of its prompt's K/V.
    """

    request_id: str
    new_token_ids: list[int]
    timestamp: float
    first_scheduled_time: Optional[float] = None
    finish_reason: Optional[str] = None
    stop_reason: Optional[int | str] = None
    logprobs: Optional[list[float]] = None
    top_logprobs: Optional[list[list[tuple[int, float]]]] = None
    num_cached_tokens: int = 0
    num_preemptions: int = 0
    error: Optional[str] = None
    prompt_logprobs: Optional[list[tuple[float, list[tuple[int, float]]]]] = None
    kv_transfer_params: Optional[dict] = None
    kv_transfer: Optional[tuple[int, float]] = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    @classmethod
    def of(cls, req: "Request", tokens: list["SampledToken"], now: float, error: Optional[str] = None,
           kv_transfer_params: Optional[dict] = None) -> "EngineCoreOutput":
        """``req``'s result as it stands after a step that appended ``tokens`` (``[]``: it only finished)."""
        with_logprobs = bool(tokens) and req.sampling_params.logprobs is not None
        return cls(req.request_id, [t.token_id for t in tokens], now, first_scheduled_time=req.first_scheduled_time,
                   finish_reason=req.status.finish_reason, stop_reason=req.stop_reason,
                   logprobs=[t.logprob for t in tokens] if with_logprobs else None,
                   top_logprobs=[t.top_logprobs or [] for t in tokens] if with_logprobs else None,
                   num_cached_tokens=req.num_cached_tokens, num_preemptions=req.num_preemptions, error=error,
                   prompt_logprobs=tokens[0].prompt_logprobs if tokens else None,
                   kv_transfer_params=kv_transfer_params,
                   kv_transfer=req.kv_transfer if tokens and req.num_output_tokens == len(tokens) else None)


@dataclass(frozen=True)
class SchedulerStats:
    """The scheduler's state in one record (:meth:`Scheduler.make_stats`): the stats log line, ``/metrics``,
    the simulator and the benchmarks all read this, nothing else.

    Attributes:
        num_running: Requests in the running batch.
        num_waiting: Requests waiting for admission (new or preempted).
        num_tokens_waiting: Prompt tokens not yet computed: all tokens of waiting requests plus the prompt
            remainder of running requests still in (chunked) prefill. A saturation signal for autoscalers.
        kv_cache_usage: Fraction of KV blocks in use, in ``[0, 1]``.
        num_cached_blocks: Blocks registered in the prefix cache (in use or free): what the instance's KV events
            say it holds.
        num_preemptions_total: Preemptions since start.
        prefix_cache_queries: Prompt tokens looked up in the prefix cache since start.
        prefix_cache_hits: Of which found (tokens).
        num_shed_total: Requests refused by the ``slo`` policy's load shedding since start (on arrival or
            while queued).
        num_deferred_decodes_total: Decodes that sat out a step so that prompts with a tighter TPOT SLO could
            meet their TTFT (``slo`` policy, rule 6), since start.
        num_steps_observed: Steps whose time the step-time model observed.
        step_time_predicted_s_total: Sum of the model's predictions for those steps, made before each ran (s).
        step_time_actual_s_total: Sum of their measured times (s).
        step_time_abs_error_s_total: Sum of ``|predicted - actual|`` (s).
        step_time_margin: The model's margin (a quantile of measured / predicted time over runs of recent steps,
            >= 1).
        num_blocks_held_for_pull: Blocks of finished requests held for a consumer's pull (producer).
        num_kv_transfers_in_flight: Pulls of prompt K/V not yet ended (consumer).
        num_kv_blocks_quarantined: Blocks of failed or aborted pulls kept out of the pool while their READ may
            still write into them (consumer); they count as in use.
        num_kv_transfer_timeouts_total: Holds that ended because no consumer pulled in time (producer).
        num_kv_holds_ended_total: Holds ended since start by reason, ``pulled``, ``aborted`` (the client left
            on either hop), ``failed`` (the consumer could not read) and ``expired`` (the timeouts above)
            (producer).
        num_kv_transfer_failures_total: Pulls that failed (consumer; the request failed with them).
        num_spec_drafts_total: Speculation: decode rows that verified at least one draft token.
        num_spec_draft_tokens_total: Draft tokens verified.
        num_spec_accepted_tokens_total: Draft tokens accepted.
        spec_accepted_per_pos: Draft tokens accepted at each position ``1..k_max`` (the acceptance rate per
            position is each over ``num_spec_drafts_total`` reaching it; vLLM's ``..._per_pos``).
        spec_length: Draft tokens per row chosen for the latest step (``auto`` falls to 0 under load).
    """

    num_running: int
    num_waiting: int
    num_tokens_waiting: int
    kv_cache_usage: float
    num_preemptions_total: int
    prefix_cache_queries: int
    prefix_cache_hits: int
    num_shed_total: int = 0
    num_deferred_decodes_total: int = 0
    num_steps_observed: int = 0
    step_time_predicted_s_total: float = 0.0
    step_time_actual_s_total: float = 0.0
    step_time_abs_error_s_total: float = 0.0
    step_time_margin: float = 1.0
    num_blocks_held_for_pull: int = 0
    num_kv_transfers_in_flight: int = 0
    num_kv_blocks_quarantined: int = 0
    num_cached_blocks: int = 0
    num_kv_transfer_timeouts_total: int = 0
    num_kv_transfer_failures_total: int = 0
    num_kv_holds_ended_total: dict[str, int] = field(default_factory=dict)
    num_spec_drafts_total: int = 0
    num_spec_draft_tokens_total: int = 0
    num_spec_accepted_tokens_total: int = 0
    spec_accepted_per_pos: tuple[int, ...] = ()
    spec_length: int = 0

    @classmethod
    def idle(cls) -> "SchedulerStats":
        """The stats of a scheduler that has seen nothing yet."""
        return cls(0, 0, 0, 0.0, 0, 0, 0)

    @property
    def prefix_cache_hit_rate(self) -> float:
        """``prefix_cache_hits / prefix_cache_queries`` (0 before any query)."""
        return self.prefix_cache_hits / self.prefix_cache_queries if self.prefix_cache_queries else 0.0


@dataclass(frozen=True)
class StepShape:
    """The figures of one step that decide its cost.

    Attributes:
        num_tokens: Tokens computed (prefill chunks + decodes).
        num_sampled: LM head rows: one per request that samples, and under speculation one more per draft it
            verifies (each position's logits are sampled).
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
    def of(cls, out: SchedulerOutput, drafts: bool = True) -> "StepShape":
        """The shape of one scheduler decision (``drafts=False``: as if no row verified a draft)."""
        tokens = sampled = pairs = kv = 0
        for s in out.scheduled:
            k = len(s.spec_token_ids)
            n, c = s.num_new_tokens - (0 if drafts else k), s.num_computed_tokens
            tokens += n
            sampled += s.sample + (k if drafts else 0)
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
