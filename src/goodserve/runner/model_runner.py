"""Turns a ``SchedulerOutput`` into one forward pass of the real model and samples the next tokens.

The runner owns the weights, the paged KV cache tensors and the sampler. It keeps no per-request state
between steps: everything it needs arrives in the ``SchedulerOutput`` (token ids, positions, block tables),
so preemption, chunking and prefix hits need no special handling here.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Optional

import torch

from goodserve.config import EngineConfig
from goodserve.models.llama import LlamaForCausalLM
from goodserve.runner.attention import AttentionBackend, AttentionMetadata, TorchAttentionBackend
from goodserve.runner.sampler import Sampler, SamplerOutput, SamplingMetadata, SamplingRow
from goodserve.scheduler.output import ScheduledRequest, SchedulerOutput

logger = logging.getLogger(__name__)

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass
class SampledToken:
    """One request's sampled token of a step.

    Attributes:
        token_id: The token (``-1`` when ``error`` is set).
        logprob: Its log-probability, or ``None`` when not asked for.
        top_logprobs: ``(token_id, logprob)`` of the most likely tokens when ``logprobs`` was asked for.
        error: Why this request's row could not be sampled (its own processing raised), else ``None``.
    """

    token_id: int
    logprob: Optional[float] = None
    top_logprobs: Optional[list[tuple[int, float]]] = None
    error: Optional[str] = None


class ModelRunner:
    """Executes scheduled steps on a device.

    Args:
        config: The resolved engine config (``cache.num_blocks`` set).
        weights: HF-named weights (see ``goodserve.models.loader``).
        attn_backend: Paged attention implementation; the portable PyTorch one by default.
    """

    def __init__(self, config: EngineConfig, weights: dict[str, torch.Tensor],
                 attn_backend: Optional[AttentionBackend] = None) -> None:
        self.config = config
        self.device = torch.device(config.device)
        self.dtype = DTYPES[config.dtype]
        self.block_size = config.cache.block_size
        m = config.model
        with torch.device(self.device):
            self.model = LlamaForCausalLM(m).to(self.dtype)
        self.model.load_weights(weights)
        self.model.inv_freq = self.model.inv_freq.float()
        self.model.eval()
        self.attn = attn_backend or TorchAttentionBackend()
        shape = (config.cache.num_blocks, self.block_size, m.num_key_value_heads, m.head_dim)
        # Zeroed so masked-out slots can never hold NaN bit patterns.
        self.kv_caches = [(torch.zeros(shape, dtype=self.dtype, device=self.device),
                           torch.zeros(shape, dtype=self.dtype, device=self.device))
                          for _ in range(m.num_hidden_layers)]
        self.sampler = Sampler(seed=config.seed)

    @property
    def kv_cache_bytes(self) -> int:
        """Bytes held by the KV cache tensors."""
        return sum(k.numel() * k.element_size() * 2 for k, _ in self.kv_caches)

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
            The sampled token of every request whose ``sample`` flag is set, by request id. A request whose
            own sampling raised gets a ``SampledToken`` with ``error`` set instead (see :meth:`_sample`).

        Raises:
            Exception: whatever the forward pass raises (a fault of the engine, not of one request).
        """
        if scheduler_output.is_empty:
            return {}
        # Decodes shortest context first, so decodes of similar length share one attention call.
        decodes = sorted((s for s in scheduler_output.scheduled if s.is_decode),
                         key=lambda s: s.num_computed_tokens)
        prefills = [s for s in scheduler_output.scheduled if not s.is_decode]
        ordered: list[ScheduledRequest] = decodes + prefills

        token_ids: list[int] = [s.request.all_token_ids[s.num_computed_tokens] for s in decodes]
        positions: list[int] = [s.num_computed_tokens for s in decodes]
        slots: list[int] = [s.block_ids[p // self.block_size] * self.block_size + p % self.block_size
                            for s, p in zip(decodes, positions)]
        slot_parts = [torch.tensor(slots, dtype=torch.long)]
        pos_parts = [torch.tensor(positions, dtype=torch.long)]
        for s in prefills:
            start, end = s.num_computed_tokens, s.num_computed_tokens + s.num_new_tokens
            token_ids.extend(s.request.all_token_ids[start:end])
            pos_parts.append(torch.arange(start, end))
            slot_parts.append(self._slots(s.block_ids, start, end))

        dev = self.device
        input_ids = torch.tensor(token_ids, dtype=torch.long, device=dev)
        pos = torch.cat(pos_parts).to(dev)
        meta = AttentionMetadata.build(
            self.block_size,
            decode_block_tables=[s.block_ids[: p // self.block_size + 1] for s, p in zip(decodes, positions)],
            decode_seq_lens=[p + 1 for p in positions],
            prefill_chunks=[(s.num_computed_tokens, s.num_new_tokens, s.block_ids) for s in prefills],
            slot_mapping=torch.cat(slot_parts).to(dev),
            device=dev,
        )
        hidden = self.model(input_ids, pos, self.kv_caches, meta, self.attn)  # [num_tokens, hidden]

        sampling = []
        last_index = []
        offset = 0
        for s in ordered:
            offset += s.num_new_tokens
            if s.sample:
                sampling.append(s)
                last_index.append(offset - 1)
        if not sampling:
            return {}
        logits = self.model.compute_logits(hidden[torch.tensor(last_index, device=dev)])  # [num_sampled, vocab]
        rows = [SamplingRow(params=s.request.sampling_params, prompt_token_ids=s.request.prompt_token_ids,
                            output_token_ids=s.request.output_token_ids, eos_token_ids=s.request.eos_token_ids)
                for s in sampling]
        return self._sample(logits, rows, [s.request_id for s in sampling])

    def _sample(self, logits: torch.Tensor, rows: list[SamplingRow],
                request_ids: list[str]) -> dict[str, SampledToken]:
        """Sample every row in one batch; if that raises, sample row by row so that only the rows that raise
        fail (one request's processing must never fail its batch neighbours, case C19).

        Args:
            logits: ``[num_sampled, vocab_size]``.
            rows: One per logits row.
            request_ids: The request of each row.

        Returns:
            A ``SampledToken`` per request; those whose row raised have ``error`` set.
        """
        vocab, dev = logits.shape[-1], logits.device
        try:
            return self._tokens(self.sampler(logits, SamplingMetadata.from_requests(rows, vocab, dev)), request_ids)
        except Exception:  # noqa: BLE001 - find the rows at fault below
            logger.exception("sampling a batch of %d rows failed; sampling them one by one", len(rows))
        result = {}
        for i, (row, rid) in enumerate(zip(rows, request_ids)):
            try:
                out = self.sampler(logits[i:i + 1], SamplingMetadata.from_requests([row], vocab, dev))
            except Exception as e:  # noqa: BLE001 - this request alone fails
                logger.exception("sampling request %s failed", rid)
                result[rid] = SampledToken(token_id=-1, error=f"sampling failed: {type(e).__name__}: {e}")
                continue
            result.update(self._tokens(out, [rid]))
        return result

    @staticmethod
    def _tokens(out: SamplerOutput, request_ids: list[str]) -> dict[str, SampledToken]:
        return {rid: SampledToken(token_id=out.token_ids[i],
                                  logprob=out.logprobs[i] if out.logprobs is not None else None,
                                  top_logprobs=out.top_logprobs[i] if out.top_logprobs is not None else None)
                for i, rid in enumerate(request_ids)}
