"""``--speculative-config``: how the engine speculates, in vLLM's JSON shape."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Union

from goodserve.json_flag import parse_json_object

#: Proposers: prompt lookup over the request's own tokens, or a smaller model sharing the tokenizer.
METHODS = ("ngram", "draft_model")


@dataclass(frozen=True)
class SpeculativeConfig:
    """How the engine speculates.

    Attributes:
        method: ``"ngram"`` (prompt lookup: the tokens that followed the latest earlier occurrence of the
            request's last ``n`` tokens, ``n`` from ``prompt_lookup_max`` down to ``prompt_lookup_min``) or
            ``"draft_model"`` (``model`` proposes greedily).
        num_speculative_tokens: The most draft tokens a request verifies in one step (``k_max``).
        length: ``"auto"`` (per step, the number of draft tokens that maximises expected accepted tokens per
            second from the step-time model and the measured acceptance rates; 0 under load) or a fixed
            number (at most ``num_speculative_tokens``).
        prompt_lookup_min: ``ngram``: the shortest suffix matched (tokens).
        prompt_lookup_max: ``ngram``: the longest suffix matched (tokens).
        model: ``draft_model``: a GGUF file or HF directory whose tokenizer is the target's.

    Raises:
        ValueError: on an unknown method, a bound below 1, ``prompt_lookup_min > prompt_lookup_max``, a fixed
            length above ``num_speculative_tokens``, or ``draft_model`` without ``model``.
    """

    method: str
    num_speculative_tokens: int
    length: Union[str, int] = "auto"
    prompt_lookup_min: int = 1
    prompt_lookup_max: int = 4
    model: Optional[str] = None

    def __post_init__(self) -> None:
        if self.method not in METHODS:
            raise ValueError(f"speculative method must be one of {METHODS}, got {self.method!r}")
        for name in ("num_speculative_tokens", "prompt_lookup_min", "prompt_lookup_max"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"speculative {name} must be an integer >= 1, got {value!r}")
        if self.prompt_lookup_min > self.prompt_lookup_max:
            raise ValueError(f"prompt_lookup_min ({self.prompt_lookup_min}) > prompt_lookup_max "
                             f"({self.prompt_lookup_max})")
        if self.length != "auto" and (isinstance(self.length, bool) or not isinstance(self.length, int)
                                      or not 0 <= self.length <= self.num_speculative_tokens):
            raise ValueError(f"speculative length must be 'auto' or an integer in [0, num_speculative_tokens="
                             f"{self.num_speculative_tokens}], got {self.length!r}")
        if self.method == "draft_model" and not self.model:
            raise ValueError("speculative method 'draft_model' needs a 'model' (GGUF file or HF directory)")

    @classmethod
    def from_cli(cls, text: Optional[str], length: Optional[str] = None) -> Optional["SpeculativeConfig"]:
        """Parse ``--speculative-config`` JSON (``None``: no speculation) and ``--speculative-length``
        (``auto`` or an integer; overrides the JSON's ``length``).

        Raises:
            ValueError: on malformed JSON, an unknown key, or a value :class:`SpeculativeConfig` refuses.
        """
        if text is None:
            if length is not None:
                raise ValueError("--speculative-length needs --speculative-config")
            return None
        fields = parse_json_object("--speculative-config", text, ("method", "num_speculative_tokens", "length",
                                                                  "prompt_lookup_min", "prompt_lookup_max", "model"))
        if "method" not in fields or "num_speculative_tokens" not in fields:
            raise ValueError("--speculative-config needs 'method' and 'num_speculative_tokens'")
        if length is not None:
            fields["length"] = length
        if isinstance(fields.get("length"), str) and fields["length"] != "auto":
            try:
                fields["length"] = int(fields["length"])
            except ValueError:
                raise ValueError(f"speculative length must be 'auto' or an integer, got {fields['length']!r}") \
                    from None
        return cls(**fields)
