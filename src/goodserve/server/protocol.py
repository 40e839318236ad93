"""Pydantic schemas of the OpenAI-compatible API (requests in, responses out) and their mapping to
:class:`SamplingParams`.

Field names and meanings follow the OpenAI API; ``top_k``, ``min_p``, ``repetition_penalty``,
``ignore_eos``, ``min_tokens``, ``stop_token_ids``, ``skip_special_tokens``, ``priority`` and ``cache_salt``
(only requests with the same salt share prefix-cache blocks) are extensions (as in vLLM). Every field of a
completion or chat request is applied, refused, or ignored by design (docs/openai.md has the table): an
OpenAI field the server does not implement (:data:`UNSUPPORTED`) is a 400 naming it, and so is any field
the API does not define (``extra="forbid"``), so a typo is never silently dropped. Errors in values that
pydantic cannot see (ranges, an empty prompt) surface as ``ValueError`` from :meth:`SamplingParams.validate`
or the engine and become HTTP 400.
"""

from __future__ import annotations

import json
import time
from typing import Annotated, Any, Literal, Optional, Union

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, model_validator
from pydantic_core import PydanticCustomError

from goodserve.sampling_params import MAX_LOGIT_BIAS, MAX_LOGPROBS, SamplingParams, StructuredOutputsParams
from goodserve.validation import ParamError, find_invalid_text

MAX_N = 128  # most choices per request (n times the number of prompts)

# OpenAI request fields this server does not implement: the values that mean "not used" (accepted), and
# why anything else is refused with a 400 naming the field.
_NO_TOOLS = "this server does not implement tool or function calling"
UNSUPPORTED: dict[str, tuple[tuple[Any, ...], str]] = {
    "suffix": ((None,), "insertion (text after the completion) is not implemented"),
    "tools": ((None, []), _NO_TOOLS),
    "tool_choice": ((None, "none"), _NO_TOOLS),
    "functions": ((None, []), _NO_TOOLS),
    "function_call": ((None, "none"), _NO_TOOLS),
    "audio": ((None,), "the model has no audio output"),
    "modalities": ((None, ["text"]), "the model only writes text"),
    "prediction": ((None,), "predicted outputs are not implemented"),
    "web_search_options": ((None,), "web search is not implemented"),
    "reasoning_effort": ((None,), "the model has no reasoning mode"),
    "verbosity": ((None,), "the model has no verbosity setting"),
    "store": ((None, False), "completions are not stored by this server"),
}



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


class ResponseFormat(OpenAIModel):
    """OpenAI ``response_format``: ``text`` (no constraint), ``json_object`` (any JSON object) or ``json_schema``
    (``{"name", "schema", "strict", "description"}``: the output validates against ``schema``)."""

    type: Literal["text", "json_object", "json_schema"]
    json_schema: Optional[dict[str, Any]] = None


class SamplingRequest(OpenAIRequest):
    """Fields shared by ``/v1/completions`` and ``/v1/chat/completions``. Any other field is a 400."""

    model_config = ConfigDict(extra="forbid", strict=True)

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
    logit_bias: Optional[dict[str, Annotated[float, Field(ge=-MAX_LOGIT_BIAS, le=MAX_LOGIT_BIAS)]]] = None
    response_format: Optional[ResponseFormat] = None
    # Accepted and ignored by design (docs/openai.md says why): identifiers and routing hints.
    user: Optional[str] = None
    slo_ttft_ms: Optional[float] = Field(None, gt=0.0, allow_inf_nan=False)
    slo_tpot_ms: Optional[float] = Field(None, gt=0.0, allow_inf_nan=False)
    slo_class: Optional[str] = None
    # Disaggregated serving (vLLM's field): {"do_remote_decode": true} to a producer, its handle to a consumer.
    kv_transfer_params: Optional[dict[str, Any]] = None
    safety_identifier: Optional[str] = None
    prompt_cache_key: Optional[str] = None
    metadata: Optional[dict[str, str]] = None
    service_tier: Optional[str] = None
    parallel_tool_calls: Optional[bool] = None
    # Refused unless unset (see UNSUPPORTED); declared so that the schema lists them.
    suffix: Optional[Any] = None
    tools: Optional[Any] = None
    tool_choice: Optional[Any] = None
    functions: Optional[Any] = None
    function_call: Optional[Any] = None
    audio: Optional[Any] = None
    modalities: Optional[Any] = None
    prediction: Optional[Any] = None
    web_search_options: Optional[Any] = None
    reasoning_effort: Optional[Any] = None
    verbosity: Optional[Any] = None
    store: Optional[Any] = None

    @model_validator(mode="before")
    @classmethod
    def _refuse_unsupported(cls, data: Any) -> Any:
        if isinstance(data, dict):
            for name, (allowed, why) in UNSUPPORTED.items():
                if name in data and name in cls.model_fields and not any(data[name] == a for a in allowed):
                    raise PydanticCustomError("unsupported", "{message}", {
                        "message": f"{name} is not supported by this server: {why}", "param": name,
                        "code": "unsupported_parameter"})
        return data

    def structured_outputs(self) -> Optional[StructuredOutputsParams]:
        """The grammar ``response_format`` asks for (``None`` for ``text`` or unset).

        Raises:
            ParamError: a ``json_schema`` without a ``schema`` object.
        """
        rf = self.response_format
        if rf is None or rf.type == "text":
            return None
        if rf.type == "json_object":
            return StructuredOutputsParams(json_object=True)
        schema = (rf.json_schema or {}).get("schema")
        if not isinstance(schema, dict):
            raise ParamError("response_format.json_schema.schema must be a JSON schema object",
                             param="response_format.json_schema.schema")
        return StructuredOutputsParams(json=json.dumps(schema))

    def token_logit_bias(self) -> Optional[dict[int, float]]:
        """``logit_bias`` keyed by token id (JSON keys are strings).

        Raises:
            ParamError: a key that is not a token id.
        """
        if not self.logit_bias:
            return None
        out = {}
        for key, bias in self.logit_bias.items():
            if not key.isdigit():
                raise ParamError(f"logit_bias keys must be token ids (non-negative integers), got {key!r}",
                                 param="logit_bias")
            out[int(key)] = float(bias)
        return out

    @property
    def include_usage(self) -> bool:
        return bool(self.stream and self.stream_options and self.stream_options.include_usage)

    def check_n(self, num_prompts: int = 1) -> None:
        """Raises ValueError unless ``1 <= n`` and ``n * num_prompts <= MAX_N``, and ``n * num_prompts == 1``
        with ``kv_transfer_params`` (a hand-off is one sequence's KV)."""
        if self.n < 1:
            raise ValueError(f"n must be >= 1, got {self.n}")
        if self.n * num_prompts > MAX_N:
            raise ValueError(f"n times the number of prompts must be <= {MAX_N}, got {self.n * num_prompts}")
        if self.kv_transfer_params is not None and self.n * num_prompts != 1:
            raise ParamError("kv_transfer_params needs one prompt and n = 1 (a KV hand-off is one sequence's)",
                             param="kv_transfer_params")

    def build_params(self, max_tokens: Optional[int], logprobs: Optional[int], index: int,
                     prompt_logprobs: Optional[int] = None) -> SamplingParams:
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
            prompt_logprobs=prompt_logprobs, logit_bias=self.token_logit_bias(),
            structured_outputs=self.structured_outputs(), skip_special_tokens=self.skip_special_tokens)


class CompletionRequest(SamplingRequest):
    """``POST /v1/completions``. ``max_tokens`` defaults to 16 as in OpenAI; ``null`` means unset."""

    prompt: Union[NonEmptyStr, Annotated[list[TokenId], Field(min_length=1)],
                  Annotated[list[NonEmptyStr], Field(min_length=1)],
                  Annotated[list[Annotated[list[TokenId], Field(min_length=1)]], Field(min_length=1)]]
    max_tokens: Optional[Int] = Field(16, ge=1)
    echo: bool = False
    logprobs: Optional[Int] = Field(None, ge=0, le=MAX_LOGPROBS)
    best_of: Optional[Int] = Field(None, ge=1, le=MAX_N)

    def check_n(self, num_prompts: int = 1) -> None:
        """As :meth:`SamplingRequest.check_n`; ``best_of`` (server-side candidates) is only accepted equal to
        ``n``, which is what it then means.

        Raises:
            ParamError: ``best_of`` is set and differs from ``n``.
        """
        if self.best_of is not None and self.best_of != self.n:
            raise ParamError(f"best_of is not supported by this server unless it equals n ({self.n}), got "
                             f"{self.best_of}", param="best_of", code="unsupported_parameter")
        super().check_n(num_prompts)

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
        """Top logprobs per token, ``None`` when ``logprobs`` is false.

        Raises:
            ParamError: ``top_logprobs`` given without ``logprobs: true``.
        """
        if not self.logprobs:
            if self.top_logprobs:
                raise ParamError("top_logprobs needs logprobs to be true", param="top_logprobs")
            return None
        return self.top_logprobs or 0

    def conversation(self) -> list[dict[str, str]]:
        """Messages as ``{"role", "content"}`` with text parts joined (see :func:`conversation`)."""
        return conversation(self.messages)


ROLES = {"system": "system", "developer": "system", "user": "user", "assistant": "assistant"}
_MESSAGE_KEYS = {"role", "content", "name"}


def conversation(messages: list[dict[str, Any]]) -> list[dict[str, str]]:
    """Messages as ``{"role", "content"}`` for the chat template: ``developer`` becomes ``system`` (OpenAI's
    newer name for it, case C18), content given as a list of text parts is joined with newlines, and
    ``name`` is dropped (chat templates have no place for it).

    Raises:
        ParamError: on no messages, a role the API does not define (or ``tool``/``function``: no tool
            calling here), a key a message may not have, or content that is not text (naming the field).
    """
    if not messages:
        raise ParamError("messages must contain at least one message", param="messages")
    out = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict):
            raise ParamError(f"messages[{i}] must be an object with a role and content", param=f"messages[{i}]")
        role = m.get("role")
        if not isinstance(role, str) or not role:
            raise ParamError(f"messages[{i}] needs a 'role' string", param=f"messages[{i}].role")
        if role in ("tool", "function"):
            raise ParamError(f"messages[{i}].role {role!r} is not supported: {_NO_TOOLS}",
                             param=f"messages[{i}].role", code="unsupported_parameter")
        if role not in ROLES:
            raise ParamError(f"messages[{i}].role must be one of {sorted(ROLES)}, got {role!r}",
                             param=f"messages[{i}].role")
        extra = sorted(set(m) - _MESSAGE_KEYS)
        if extra:
            raise ParamError(f"messages[{i}].{extra[0]} is not supported by this server",
                             param=f"messages[{i}].{extra[0]}", code="unsupported_parameter")
        content = m.get("content")
        if content is None and role != "assistant":
            raise ParamError(f"messages[{i}].content is required", param=f"messages[{i}].content")
        if content is None:
            text = ""
        elif isinstance(content, str):
            text = content
        elif isinstance(content, list):
            parts = []
            for j, part in enumerate(content):
                kind = part.get("type") if isinstance(part, dict) else None
                if kind != "text" or not isinstance(part.get("text"), str):
                    raise ParamError(f"messages[{i}].content[{j}]: only text parts ({{\"type\": \"text\", \"text\": "
                                     f"...}}) are supported, got type {kind!r}", param=f"messages[{i}].content[{j}]")
                parts.append(part["text"])
            text = "\n".join(parts)
        else:
            raise ParamError(f"messages[{i}].content must be a string or a list of text parts",
                             param=f"messages[{i}].content")
        out.append({"role": ROLES[role], "content": text})
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
    kv_transfer_params: Optional[dict[str, Any]] = None  # a producer's handle (disaggregated serving)


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
    kv_transfer_params: Optional[dict[str, Any]] = None  # a producer's handle (disaggregated serving)


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
