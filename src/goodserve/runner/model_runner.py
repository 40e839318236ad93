"""Turns a ``SchedulerOutput`` into one forward pass of the real model and samples the next tokens.

The runner owns the weights, the paged KV cache tensors and the sampler, and keeps its own state of every
request it is running (:class:`CachedRequestState`: prompt, sampled tokens, block table, sampling
parameters), updated from the scheduler's message alone: a request's static data arrives once, then only
per-step diffs (new block ids, computed tokens, resumed after preemption), and finished ids drop it. It
never sees the scheduler's ``Request`` objects, so the scheduler and the runner could live in different
processes. Preemption, chunking and prefix hits need no special handling here: each is a
``num_computed_tokens`` and a block table.
"""

from __future__ import annotations

import logging
import math
import mmap
import time
from dataclasses import dataclass, field
from typing import Any, Optional

import torch

from goodserve.config import EngineConfig
from goodserve.kv_cache.layout import uniform_layout
from goodserve.models.attention import AttentionBackend, AttentionMetadata, make_attention_backend
from goodserve.models.kv_quant import cache_shape
from goodserve.models.mla import MLAAttentionBackend, check_mla_engine, mla_kv_caches
from goodserve.models.registry import model_class
from goodserve.models.window_attention import build_windowed
from goodserve.runner.sampler import Sampler, SamplerOutput
from goodserve.runner.sampling_metadata import SamplingMetadata, SamplingRow
from goodserve.runner.speculative import expand_rows, make_proposer, verify
from goodserve.sampling_params import MAX_LOGPROBS, SamplingParams
from goodserve.scheduler.output import SampledToken, ScheduledRequest, SchedulerOutput

logger = logging.getLogger(__name__)

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
#: Torch dtype of the KV cache tensors per resolved ``kv_cache_dtype`` (int8 rows carry their scale bytes).
KV_DTYPES = {**DTYPES, "int8": torch.int8}


@dataclass
class CachedRequestState:
    """The runner's own record of a request it runs.

    Attributes:
        prompt_token_ids: ``[num_prompt_tokens]``.
        sampling_params: How it samples.
        eos_token_ids: Blocked while below ``min_tokens``.
        output_token_ids: Tokens this runner sampled for it so far.
        block_ids: Its block table.
        grammar: Its grammar matcher when its output is constrained (structured outputs), else ``None``.
        prompt_logprobs: When asked for, per prompt token from the second on, its ``(logprob, top)``
            under the model's raw logits at the position before; filled as prefill chunks are computed.
    """

    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    eos_token_ids: tuple[int, ...]
    output_token_ids: list[int] = field(default_factory=list)
    block_ids: list[int] = field(default_factory=list)
    grammar: Optional[Any] = None
    prompt_logprobs: Optional[list[tuple[float, list[tuple[int, float]]]]] = None

    def token_ids(self, start: int, end: int) -> list[int]:
        """Tokens ``[start, end)`` of prompt + output."""
        n = len(self.prompt_token_ids)
        if end <= n:
            return self.prompt_token_ids[start:end]
        if start >= n:
            return self.output_token_ids[start - n:end - n]
        return self.prompt_token_ids[start:] + self.output_token_ids[:end - n]


def zeroed(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A zero tensor whose memory on CPU is touched only when written.

    On CPU the tensor lives in an anonymous memory map: the kernel hands out zero pages on first write, so a
    KV pool costs resident memory only for the blocks that were used (a one-shot command or a lightly
    loaded server does not pay for the whole pool up front). Elsewhere it is ``torch.zeros``.
    """
    if device.type != "cpu":
        return torch.zeros(shape, dtype=dtype, device=device)
    nbytes = math.prod(shape) * torch.tensor([], dtype=dtype).element_size()
    return torch.frombuffer(mmap.mmap(-1, max(nbytes, 1)), dtype=torch.uint8)[:nbytes].view(dtype).view(shape)


def _to(weight, device: torch.device):
    return weight.to(device) if isinstance(weight, torch.Tensor) else weight


class ModelRunner:
    """Executes scheduled steps on a device.

    Args:
        config: The resolved engine config (``cache.num_blocks`` set).
        weights: HF-named weights (see ``goodserve.models.loader``).
        attn_backend: Paged attention implementation; default: the one ``config.attention_backend`` names.
        structured_output: A :class:`~goodserve.runner.structured_output.StructuredOutputCompiler` for the
            requests whose output is constrained (``None``: such requests fail).
        draft: The loaded draft model of ``draft_model`` speculation (``None``: none).
    """

    def __init__(self, config: EngineConfig, weights: dict[str, torch.Tensor],
                 attn_backend: Optional[AttentionBackend] = None, structured_output: Optional[Any] = None,
                 draft: Optional[Any] = None) -> None:
        self.structured_output = structured_output
        self.config = config
        self.device = torch.device(config.device)
        self.dtype = DTYPES[config.dtype]
        self.block_size = config.cache.block_size
        m = config.model
        #: How layers lie over the pool: its KV-cache groups (a request's ``block_ids`` interleave their tables).
        self.layout = config.cache.layout or uniform_layout(m.num_hidden_layers)
        if len(self.layout.layer_slots) != m.num_hidden_layers:
            raise ValueError(f"the KV-cache layout places {len(self.layout.layer_slots)} layers; the model has "
                             f"{m.num_hidden_layers}")
        if m.is_mla:
            check_mla_engine(config)
        with torch.device("meta"):  # nothing is allocated until the weights are taken
            self.model = model_class(m)(m)
        self.model.load_weights({k: _to(w, self.device) for k, w in weights.items()}, self.dtype,
                                config.quantization, batch_invariant=config.batch_invariant)
        self.model.eval()
        if m.is_mla:  # per layer one latent tensor, (latent, None), and attention over it (models/mla.py)
            self.attn = attn_backend or MLAAttentionBackend()
            self.kv_caches = mla_kv_caches(m, config.cache.num_blocks, self.block_size, config.kv_dtype,
                                           KV_DTYPES[config.kv_dtype], self.device, zeroed)
        else:
            self.attn = attn_backend or make_attention_backend(config.attention_backend, self.device,
                                                               config.batch_invariant)
            # [num_blocks, block_size, num_kv_heads, head_dim] (+ 4 scale bytes per row for int8: models/kv_quant.py)
            shape = cache_shape(config.cache.num_blocks, self.block_size, m.num_key_value_heads, m.head_dim,
                                config.kv_dtype)
            kv_dtype = KV_DTYPES[config.kv_dtype]
            # Zeroed so masked-out slots can never hold NaN bit patterns (an int8 row's zero scale reads as 0).
            slots = [(zeroed(shape, kv_dtype, self.device), zeroed(shape, kv_dtype, self.device))
                     for _ in range(self.layout.num_slots)]
            # Layers of different groups at one slot share its tensors: each writes only its own group's blocks.
            self.kv_caches = [slots[slot] for _, slot in self.layout.layer_slots]
        # The one-call decode step (native_decode.decode_layers) reads caches of the activations' dtype only, with one
        # block table: an int8 (or bfloat16-under-float32) cache, or several KV-cache groups, run layer by layer.
        self.fused_decode_step = config.fused_decode_step and config.kv_dtype == config.dtype \
            and self.layout.num_groups == 1
        #: The windows of the model's sliding layers (each gets its metadata per step).
        self.windows = sorted({w for w in map(m.layer_window, range(m.num_hidden_layers)) if w is not None})
        self.sampler = Sampler(seed=config.seed)
        self.proposer = make_proposer(config, draft)
        #: Seconds the last :meth:`execute` spent proposing drafts for the next step (a draft model's passes):
        #: ``auto`` speculation prices them with the drafts they propose, not with this step's rows; and of
        #: those, seconds a draft model spent catching up on context it had not read (priced with neither).
        self.propose_seconds = self.catch_up_seconds = 0.0
        self.requests: dict[str, CachedRequestState] = {}

    @property
    def kv_cache_bytes(self) -> int:
        """Bytes held by the KV cache tensors: ``num_blocks * block_size * spec.bytes_per_token()`` of the
        model's :meth:`~goodserve.config.ModelConfig.kv_cache_spec` in the resolved KV dtype and layout."""
        tensors = {id(t): t for kv in self.kv_caches for t in kv if t is not None}  # layers may share a slot's
        return sum(t.numel() * t.element_size() for t in tensors.values())

    def attention_run_positions(self) -> Optional[int]:
        """The most positions of a row one attention run holds, where the attention backend attends a row's
        positions in runs that each read its context (``None``: any number); what ``auto`` speculation prices
        a further run by (:class:`goodserve.spec.length.DraftCost`)."""
        runs = getattr(self.attn, "run_positions", None)
        m = self.config.model
        return None if runs is None else runs(m.num_attention_heads, m.num_key_value_heads, m.head_dim, self.dtype)

    def update_states(self, scheduler_output: SchedulerOutput) -> None:
        """Apply the message's diffs to the runner's per-request state.

        Raises:
            RuntimeError: if a scheduled request is unknown to the runner (a message was lost).
        """
        for rid in scheduler_output.finished_req_ids:
            self.requests.pop(rid, None)
        if self.proposer is not None and (scheduler_output.finished_req_ids or scheduler_output.preempted_req_ids):
            self.proposer.finish(scheduler_output.finished_req_ids + scheduler_output.preempted_req_ids)
        for new in scheduler_output.new_requests:
            params = new.sampling_params
            state = CachedRequestState(list(new.prompt_token_ids), params, tuple(new.eos_token_ids))
            if params.structured_outputs is not None:
                if self.structured_output is None:
                    raise RuntimeError("a request asks for structured outputs but the runner has no compiler")
                state.grammar = self.structured_output.new_state(params.structured_outputs)
            self.requests[new.request_id] = state
        for s in scheduler_output.scheduled:
            state = self.requests.get(s.request_id)
            if state is None:
                raise RuntimeError(f"request {s.request_id} was scheduled but the runner has no state for it")
            if s.resumed_from_preemption:
                state.block_ids = list(s.new_block_ids)
            else:
                if s.num_kept_blocks is not None:  # the slots of rejected drafts were freed
                    del state.block_ids[s.num_kept_blocks:]
                state.block_ids.extend(s.new_block_ids)

    def _slots(self, block_ids: list[int], start: int, end: int) -> torch.Tensor:
        pos = torch.arange(start, end)
        table = torch.tensor(block_ids, dtype=torch.long)
        return table[pos // self.block_size] * self.block_size + pos % self.block_size

    @torch.inference_mode()
    def execute(self, scheduler_output: SchedulerOutput) -> dict[str, SampledToken]:
        """Run one step.

        Args:
            scheduler_output: The step to compute.

        Returns:
            The sampled token of every request whose ``sample`` flag is set, by request id (with the drafts it
            accepted, and those proposed for its next step, under speculation). A request whose own sampling
            raised gets a ``SampledToken`` with ``error`` set instead (see :meth:`_sample`).

        Raises:
            Exception: whatever the forward pass raises (a fault of the engine, not of one request).
        """
        self.update_states(scheduler_output)
        self.propose_seconds = self.catch_up_seconds = 0.0
        if scheduler_output.is_empty:
            return {}
        input_ids, positions, meta, ordered = self._prepare_inputs(scheduler_output)
        if self.fused_decode_step and self.model.can_decode_in_one_call(input_ids.shape[0], meta, self.attn):
            hidden = self.model.decode_in_one_call(input_ids, positions, self.kv_caches, meta, self.attn)
        else:
            hidden = self.model(input_ids, positions, self.kv_caches, meta, self.attn)  # [num_tokens, hidden]
        sampling, logit_index, offset = [], [], 0
        for s in ordered:
            if self.requests[s.request_id].sampling_params.prompt_logprobs is not None:
                self._prompt_logprobs(s, hidden[offset:offset + s.num_new_tokens])
            offset += s.num_new_tokens
            if s.sample:  # the last position, or each position that verifies a draft and the one after
                sampling.append(s)
                logit_index.extend(range(offset - 1 - len(s.spec_token_ids), offset))
        if not sampling:
            return {}
        every_row = len(logit_index) == hidden.shape[0]  # a decode step's rows, in order: no gather
        rows = hidden if every_row else hidden[torch.tensor(logit_index, device=self.device)]
        logits = self.model.compute_logits(rows)  # [rows, V]
        result = self._sample(logits, sampling)
        asks = []  # (request, context, k): proposals for the next step
        for s in sampling:
            rid, token = s.request_id, result[s.request_id]
            state = self.requests[rid]
            if token.error is None and state.grammar is not None and not state.grammar.accept(token.token_id):
                result[rid] = SampledToken(token_id=-1, error=f"the grammar rejected the sampled token {token.token_id}")
                continue
            if token.error is None:
                state.output_token_ids.extend(t.token_id for t in [*token.accepted, token])
                if state.prompt_logprobs is not None and len(state.output_token_ids) == 1:
                    token.prompt_logprobs = state.prompt_logprobs
                if s.num_lookahead and self.proposer is not None:
                    asks.append((rid, state.prompt_token_ids + state.output_token_ids, s.num_lookahead))
        if asks:
            start = time.monotonic()  # the engine's clock, which times the step
            for rid, drafts in self.proposer.propose_batch(asks).items():
                result[rid].spec_token_ids = drafts
            self.propose_seconds = time.monotonic() - start
            self.catch_up_seconds = self.proposer.catch_up_seconds
        return result

    def _prompt_logprobs(self, s: ScheduledRequest, hidden: torch.Tensor) -> None:
        """Record the logprobs of the prompt tokens this chunk predicts (positions ``p`` whose next token
        ``p + 1`` is a prompt token), under the model's raw logits (no sampling parameter applies to them).

        Args:
            s: A scheduled request that asked for prompt logprobs.
            hidden: ``[s.num_new_tokens, hidden_size]`` its hidden states this step.
        """
        state = self.requests[s.request_id]
        n_prompt = len(state.prompt_token_ids)
        start = s.num_computed_tokens
        end = min(start + s.num_new_tokens, n_prompt - 1)  # the last prompt position predicts an output token
        if start == 0:
            state.prompt_logprobs = []  # (re)computed from the start, e.g. after a preemption
        if end <= start or state.prompt_logprobs is None or len(state.prompt_logprobs) != start:
            return
        logprobs = self.model.compute_logits(hidden[: end - start]).float().log_softmax(dim=-1)  # [m, V]
        targets = torch.tensor(state.prompt_token_ids[start + 1:end + 1], device=logprobs.device)  # [m]
        chosen = logprobs.gather(1, targets.unsqueeze(1)).squeeze(1).tolist()
        k = state.sampling_params.prompt_logprobs
        if k:
            # Always MAX_LOGPROBS, then the request's own count: the order of tied entries depends on how many
            # topk is asked for, and must not differ from the sampler's top logprobs at the same position.
            top = logprobs.topk(min(MAX_LOGPROBS, logprobs.shape[-1]), dim=-1)
            tops = [list(zip(i[:k], v[:k])) for i, v in zip(top.indices.tolist(), top.values.tolist())]
        else:
            tops = [[] for _ in chosen]
        state.prompt_logprobs.extend(zip(chosen, tops))

    def _prepare_inputs(self, scheduler_output: SchedulerOutput
                        ) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata, list[ScheduledRequest]]:
        """The flat batch: decodes first (shortest context first, so decodes of similar length share one
        attention call), then prefill chunks.

        Returns:
            ``input_ids`` ``[num_tokens]``, ``positions`` ``[num_tokens]``, the attention metadata (with the
            slot mapping), and the scheduled requests in batch order.
        """
        decodes = sorted((s for s in scheduler_output.scheduled if s.is_decode),
                         key=lambda s: s.num_computed_tokens)
        prefills = [s for s in scheduler_output.scheduled if not s.is_decode]
        states = [self.requests[s.request_id] for s in decodes]
        token_ids: list[int] = [st.token_ids(s.num_computed_tokens, s.num_computed_tokens + 1)[0]
                                for s, st in zip(decodes, states)]
        positions: list[int] = [s.num_computed_tokens for s in decodes]
        pos_parts = [torch.tensor(positions, dtype=torch.long)]
        for s in prefills:  # prompt chunks, and decode rows that verify drafts (their last token, then the drafts)
            state = self.requests[s.request_id]
            start, end = s.num_computed_tokens, s.num_computed_tokens + s.num_new_tokens
            token_ids.extend(state.token_ids(start, end - len(s.spec_token_ids)) + s.spec_token_ids)
            pos_parts.append(torch.arange(start, end))
        prefill_states = [self.requests[s.request_id] for s in prefills]
        metas = [self._group_metadata(g, [self.layout.group_table(st.block_ids, g) for st in states], positions,
                                      prefills, [self.layout.group_table(st.block_ids, g) for st in prefill_states])
                 for g in range(self.layout.num_groups)]
        meta = metas[0]
        if len(metas) > 1:
            meta.layer_metadata = [metas[g] for g, _ in self.layout.layer_slots]
        input_ids = torch.tensor(token_ids, dtype=torch.long, device=self.device)
        return input_ids, torch.cat(pos_parts).to(self.device), meta, decodes + prefills

    def _group_metadata(self, group: int, decode_tables: list[list[int]], positions: list[int],
                        prefills: list[ScheduledRequest], prefill_tables: list[list[int]]) -> AttentionMetadata:
        """One KV-cache group's attention metadata for the step: its slot mapping and block tables, windowed for a
        sliding group of several; with one group, plus a windowed view per window of the model's sliding layers.

        Args:
            group: The group.
            decode_tables: Each decode's group table, in batch order; ``positions`` their query positions.
            prefills: The prefill chunks after the decodes; ``prefill_tables`` their group tables.
        """
        bs = self.block_size
        slots = [t[p // bs] * bs + p % bs for t, p in zip(decode_tables, positions)]
        slot_parts = [torch.tensor(slots, dtype=torch.long)]
        chunks = []
        for s, table in zip(prefills, prefill_tables):
            slot_parts.append(self._slots(table, s.num_computed_tokens, s.num_computed_tokens + s.num_new_tokens))
            chunks.append((s.num_computed_tokens, s.num_new_tokens, table))
        dev = self.device
        tables = [t[: p // self.block_size + 1] for t, p in zip(decode_tables, positions)]
        lens = [p + 1 for p in positions]
        slot_mapping = torch.cat(slot_parts).to(dev)
        window = self.layout.group_windows[group]
        if window is not None and self.layout.num_groups > 1:
            return build_windowed(self.block_size, window, tables, lens, chunks, slot_mapping, dev)
        meta = AttentionMetadata.build(self.block_size, decode_block_tables=tables, decode_seq_lens=lens,
                                       prefill_chunks=chunks, slot_mapping=slot_mapping, device=dev,
                                       decode_groups=getattr(self.attn, "uses_decode_groups", True),
                                       per_row=getattr(self.attn, "uses_row_tables", False))
        if self.layout.num_groups == 1:
            for w in self.windows:  # the sliding layers' own view of the step's one table
                meta.windowed[w] = build_windowed(self.block_size, w, tables, lens, chunks, slot_mapping, dev)
        return meta

    def _sample(self, logits: torch.Tensor, scheduled: list[ScheduledRequest]) -> dict[str, SampledToken]:
        """Sample every row in one batch; if that raises, sample request by request so that only the requests
        whose rows raise fail (one request's processing must never fail its batch neighbours, case C19). A
        request that verifies drafts has a row per position (:func:`expand_rows`) and its result is
        :func:`verify`'s.

        Args:
            logits: ``[num_rows, vocab_size]``, the requests' rows in order.
            scheduled: The requests that sample, in order.

        Returns:
            A ``SampledToken`` per request; those whose rows raised have ``error`` set.
        """
        groups = []
        for s in scheduled:
            st = self.requests[s.request_id]
            row = SamplingRow(params=st.sampling_params, prompt_token_ids=st.prompt_token_ids,
                              output_token_ids=st.output_token_ids, eos_token_ids=st.eos_token_ids, grammar=st.grammar)
            groups.append(expand_rows(row, s.spec_token_ids))
        vocab, dev = logits.shape[-1], logits.device
        try:
            rows = [r for g in groups for r in g]
            return self._results(self.sampler(logits, SamplingMetadata.from_requests(rows, vocab, dev)), scheduled,
                                 groups)
        except Exception:  # noqa: BLE001 - find the requests at fault below
            logger.exception("sampling a batch of %d rows failed; sampling request by request", logits.shape[0])
        result, start = {}, 0
        for s, group in zip(scheduled, groups):
            part = logits[start:start + len(group)]
            start += len(group)
            try:
                out = self.sampler(part, SamplingMetadata.from_requests(group, vocab, dev))
            except Exception as e:  # noqa: BLE001 - this request alone fails
                logger.exception("sampling request %s failed", s.request_id)
                result[s.request_id] = SampledToken(token_id=-1, error=f"sampling failed: {type(e).__name__}: {e}")
                continue
            result.update(self._results(out, [s], [group]))
        return result

    @staticmethod
    def _results(out: SamplerOutput, scheduled: list[ScheduledRequest], groups: list[list[SamplingRow]]
                 ) -> dict[str, SampledToken]:
        """Each request's result from the sampler's rows (in order, ``len(group)`` rows per request)."""
        tokens = [SampledToken(token_id=out.token_ids[i], logprob=out.logprobs[i] if out.logprobs is not None else None,
                               top_logprobs=out.top_logprobs[i] if out.top_logprobs is not None else None)
                  for i in range(len(out.token_ids))]
        result, start = {}, 0
        for s, group in zip(scheduled, groups):
            result[s.request_id] = verify(tokens[start:start + len(group)], s.spec_token_ids)
            start += len(group)
        return result
