"""Parsing of the JSON-object flags (``--kv-events-config``, ``--speculative-config``, ``--kv-transfer-config``,
vLLM's shape): one place for the same three refusals. Torch-free."""

from __future__ import annotations

import json
from typing import Any, Iterable


def parse_json_object(flag: str, text: str, known: Iterable[str]) -> dict[str, Any]:
    """The JSON object ``text`` given to ``flag``, with only ``known`` keys.

    Raises:
        ValueError: ``text`` is not valid JSON, not an object, or has a key outside ``known`` (the message
            names the flag, the unknown keys and the known ones).
    """
    try:
        raw = json.loads(text)
    except json.JSONDecodeError as e:
        raise ValueError(f"{flag} is not valid JSON: {e}") from None
    if not isinstance(raw, dict):
        raise ValueError(f"{flag} must be a JSON object")
    unknown = sorted(set(raw) - set(known))
    if unknown:
        raise ValueError(f"{flag}: unknown key(s) {unknown}; known: {sorted(known)}")
    return raw
