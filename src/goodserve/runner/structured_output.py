"""Structured outputs: grammars compiled by xgrammar (Dong et al. 2024, "XGrammar: Flexible and Efficient
Structured Generation Engine for Large Language Models"), applied as a token bitmask in the sampler.

A request's :class:`~goodserve.sampling_params.StructuredOutputsParams` (a JSON schema, or any JSON object) is
compiled once per distinct grammar by a :class:`StructuredOutputCompiler` (xgrammar caches compiled grammars),
which the engine uses to refuse an invalid schema up front (``ValueError``, an HTTP 400) and the runner to
build each constrained request's :class:`GrammarState`. Each step, the sampler asks the constrained rows'
states for their next-token bitmask and sets every forbidden token's logit to ``-inf``; rows without a
grammar are never touched. After a token is sampled the runner advances the request's matcher by it.

Compiled with ``any_whitespace=False`` (JSON written compactly, as ``json.dumps`` does), so a model cannot
wander in an unbounded run of whitespace; the grammar accepts the model's EOS only where the JSON value is
complete.

One repair of xgrammar 0.2.9's output: for a string with ``minLength``/``maxLength`` it writes the characters as
``[^"\\\r\n]``, which admits raw control characters that JSON forbids inside strings (RFC 8259 §7; Python's
``json.loads`` refuses them). :meth:`StructuredOutputCompiler.compile` rewrites that class to exclude
U+0000..U+001F, as xgrammar's own unbounded string rule does.
"""

from __future__ import annotations

import json
import re
import threading
from typing import Any, Optional, Sequence

import torch

from goodserve.sampling_params import StructuredOutputsParams
from goodserve.validation import ParamError

_PARAM = "response_format.json_schema.schema"
# xgrammar 0.2.9's character class for length-limited strings (admits control characters), and the fix.
_RAW_STRING_CHARS = r'[^\"\\\r\n]'
_JSON_STRING_CHARS = r'[^\0-\x1f\"\\]'
_CACHE_SIZE = 256  # compiled grammars kept (by schema text)


def _xgr() -> Any:
    """The xgrammar module, imported on first use (a one-shot command with no grammar never loads it)."""
    import xgrammar

    return xgrammar


def allocate_bitmask(num_rows: int, vocab_size: int) -> torch.Tensor:
    """An all-allowed bitmask ``[num_rows, ceil(vocab_size / 32)]`` int32 on the CPU (xgrammar's layout)."""
    return _xgr().allocate_token_bitmask(num_rows, vocab_size)


def apply_bitmask_(logits: torch.Tensor, bitmask: torch.Tensor, rows: list[int]) -> None:
    """Set the logits of forbidden tokens to ``-inf`` on the given rows only, in place (xgrammar's kernel;
    the other rows are not read or written).

    Args:
        logits: ``[num_seqs, vocab_size]`` float32.
        bitmask: ``[num_seqs, ceil(vocab_size / 32)]`` int32, on the device of ``logits``.
        rows: Batch indices of the constrained rows.
    """
    _xgr().apply_token_bitmask_inplace(logits, bitmask, vocab_size=logits.shape[1], indices=rows)


class GrammarState:
    """One constrained request's position in its grammar (an xgrammar ``GrammarMatcher``).

    Args:
        compiled: Its compiled grammar.
    """

    def __init__(self, compiled: Any) -> None:
        self._matcher = _xgr().GrammarMatcher(compiled)

    def fill_bitmask(self, bitmask: torch.Tensor, row: int) -> None:
        """Write the tokens allowed next into ``bitmask[row]`` (``[*, ceil(V / 32)]`` int32, CPU)."""
        self._matcher.fill_next_token_bitmask(bitmask, row)

    def accept(self, token_id: int) -> bool:
        """Advance by one sampled token; ``False`` (state unchanged) if the grammar does not allow it."""
        return bool(self._matcher.accept_token(token_id))

    @property
    def is_terminated(self) -> bool:
        """Whether the output is complete (the grammar accepted a stop token)."""
        return bool(self._matcher.is_terminated())


class StructuredOutputCompiler:
    """Compiles grammars for one tokenizer (thread-safe; the tokenizer's info is built on first use).

    Args:
        tokenizer: The model's ``transformers`` tokenizer.
        vocab_size: ``V``, the width of the model's logits (may exceed the tokenizer's vocabulary).
        stop_token_ids: The model's EOS ids: the only tokens the grammar allows once the output is complete.
    """

    def __init__(self, tokenizer: Any, vocab_size: int, stop_token_ids: Sequence[int]) -> None:
        self._tokenizer, self.vocab_size, self._stop = tokenizer, vocab_size, list(stop_token_ids)
        self._compiler: Optional[Any] = None  # xgrammar.GrammarCompiler
        self._lock = threading.Lock()
        self._cache: dict[str, Any] = {}

    def _get(self) -> Any:
        xgr = _xgr()
        with self._lock:
            if self._compiler is None:
                tokenizer = getattr(self._tokenizer, "transformers_tokenizer", self._tokenizer)  # see GGUFTokenizer
                info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=self.vocab_size,
                                                          stop_token_ids=self._stop or None)
                self._compiler = xgr.GrammarCompiler(info, max_threads=1)
            return self._compiler

    def compile(self, params: StructuredOutputsParams) -> Any:
        """The compiled grammar of ``params`` (cached by xgrammar).

        Raises:
            ValueError: if the schema is not valid JSON, not a JSON schema, or uses what xgrammar cannot
                compile (the message says which).
        """
        compiler = self._get()
        if params.json_object:  # any JSON object (not any JSON value), written compactly
            return compiler.compile_json_schema('{"type": "object"}', any_whitespace=False)
        try:
            schema = json.loads(params.json)
        except (TypeError, json.JSONDecodeError) as e:
            raise ParamError(f"{_PARAM} must be a JSON schema: {e}", param=_PARAM) from None
        if not isinstance(schema, dict):
            raise ParamError(f"{_PARAM} must be a JSON object", param=_PARAM)
        with self._lock:
            cached = self._cache.get(params.json)
        if cached is not None:
            return cached
        xgr = _xgr()
        try:
            grammar = xgr.Grammar.from_json_schema(params.json, any_whitespace=False)
            ebnf = str(grammar)
            if _RAW_STRING_CHARS in ebnf:
                grammar = xgr.Grammar.from_ebnf(ebnf.replace(_RAW_STRING_CHARS, _JSON_STRING_CHARS))
            compiled = compiler.compile_grammar(grammar)
        except Exception as e:  # noqa: BLE001 - xgrammar raises RuntimeError/ValueError for schemas it refuses
            # Drop xgrammar's "[time] file.cc:line: " prefix: the client needs the reason only.
            reason = re.sub(r"^\[[\d:]+\] \S+:\d+: ", "", str(e).strip())
            raise ParamError(f"{_PARAM} is not a JSON schema this server can enforce: {reason}", param=_PARAM) from None
        with self._lock:
            if len(self._cache) >= _CACHE_SIZE:
                self._cache.pop(next(iter(self._cache)))
            self._cache[params.json] = compiled
        return compiled

    def new_state(self, params: StructuredOutputsParams) -> GrammarState:
        """A fresh matcher for one request."""
        return GrammarState(self.compile(params))
