"""Per-request sampling and stopping parameters (names and meaning as in vLLM and the OpenAI API)."""

from __future__ import annotations

import enum
import math
from dataclasses import dataclass, field
from typing import Optional, Sequence

from goodserve.validation import check_text


# Below this temperature sampling is greedy (vLLM's _SAMPLING_EPS): logits / 1e-40 overflow float32 to inf,
# and the softmax of infinities is NaN (case C14).
GREEDY_TEMPERATURE = 1e-5


MAX_LOGPROBS = 20  # most top logprobs per token
MAX_LOGIT_BIAS = 100.0  # |bias| allowed by OpenAI's logit_bias


@dataclass(frozen=True)
class StructuredOutputsParams:
    """A grammar the output must follow (plain data; compiled by :mod:`goodserve.runner.structured_output`).

    Attributes:
        json: A JSON schema (serialised as a JSON string) the output must validate against.
        json_object: Any JSON object (OpenAI ``response_format: {"type": "json_object"}``).

    Exactly one of them is set.
    """

    json: Optional[str] = None
    json_object: bool = False

    def __post_init__(self) -> None:
        if (self.json is None) == (not self.json_object):
            raise ValueError("structured_outputs needs exactly one of json (a schema) or json_object")


class RequestOutputKind(enum.Enum):
    """What each of a request's outputs holds (as in vLLM)."""

    DELTA = "delta"  # what is new since the previous output (the default; what a stream sends)
    CUMULATIVE = "cumulative"  # everything so far
    FINAL_ONLY = "final_only"  # one output, when the request finishes (``LLM.generate``)


@dataclass
class SamplingParams:
    """How one request samples and when it stops.

    Attributes:
        temperature: Softmax temperature; ``0`` means greedy (argmax).
        top_p: Nucleus sampling: keep the smallest set of tokens whose probability sums to ``top_p``.
        top_k: Keep the ``top_k`` most likely tokens; ``0`` or ``-1`` keeps all.
        min_p: Drop tokens whose probability is below ``min_p`` times the most likely token's.
        seed: Per-request seed. The same seed and prompt give the same tokens whatever the batch.
        max_tokens: Most tokens to generate; ``None`` runs until EOS or the context limit.
        min_tokens: EOS, ``stop_token_ids`` and stop strings are ignored before this many tokens.
        stop: Strings that end generation, matched on the detokenised text across token boundaries;
            the matched string is excluded from the output.
        stop_token_ids: Token ids that end generation (the token is kept in ``token_ids``).
        ignore_eos: Keep generating past EOS.
        presence_penalty: Subtracted from a token's logit once if it has appeared in the output.
        frequency_penalty: Subtracted from a token's logit once per appearance in the output.
        repetition_penalty: CTRL-style (Keskar et al. 2019, §4.1) penalty over prompt and output:
            positive logits are divided by it, negative ones multiplied; ``1`` disables it.
        logprobs: Number of top log-probabilities to return per generated token (``None``: none). Every
            logprob is taken from one distribution: the log-softmax of the model's logits after the logit
            processors (``min_tokens``, penalties, ``logit_bias``, a ``structured_outputs`` grammar) and
            before temperature, top-k, top-p and min-p (as OpenAI and vLLM report them), so the sampled
            token's logprob equals its entry among the top logprobs and does not move with temperature.
        prompt_logprobs: Number of top log-probabilities to return per prompt token (``None``: none). The
            first prompt token has none; the others' come from the model's raw logits at the position
            before. A request asking for them never reads the prefix cache (every position is computed).
        logit_bias: ``{token_id: bias}`` added to the logits before sampling (OpenAI ``logit_bias``; bias in
            ``[-100, 100]``: -100 in effect bans a token, +100 in effect forces it).
        structured_outputs: Constrain the output to a grammar (JSON schema or any JSON object).
        skip_special_tokens: Drop special tokens from the detokenised text.
        output_kind: What each output holds: the delta since the previous one (default), everything so
            far, or one final output.
    """

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: Optional[int] = None
    max_tokens: Optional[int] = 16
    min_tokens: int = 0
    stop: Sequence[str] = field(default_factory=list)
    stop_token_ids: Sequence[int] = field(default_factory=list)
    ignore_eos: bool = False
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logprobs: Optional[int] = None
    prompt_logprobs: Optional[int] = None
    logit_bias: Optional[dict[int, float]] = None
    structured_outputs: Optional[StructuredOutputsParams] = None
    skip_special_tokens: bool = True
    output_kind: RequestOutputKind = RequestOutputKind.DELTA

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop or [])
        self.stop_token_ids = list(self.stop_token_ids or [])
        self.validate()

    @property
    def greedy(self) -> bool:
        """Whether this request takes the argmax at every step: temperature 0, or one so small (below
        ``GREEDY_TEMPERATURE``) that dividing by it would overflow the logits (case C14)."""
        return self.temperature < GREEDY_TEMPERATURE

    def validate(self) -> None:
        """Check every field.

        Raises:
            ValueError: naming the field, its value and the allowed range.
        """
        def bad(name: str, value: object, rule: str) -> ValueError:
            return ValueError(f"{name} must be {rule}, got {value!r}")

        for name in ("temperature", "top_p", "min_p", "presence_penalty", "frequency_penalty",
                     "repetition_penalty"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
                raise bad(name, value, "a finite number")
        if self.temperature < 0.0:
            raise bad("temperature", self.temperature, ">= 0")
        if not 0.0 < self.top_p <= 1.0:
            raise bad("top_p", self.top_p, "in (0, 1]")
        if not isinstance(self.top_k, int) or isinstance(self.top_k, bool) or self.top_k < -1:
            raise bad("top_k", self.top_k, "an integer >= -1 (0 or -1 disables it)")
        if not 0.0 <= self.min_p <= 1.0:
            raise bad("min_p", self.min_p, "in [0, 1]")
        if not -2.0 <= self.presence_penalty <= 2.0:
            raise bad("presence_penalty", self.presence_penalty, "in [-2, 2]")
        if not -2.0 <= self.frequency_penalty <= 2.0:
            raise bad("frequency_penalty", self.frequency_penalty, "in [-2, 2]")
        if self.repetition_penalty <= 0.0:
            raise bad("repetition_penalty", self.repetition_penalty, "> 0")
        if self.max_tokens is not None and (not isinstance(self.max_tokens, int) or self.max_tokens < 1):
            raise bad("max_tokens", self.max_tokens, "an integer >= 1 or None")
        if not isinstance(self.min_tokens, int) or self.min_tokens < 0:
            raise bad("min_tokens", self.min_tokens, "an integer >= 0")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise ValueError(f"min_tokens ({self.min_tokens}) must be <= max_tokens ({self.max_tokens})")
        if self.seed is not None and (not isinstance(self.seed, int) or isinstance(self.seed, bool)):
            raise bad("seed", self.seed, "an integer or None")
        for i, s in enumerate(self.stop):
            if not isinstance(s, str) or not s:
                raise bad("stop", self.stop, "a list of non-empty strings")
            check_text(s, f"stop[{i}]")
        for t in self.stop_token_ids:
            if not isinstance(t, int) or t < 0:
                raise bad("stop_token_ids", self.stop_token_ids, "a list of token ids >= 0")
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, int) or isinstance(value, bool)
                                      or not 0 <= value <= MAX_LOGPROBS):
                raise bad(name, value, f"an integer in [0, {MAX_LOGPROBS}] or None")
        for token, bias in (self.logit_bias or {}).items():
            if not isinstance(token, int) or isinstance(token, bool) or token < 0:
                raise bad("logit_bias", token, "keyed by token ids >= 0")
            if isinstance(bias, bool) or not isinstance(bias, (int, float)) or not -MAX_LOGIT_BIAS <= bias <= MAX_LOGIT_BIAS:
                raise bad("logit_bias", bias, f"a map to numbers in [-{MAX_LOGIT_BIAS:g}, {MAX_LOGIT_BIAS:g}]")
        if self.structured_outputs is not None:
            if not isinstance(self.structured_outputs, StructuredOutputsParams):
                raise bad("structured_outputs", self.structured_outputs, "a StructuredOutputsParams")
            if self.ignore_eos:
                raise ValueError("ignore_eos must be false with structured outputs (the grammar ends the output "
                                 "with EOS once the JSON is complete)")
            if self.min_tokens:
                raise ValueError("min_tokens must be 0 with structured outputs (the grammar decides where the "
                                 "output may end)")
        if not isinstance(self.output_kind, RequestOutputKind):
            raise bad("output_kind", self.output_kind, "a RequestOutputKind")
