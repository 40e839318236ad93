"""The offline API: ``LLM(...).generate(prompts, params)`` and ``LLM(...).chat(messages)``."""

from __future__ import annotations

import dataclasses
import time
from typing import Optional, Sequence, Union

from goodserve.engine.args import EngineArgs
from goodserve.engine.engine import Engine, PromptType
from goodserve.outputs import RequestOutput
from goodserve.sampling_params import RequestOutputKind, SamplingParams

Message = dict[str, str]


class LLM:
    """An engine driven to completion for a batch of prompts.

    Args:
        model: GGUF file or HF model directory; ``None`` is the default model (SmolLM2-135M-Instruct).
        **engine_args: Any field of :class:`goodserve.engine.args.EngineArgs` (``dtype``, ``num_blocks``,
            ``max_num_batched_tokens``, ``max_num_seqs``, ``scheduling_policy``, ...).

    Raises:
        ValueError: on an invalid engine argument.
    """

    def __init__(self, model: Optional[str] = None, **engine_args) -> None:
        self.engine = Engine(EngineArgs(model=model, **engine_args))

    def get_tokenizer(self):
        """The model's ``transformers`` tokenizer."""
        tokenizer = self.engine.tokenizer
        return getattr(tokenizer, "transformers_tokenizer", tokenizer)  # a GGUFTokenizer builds it on demand

    def generate(self, prompts: Union[PromptType, Sequence[PromptType]],
                 sampling_params: Union[SamplingParams, Sequence[SamplingParams], None] = None,
                 use_tqdm: bool = True, priority: Optional[Sequence[int]] = None,
                 cache_salt: Union[str, Sequence[Optional[str]], None] = None) -> list[RequestOutput]:
        """Generate for every prompt, continuously batched.

        Args:
            prompts: A text, a list of token ids, or a list of either.
            sampling_params: One for all prompts or one per prompt (default ``SamplingParams()``).
            use_tqdm: Show a progress bar with live prefill and decode tokens/s.
            priority: Per-prompt priority for the ``priority`` policy (lower first).
            cache_salt: One prefix-cache salt for all prompts or one per prompt (``None`` entries: no
                salt); only requests with the same salt share cached KV blocks.

        Returns:
            One finished ``RequestOutput`` per prompt, in the order given.

        Raises:
            ValueError: on a bad prompt or parameter; nothing is left queued.
        """
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]  # type: ignore[list-item]
        prompts = list(prompts)
        if sampling_params is None or isinstance(sampling_params, SamplingParams):
            params_list = [sampling_params or SamplingParams()] * len(prompts)
        else:
            params_list = list(sampling_params)
            if len(params_list) != len(prompts):
                raise ValueError(f"got {len(params_list)} sampling params for {len(prompts)} prompts")
        if priority is not None and len(priority) != len(prompts):
            raise ValueError(f"got {len(priority)} priorities for {len(prompts)} prompts")
        if cache_salt is None or isinstance(cache_salt, str):
            salts = [cache_salt] * len(prompts)
        else:
            salts = list(cache_salt)
            if len(salts) != len(prompts):
                raise ValueError(f"got {len(salts)} cache salts for {len(prompts)} prompts")
        ids = []
        try:
            for i, (prompt, params) in enumerate(zip(prompts, params_list)):
                final_only = dataclasses.replace(params, output_kind=RequestOutputKind.FINAL_ONLY)
                options = self.engine.config.request_options(priority[i] if priority else 0, salts[i])
                ids.append(self.engine.add_request(prompt, final_only, options=options))
        except ValueError:
            self.engine.abort(ids)
            raise
        return self._run(ids, use_tqdm)

    def chat(self, messages: Union[Sequence[Message], Sequence[Sequence[Message]]],
             sampling_params: Union[SamplingParams, Sequence[SamplingParams], None] = None,
             use_tqdm: bool = True) -> list[RequestOutput]:
        """Generate replies to one conversation or a list of them, using the model's chat template.

        Args:
            messages: ``[{"role": ..., "content": ...}, ...]`` or a list of such conversations.

        Returns:
            One ``RequestOutput`` per conversation.
        """
        conversations = [messages] if messages and isinstance(messages[0], dict) else list(messages)
        prompts = [self.apply_chat_template(conv) for conv in conversations]  # type: ignore[arg-type]
        return self.generate(prompts, sampling_params, use_tqdm=use_tqdm)

    def apply_chat_template(self, messages: Sequence[Message]) -> list[int]:
        """Token ids of a conversation with the generation prompt appended.

        Raises:
            ValueError: if the model has no chat template, a message holds text that is not valid Unicode, or
                the template rejects the conversation.
        """
        return self.engine.apply_chat_template(messages)

    def _run(self, request_ids: list[str], use_tqdm: bool) -> list[RequestOutput]:
        finished: dict[str, RequestOutput] = {}
        wanted = set(request_ids)
        bar = None
        if use_tqdm:  # imported only for a bar: ~70 ms of a one-shot command's start
            from tqdm.auto import tqdm

            bar = tqdm(total=len(request_ids), desc="Processed prompts", dynamic_ncols=True)
        prefill_tokens = decode_tokens = 0
        start = time.perf_counter()
        stats = self.engine.stats
        while len(finished) < len(wanted) and self.engine.has_unfinished_requests():
            p0, d0 = stats.num_prefill_tokens, stats.num_decode_tokens
            for out in self.engine.step():
                if out.finished and out.request_id in wanted:
                    finished[out.request_id] = out
                    if bar is not None:
                        bar.update(1)
            prefill_tokens += stats.num_prefill_tokens - p0
            decode_tokens += stats.num_decode_tokens - d0
            if bar is not None:
                elapsed = max(time.perf_counter() - start, 1e-9)
                bar.set_postfix_str(f"prefill {prefill_tokens / elapsed:.0f} tok/s, "
                                    f"decode {decode_tokens / elapsed:.0f} tok/s", refresh=False)
        if bar is not None:
            bar.close()
        return [finished[rid] for rid in request_ids]
