"""What the model runner knows of each request, so that each :class:`SchedulerOutput` carries only what it
lacks: a request's static data once, the block ids it does not hold yet, its whole block table again after
a preemption, and the ids of requests that finished since the last step (vLLM v1's ``NewRequestData`` /
``CachedRequestData`` diffs against the runner's persistent batch)."""

from __future__ import annotations

from typing import Sequence

from goodserve.kv_cache.manager import KVCacheManager
from goodserve.request import Request
from goodserve.scheduler.output import NewRequestData, ScheduledRequest, SchedulerOutput


class RunnerDiffs:
    """The scheduler's record of the runner's per-request state."""

    def __init__(self) -> None:
        self._num_blocks: dict[str, int] = {}  # block ids the runner holds per request (absent: unseen)
        self._preempted: set[str] = set()  # lost their blocks to preemption since last scheduled
        self._finished: list[str] = []  # finished since the last step (the runner drops their state)
        self._trimmed: dict[str, int] = {}  # blocks kept after rejected drafts' slots were freed

    def record(self, out: SchedulerOutput, req: Request, kv: KVCacheManager, num_computed: int, n: int,
               spec_token_ids: Sequence[int] = (), num_lookahead: int = 0) -> None:
        """Add a request's share of the step to ``out``: its static data if the runner has not seen it, the
        block ids the runner does not hold yet (all of them after a preemption), and the draft tokens it
        verifies (``n`` counts them)."""
        rid = req.request_id
        known = self._num_blocks.get(rid)
        resumed = rid in self._preempted
        kept = self._trimmed.pop(rid, None)
        if known is None:
            out.new_requests.append(NewRequestData(rid, list(req.prompt_token_ids), req.sampling_params,
                                                   req.eos_token_ids))
        if known is None or resumed:
            known, kept = 0, None
            self._preempted.discard(rid)
        new_block_ids = kv.get_block_ids(rid, known)  # only what the runner lacks
        sample = num_computed + n - len(spec_token_ids) == req.num_tokens
        out.scheduled.append(ScheduledRequest(rid, num_computed, n, sample=sample, new_block_ids=new_block_ids,
                                              resumed_from_preemption=resumed, spec_token_ids=list(spec_token_ids),
                                              num_lookahead=num_lookahead, num_kept_blocks=kept))
        self._num_blocks[rid] = known + len(new_block_ids)

    def trimmed(self, request_id: str, num_blocks: int) -> None:
        """The request's table was cut to ``num_blocks`` blocks (rejected drafts' slots freed): its next share
        of a step tells the runner to cut its own."""
        if request_id in self._num_blocks:
            self._num_blocks[request_id] = num_blocks
            self._trimmed[request_id] = num_blocks

    def preempted(self, request_id: str) -> None:
        """The request's blocks were freed: its next share of a step sends its whole table."""
        if request_id in self._num_blocks:
            self._preempted.add(request_id)

    def finished(self, request_id: str) -> None:
        """The request ended: the runner drops its state with the next step (if it ever saw it)."""
        self._preempted.discard(request_id)
        self._trimmed.pop(request_id, None)
        if self._num_blocks.pop(request_id, None) is not None:
            self._finished.append(request_id)

    def take_finished(self) -> list[str]:
        """The ids finished since the last call."""
        done, self._finished = self._finished, []
        return done
