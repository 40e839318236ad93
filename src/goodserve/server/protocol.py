"""Pydantic schemas of the OpenAI-compatible API (requests in, responses out) and their mapping to
:class:`SamplingParams`.

Field names and meanings follow the OpenAI API; ``top_k``, ``min_p``, ``repetition_penalty``,
``ignore_eos``, ``min_tokens``, ``stop_token_ids``, ``skip_special_tokens``, ``priority`` and ``cache_salt``
(only requests with the same salt share prefix-cache blocks) are extensions (as in vLLM). Unknown fields
are ignored. Errors in values that pydantic cannot see (ranges, an empty prompt) surface as ``ValueError``
from :meth:`SamplingParams.validate` or the engine and become HTTP 400.
"""

from __future__ import annotations

import time
from typing import Annotated, Any, Literal, Optional, Union

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, model_validator
from pydantic_core import PydanticCustomError

from goodserve.sampling_params import SamplingParams
from goodserve.validation import find_invalid_text

MAX_N = 128  # most choices per request (n times the number of prompts)
MAX_LOGPROBS = 20  # most top logprobs per token



def _whole_number(value: Any) -> Any:
    """``2.0`` is the integer 2, as JSON Schema says; ``2.5``, ``"2"`` and ``true`` are not integers."""
    return int(value) if isinstance(value, float) and value.is_integer() else value


Int = Annotated[int, BeforeValidator(_whole_number)]
NonEmptyStr = Annotated[str, Field(min_length=1)]
TokenId = Annotated[Int, Field(ge=0)]


class OpenAIModel(BaseModel):
    model_config = ConfigDict(extra="ignore")


class OpenAIRequest(OpenAIModel):
    """A request body, validated strictly (``true`` is not an integer, ``"1"`` not a number) and with the
    ranges written into the schema, so ``/openapi.json`` says what the server accepts. Every string in it,
    at any depth and in fields we ignore too, must be valid Unicode (no lone surrogates): otherwise a 400
    naming the field, before any tokenizer or template sees it (C19)."""

    model_config = ConfigDict(extra="ignore", strict=True)

    @model_validator(mode="before")
    @classmethod
    def _text_is_unicode(cls, data: Any) -> Any:
        found = find_invalid_text(data)
        if found is not None:
            path, message = found
            raise PydanticCustomError("invalid_unicode", "{message}",
                                      {"message": message, "param": path or None, "code": "invalid_unicode"})
        return data


# --------------------------------------------------------------------------------------------- errors
class ErrorInfo(OpenAIModel):
    message: str
    type: str
    param: Optional[str] = None
    code: Optional[Union[int, str]] = None


class ErrorResponse(OpenAIModel):
    error: ErrorInfo


# --------------------------------------------------------------------------------------------- requests
class StreamOptions(OpenAIModel):
    include_usage: bool = False


class SamplingRequest(OpenAIRequest):
    """Fields shared by ``/v1/completions`` and ``/v1/chat/completions``."""

    model: Optional[str] = None
    n: Int = Field(1, ge=1, le=MAX_N)
    temperature: Optional[float] = Field(None, ge=0.0, le=2.0, allow_inf_nan=False)
    top_p: Optional[float] = Field(None, gt=0.0, le=1.0)
    top_k: Optional[Int] = Field(None, ge=-1)
    min_p: Optional[float] = Field(None, ge=0.0, le=1.0)
    seed: Optional[Int] = None
    stop: Optional[Union[NonEmptyStr, list[NonEmptyStr]]] = None
    stop_token_ids: Optional[list[TokenId]] = None
    presence_penalty: Optional[float] = Field(None, ge=-2.0, le=2.0)
    frequency_penalty: Optional[float] = Field(None, ge=-2.0, le=2.0)
    repetition_penalty: Optional[float] = Field(None, gt=0.0, allow_inf_nan=False)
    ignore_eos: bool = False
    min_tokens: Int = Field(0, ge=0)
    skip_special_tokens: bool = True
    stream: bool = False
    stream_options: Optional[StreamOptions] = None
    priority: Int = 0
    cache_salt: Optional[str] = None
    user: Optional[str] = None
    slo_ttft_ms: Optional[float] = Field(None, gt=0.0, allow_inf_nan=False)
    slo_tpot_ms: Optional[float] = Field(None, gt=0.0, allow_inf_nan=False)
    slo_class: Optional[str] = None

    @property
    def include_usage(self) -> bool:
        return bool(self.stream and self.stream_options and self.stream_options.include_usage)

    def check_n(self, num_prompts: int = 1) -> None:
        """Raises ValueError unless ``1 <= n`` and ``n * num_prompts <= MAX_N``."""
        if self.n < 1:
            raise ValueError(f"n must be >= 1, got {self.n}")
        if self.n * num_prompts > MAX_N:
            raise ValueError(f"n times the number of prompts must be <= {MAX_N}, got {self.n * num_prompts}")

    def build_params(self, max_tokens: Optional[int], logprobs: Optional[int], index: int) -> SamplingParams:
        """Sampling parameters of the ``index``-th of the ``n`` choices (seed ``seed + index``).

        Raises:
            ValueError: on any invalid field (message names the field).
        """
        def pick(value: Any, default: Any) -> Any:
            return default if value is None else value

        return SamplingParams(
            temperature=pick(self.temperature, 1.0), top_p=pick(self.top_p, 1.0), top_k=pick(self.top_k, 0),
            min_p=pick(self.min_p, 0.0), seed=None if self.seed is None else self.seed + index,
            max_tokens=max_tokens, min_tokens=self.min_tokens, stop=self.stop or [],
            stop_token_ids=self.stop_token_ids or [], ignore_eos=self.ignore_eos,
            presence_penalty=pick(self.presence_penalty, 0.0),
            frequency_penalty=pick(self.frequency_penalty, 0.0),
            repetition_penalty=pick(self.repetition_penalty, 1.0), logprobs=logprobs,
            skip_special_tokens=self.skip_special_tokens)


class CompletionRequest(SamplingRequest):
    """``POST /v1/completions``. ``max_tokens`` defaults to 16 as in OpenAI; ``null`` means unset."""

    prompt: Union[NonEmptyStr, Annotated[list[TokenId], Field(min_length=1)],
                  Annotated[list[NonEmptyStr], Field(min_length=1)],
                  Annotated[list[Annotated[list[TokenId], Field(min_length=1)]], Field(min_length=1)]]
    max_tokens: Optional[Int] = Field(16, ge=1)
    echo: bool = False
    logprobs: Optional[Int] = Field(None, ge=0, le=MAX_LOGPROBS)
    suffix: Optional[str] = None

    def prompts(self) -> list[Union[str, list[int]]]:
        """The prompt(s) as a list: a text, a list of token ids, or a batch of either.

        Raises:
            ValueError: on an empty batch.
        """
        p = self.prompt
        if isinstance(p, str):
            return [p]
        if not p:
            raise ValueError("the prompt is empty: it must contain at least one token")
        if isinstance(p[0], int):
            return [list(p)]  # type: ignore[arg-type]
        return list(p)  # type: ignore[arg-type]


class ChatCompletionRequest(SamplingRequest):
    """``POST /v1/chat/completions``. ``max_completion_tokens`` wins over the legacy ``max_tokens``."""

    messages: list[dict[str, Any]] = Field(min_length=1)
    max_tokens: Optional[Int] = Field(None, ge=1)
    max_completion_tokens: Optional[Int] = Field(None, ge=1)
    logprobs: bool = False
    top_logprobs: Optional[Int] = Field(None, ge=0, le=MAX_LOGPROBS)

    @property
    def resolved_max_tokens(self) -> Optional[int]:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    @property
    def num_logprobs(self) -> Optional[int]:
        if not self.logprobs:
            if self.top_logprobs:
                raise ValueError("top_logprobs needs logprobs to be true")
            return None
        return self.top_logprobs or 0

    def conversation(self) -> list[dict[str, str]]:
        """Messages as ``{"role", "content"}`` with text parts joined (see :func:`conversation`)."""
        return conversation(self.messages)


def conversation(messages: list[dict[str, Any]]) -> list[dict[str, str]]:
    """Messages as ``{"role", "content"}`` with text parts joined.

    Raises:
        ValueError: on no messages, a message without a role, or a non-text content part.
    """
    if not messages:
        raise ValueError("messages must contain at least one message")
    out = []
    for i, m in enumerate(messages):
        role = m.get("role")
        if not isinstance(role, str) or not role:
            raise ValueError(f"messages[{i}] needs a 'role' string")
        content = m.get("content")
        if content is None:
            text = ""
        elif isinstance(content, str):
            text = content
        elif isinstance(content, list):
            parts = []
            for part in content:
                if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                    raise ValueError(f"messages[{i}].content: only text parts are supported")
                parts.append(part["text"])
            text = "\n".join(parts)
        else:
            raise ValueError(f"messages[{i}].content must be a string or a list of text parts")
        out.append({"role": role, "content": text})
    return out


class TokenizeRequest(OpenAIRequest):
    """``POST /tokenize``: either ``prompt`` or ``messages``."""

    model: Optional[str] = None
    prompt: Optional[str] = None
    messages: Optional[list[dict[str, Any]]] = Field(None, min_length=1)
    add_special_tokens: bool = True


class DetokenizeRequest(OpenAIRequest):
    model: Optional[str] = None
    tokens: list[TokenId]


class TokenizeResponse(OpenAIModel):
    tokens: list[int]
    count: int
    max_model_len: Optional[int] = None


class DetokenizeResponse(OpenAIModel):
    prompt: str


# -------------------------------------------------------------------------------------------- responses
class PromptTokensDetails(OpenAIModel):
    cached_tokens: int = 0


class UsageInfo(OpenAIModel):
    prompt_tokens: int = 0
    completion_tokens: int = 0
    total_tokens: int = 0
    prompt_tokens_details: PromptTokensDetails = Field(default_factory=PromptTokensDetails)


class CompletionLogprobs(OpenAIModel):
    tokens: list[str] = Field(default_factory=list)
    token_logprobs: list[Optional[float]] = Field(default_factory=list)
    top_logprobs: list[Optional[dict[str, float]]] = Field(default_factory=list)
    text_offset: list[int] = Field(default_factory=list)


class _Choice(OpenAIModel):
    """Fields every choice of a full response shares."""

    index: int
    finish_reason: Optional[str] = None
    stop_reason: Optional[Union[int, str]] = None


class CompletionChoice(_Choice):
    text: str
    logprobs: Optional[CompletionLogprobs] = None


class _Completion(OpenAIModel):
    """Fields every completion response and stream chunk shares."""

    id: str
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    usage: Optional[UsageInfo] = None


class CompletionResponse(_Completion):
    object: Literal["text_completion"] = "text_completion"
    choices: list[CompletionChoice]


class TopLogprob(OpenAIModel):
    token: str
    logprob: float
    bytes: Optional[list[int]] = None


class ChatTokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob] = Field(default_factory=list)


class ChatLogprobs(OpenAIModel):
    content: Optional[list[ChatTokenLogprob]] = None


class ChatMessage(OpenAIModel):
    role: str = "assistant"
    content: Optional[str] = None


class DeltaMessage(OpenAIModel):
    role: Optional[str] = None
    content: Optional[str] = None


class ChatChoice(_Choice):
    message: ChatMessage
    logprobs: Optional[ChatLogprobs] = None


class ChatStreamChoice(OpenAIModel):
    index: int
    delta: DeltaMessage
    logprobs: Optional[ChatLogprobs] = None
    finish_reason: Optional[str] = None


class ChatCompletionResponse(_Completion):
    object: Literal["chat.completion"] = "chat.completion"
    choices: list[ChatChoice]


class ChatCompletionChunk(_Completion):
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    choices: list[ChatStreamChoice]


class CompletionChunk(_Completion):
    object: Literal["text_completion"] = "text_completion"
    choices: list[CompletionChoice]


class ModelCard(OpenAIModel):
    id: str
    object: Literal["model"] = "model"
    created: int = Field(default_factory=lambda: int(time.time()))
    owned_by: str = "goodserve"
    root: Optional[str] = None
    max_model_len: Optional[int] = None


class ModelList(OpenAIModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]
