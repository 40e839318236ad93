"""The one chat-template renderer: a conversation to prompt token ids (used by ``LLM.chat`` and the server)."""

from __future__ import annotations

from typing import Any, Optional, Sequence

import jinja2

from goodserve.validation import find_invalid_text


def render_chat(tokenizer: Any, chat_template: Optional[str], messages: Sequence[dict[str, Any]]) -> list[int]:
    """Token ids of a conversation with the generation prompt appended, by the model's chat template.

    Args:
        tokenizer: A ``transformers`` tokenizer or a :class:`~goodserve.models.gguf_tokenizer.GGUFTokenizer`.
        chat_template: The model's template, or ``None`` to use the tokenizer's own.
        messages: ``[{"role": ..., "content": ...}, ...]`` with text content.

    Returns:
        The prompt token ids.

    Raises:
        ValueError: if the model has no chat template, a message's text is not valid Unicode, or the template
            rejects the conversation (e.g. roles that do not alternate).
        Exception: whatever else the template or tokenizer raise (a fault of ours, not the user's).
    """
    if not (chat_template or getattr(tokenizer, "chat_template", None)):
        raise ValueError("this model has no chat template; send a plain prompt instead")
    found = find_invalid_text(list(messages), "messages")
    if found is not None:
        raise ValueError(found[1])
    try:
        out = tokenizer.apply_chat_template(list(messages), add_generation_prompt=True, tokenize=True,
                                            chat_template=chat_template, return_dict=False)
    except jinja2.TemplateError as e:  # the template rejects the conversation (its raise_exception): the user's
        raise ValueError(f"messages could not be rendered with the chat template: {e}") from e
    if isinstance(out, dict) or hasattr(out, "input_ids"):
        out = out["input_ids"]
    return list(out)
