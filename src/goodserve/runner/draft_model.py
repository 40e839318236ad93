"""Draft-model proposals: a smaller model sharing the target's tokenizer guesses the next tokens greedily.

The draft model runs on a :class:`~goodserve.runner.model_runner.ModelRunner` of its own, with its own paged
KV cache and a :class:`~goodserve.kv_cache.manager.KVCacheManager` over it; the engine sizes both pools with
the same number of blocks out of one KV budget (:func:`goodserve.engine.engine.resolve_pool`). For each
request it keeps what its cache holds: on the next call the K/V of the longest common prefix of that and the
request's new context is reused (a rejected draft's K/V is not), the rest of the context is computed as one
chunk that samples the first draft, and each further draft is one decode step, all requests batched. Drafts
are greedy, so the target's verification (:mod:`goodserve.runner.speculative`) accepts a draft ``d`` with probability
``p(d)``: the rejection-sampling rate for a point-mass proposal.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from dataclasses import dataclass, field
from typing import Sequence

import torch

from goodserve.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig
from goodserve.kv_cache.manager import KVCacheManager
from goodserve.models.checkpoint import LoadedModel
from goodserve.request import Request
from goodserve.sampling_params import SamplingParams
from goodserve.scheduler.output import NewRequestData, ScheduledRequest, SchedulerOutput
from goodserve.spec.speculator import CATCH_UP_TOKENS

logger = logging.getLogger(__name__)

GREEDY = SamplingParams(temperature=0.0, max_tokens=1 << 30)


def check_draft(draft: ModelConfig, target: ModelConfig, max_model_len: int) -> None:
    """Refuse a draft model whose token ids are not the target's, or whose context is shorter than the
    sequences the engine serves.

    Raises:
        ValueError: naming both vocabulary sizes, or both lengths.
    """
    if draft.vocab_size != target.vocab_size:
        raise ValueError(f"the draft model's vocabulary ({draft.vocab_size} ids) is not the target's "
                         f"({target.vocab_size}): a draft model must share the target's tokenizer")
    if draft.max_position_embeddings < max_model_len:
        raise ValueError(f"the draft model's context ({draft.max_position_embeddings} tokens) is shorter than "
                         f"max_model_len ({max_model_len}): pass a smaller --max-model-len")


@dataclass
class _DraftState:
    """What the draft cache holds for one request: the tokens whose K/V it computed."""

    request: Request
    computed: list[int] = field(default_factory=list)


class DraftModelProposer:
    """Greedy proposals of a draft model, batched over the requests of a step.

    Args:
        draft: The loaded draft model (weights on the CPU).
        target: The engine's config (dtype, quantization, device, block size and number of blocks).
    """

    def __init__(self, draft: LoadedModel, target: EngineConfig) -> None:
        from goodserve.runner.model_runner import ModelRunner

        check_draft(draft.config, target.model, target.scheduler.max_model_len)
        cache = CacheConfig(target.cache.num_blocks, target.cache.block_size, enable_prefix_caching=False)
        # The target's verification decides every token, whatever the drafts (greedy: a draft is accepted when it
        # is the target's token; sampled: when it is the target's sample), so the draft's numerics change only how
        # many are accepted: it runs the fastest kernels, not batch-invariant ones (which read dense copies of the
        # weights at one row, and which some architectures lack).
        config = dataclasses.replace(target, model=draft.config, cache=cache, speculative=None, batch_invariant=False,
                                     scheduler=SchedulerConfig(max_model_len=target.scheduler.max_model_len))
        self.runner = ModelRunner(config, draft.weights)
        self.kv = KVCacheManager(cache.num_blocks, cache.block_size, enable_prefix_caching=False)
        self._states: dict[str, _DraftState] = {}
        self._finished: list[str] = []
        #: Seconds the last :meth:`propose_batch` spent catching up: reading context the draft had missed (a new
        #: request's prompt, the tokens of steps it was not asked in).
        self.catch_up_seconds = 0.0

    def finish(self, request_ids: Sequence[str]) -> None:
        """Drop the draft state (and free the blocks) of requests that ended or were preempted."""
        for rid in request_ids:
            state = self._states.pop(rid, None)
            if state is not None:
                self.kv.free(state.request)
                self._finished.append(rid)

    def propose_batch(self, items: Sequence[tuple[str, list[int], int]]) -> dict[str, list[int]]:
        """Up to ``k`` greedy draft tokens after each request's context.

        Args:
            items: ``(request_id, context token ids, k)``.

        Returns:
            The drafts by request id (``[]`` for a request whose draft blocks do not fit the pool).
        """
        catch_up, out = SchedulerOutput(finished_req_ids=self._finished), SchedulerOutput()
        self._finished = []
        ks: dict[str, int] = {}
        for rid, tokens, k in items:
            if self._catch_up(catch_up, out, rid, tokens, k):
                ks[rid] = k
        drafts: dict[str, list[int]] = {rid: [] for rid, _, _ in items}
        start = time.monotonic()
        self.runner.execute(catch_up)  # also when empty: finished requests to drop
        if catch_up.scheduled and self.runner.device.type == "cuda":
            torch.cuda.synchronize(self.runner.device)  # nothing sampled: its kernels may still run
        self.catch_up_seconds = time.monotonic() - start if catch_up.scheduled else 0.0
        if not ks:
            return drafts
        sampled = self.runner.execute(out)
        for step in range(max(ks.values())):
            for rid, token in sampled.items():
                if token.error is None:
                    drafts[rid].append(token.token_id)
                else:  # a draft step that failed proposes no more
                    ks[rid] = len(drafts[rid])
            live = [rid for rid, k in ks.items() if len(drafts[rid]) < k]
            if not live or step == max(ks.values()) - 1:
                break
            sampled = self.runner.execute(self._decode_step(live, drafts))
        for rid in ks:
            if not drafts[rid]:
                self.finish([rid])  # nothing computed to keep track of: start afresh next time
                continue
            state = self._states[rid]
            state.request.num_computed_tokens = len(state.computed) + len(drafts[rid]) - 1
            state.computed = state.computed + drafts[rid][:-1]
        return drafts

    def _catch_up(self, catch_up: SchedulerOutput, out: SchedulerOutput, rid: str, tokens: list[int], k: int) -> bool:
        """Add ``rid``'s first draft step to ``out``: its context after the prefix whose K/V the draft cache
        holds, sampling the first draft. Returns whether its blocks (for ``k`` drafts) fit.

        Where that is more than the draft reads after a step it proposed for (the target's next token, and the
        last draft where every draft was accepted: :data:`~goodserve.spec.speculator.CATCH_UP_TOKENS`), the draft
        missed tokens, and all of the context but its last token goes to ``catch_up`` instead, a pass of its own:
        reading what the draft missed costs what the context costs, not what the drafts do, and ``auto`` prices
        drafts with the rest of the proposing
        (:attr:`catch_up_seconds`; BENCHMARKS.md, "Speculative decoding with a draft model that pays")."""
        state = self._states.get(rid)
        reuse = 0
        if state is not None:
            limit = min(len(state.computed), len(tokens) - 1)
            while reuse < limit and state.computed[reuse] == tokens[reuse]:
                reuse += 1
        ahead = len(tokens) - reuse
        missed = ahead > CATCH_UP_TOKENS
        if state is not None:  # the runner takes the context anew as this request's prompt (the catch-up pass
            catch_up.finished_req_ids.append(rid)  # always runs, so the request is dropped whatever fits)
        request = Request(rid, tokens, GREEDY, 0.0, max_tokens=1 << 30)
        request.num_computed_tokens = reuse
        if state is not None:  # keep the blocks of the reused prefix (tables are kept by request id)
            self.kv.trim(state.request, reuse)
        if self.kv.allocate_slots(request, len(tokens) - reuse + k - 1) is None:
            self.kv.free(request)
            self._states.pop(rid, None)
            return False
        self._states[rid] = _DraftState(request, list(tokens))
        (catch_up if missed else out).new_requests.append(NewRequestData(rid, list(tokens), GREEDY, ()))
        blocks = dict(new_block_ids=self.kv.get_block_ids(rid), resumed_from_preemption=True)
        if missed:
            catch_up.scheduled.append(ScheduledRequest(rid, reuse, ahead - 1, sample=False, **blocks))
            out.scheduled.append(ScheduledRequest(rid, len(tokens) - 1, 1, sample=True))
        else:
            out.scheduled.append(ScheduledRequest(rid, reuse, ahead, sample=True, **blocks))
        return True

    def _decode_step(self, live: list[str], drafts: dict[str, list[int]]) -> SchedulerOutput:
        """One decode step of the draft model for the requests still drafting."""
        out = SchedulerOutput()
        for rid in live:
            position = len(self._states[rid].computed) + len(drafts[rid]) - 1  # the last draft's position
            out.scheduled.append(ScheduledRequest(rid, position, 1, sample=True))
        return out
