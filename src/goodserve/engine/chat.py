"""The one chat-template renderer: a conversation to prompt token ids (used by ``LLM.chat`` and the server)."""

from __future__ import annotations

from typing import Any, Optional, Sequence

from goodserve.validation import check_text


def render_chat(tokenizer: Any, chat_template: Optional[str], messages: Sequence[dict[str, Any]]) -> list[int]:
    """Token ids of a conversation with the generation prompt appended, by the model's chat template.

    Args:
        tokenizer: A ``transformers`` tokenizer.
        chat_template: The model's template, or ``None`` to use the tokenizer's own.
        messages: ``[{"role": ..., "content": ...}, ...]`` with text content.

    Returns:
        The prompt token ids.

    Raises:
        ValueError: if the model has no chat template, a message's text is not valid Unicode, or the template
            rejects the conversation (e.g. roles that do not alternate).
    """
    if not (chat_template or getattr(tokenizer, "chat_template", None)):
        raise ValueError("this model has no chat template; send a plain prompt instead")
    for i, m in enumerate(messages):
        for key, value in m.items():
            if isinstance(value, str):
                check_text(value, f"messages[{i}].{key}")
    try:
        out = tokenizer.apply_chat_template(list(messages), add_generation_prompt=True, tokenize=True,
                                            chat_template=chat_template)
    except Exception as e:  # noqa: BLE001 - a template that rejects the conversation is the user's to fix
        raise ValueError(f"messages could not be rendered with the chat template: {e}") from e
    if isinstance(out, dict) or hasattr(out, "input_ids"):
        out = out["input_ids"]
    return list(out)
