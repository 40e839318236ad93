"""Checks on text that comes from users, applied before any tokenizer, template or matcher sees it.

A Python ``str`` can hold what no UTF-8 text can: a lone UTF-16 surrogate (U+D800..U+DFFF), which valid
JSON spells ``"\\ud800"``. Tokenizers, chat templates and stop-string matchers fail on it in their own
ways (``tokenizers`` raises ``TypeError``), so every text field is checked here first and refused with a
``ValueError`` that names the field (case C19).
"""

from __future__ import annotations

from typing import Any, Optional


class ParamError(ValueError):
    """A ``ValueError`` that names the request field at fault and, optionally, an OpenAI error code (the
    server answers it with a 400 whose body carries both).

    Args:
        message: What is wrong.
        param: The field (e.g. ``"top_logprobs"``), or ``None``.
        code: A machine-readable code (e.g. ``"context_length_exceeded"``), or ``None``.
    """

    def __init__(self, message: str, param: Optional[str] = None, code: Optional[str] = None) -> None:
        super().__init__(message)
        self.param, self.code = param, code


def check_text(text: str, param: str) -> None:
    """Refuse text that is not valid Unicode (that has no UTF-8 encoding).

    Args:
        text: The text.
        param: The field it came from, named in the message (e.g. ``"prompt"``, ``"messages[0].content"``).

    Raises:
        ValueError: on a lone surrogate, naming ``param``, the code point and its position.
    """
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise ValueError(f"{param} is not valid Unicode: it holds a lone surrogate U+{ord(text[e.start]):04X} at "
                         f"character {e.start}; text must be encodable as UTF-8") from None


def safe_text(text: str) -> str:
    """``text`` with any lone surrogate written as a ``\\udXXX`` escape, so it can always be encoded
    (for error messages that quote user input)."""
    return text.encode("utf-8", "backslashreplace").decode("utf-8")


def find_invalid_text(value: Any, path: str = "") -> Optional[tuple[str, str]]:
    """Walk JSON-like data (dicts, lists, strings) and find the first string that is not valid Unicode.

    Dictionary keys are checked as well as values.

    Args:
        value: Parsed JSON.
        path: The path of ``value`` (``""`` at the root).

    Returns:
        ``(path, message)`` of the first invalid string, e.g. ``("messages[0].content", "...")``, or
        ``None`` when all text is valid.
    """
    if isinstance(value, str):
        try:
            check_text(value, path or "the body")
        except ValueError as e:
            return path, str(e)
        return None
    if isinstance(value, dict):
        for k, v in value.items():
            name = safe_text(str(k))
            sub = f"{path}.{name}" if path else name
            if isinstance(k, str) and name != k:
                return sub, f"the key '{name}' is not valid Unicode: text must be encodable as UTF-8"
            found = find_invalid_text(v, sub)
            if found is not None:
                return found
    elif isinstance(value, (list, tuple)):
        for i, v in enumerate(value):
            found = find_invalid_text(v, f"{path}[{i}]")
            if found is not None:
                return found
    return None
