"""The model's tokenizer at the router (``goodserve router --tokenizer``, and ``serve --ray`` by itself), so
the ``kv-aware`` policy hashes a text or chat prompt into the token ids the engine will compute, as llm-d's
and NVIDIA Dynamo's KV routers tokenize in their front ends.

The same steps as the server: a text prompt through ``tokenizer.encode`` (special tokens added), messages
through :func:`goodserve.server.protocol.conversation` and the model's chat template
(:func:`goodserve.engine.chat.render_chat`). Whatever the router cannot tokenize (a malformed body, a
template that refuses the conversation) it routes without ids: the backend then answers the request's error.
Loading reads only the tokenizer: a GGUF's metadata (:class:`~goodserve.models.gguf_reader.GGUFFile`), or
a HF directory's tokenizer files; no weights, no torch.
"""

from __future__ import annotations

import os
from typing import Any, Optional

from goodserve.engine.chat import render_chat
from goodserve.server.protocol import conversation


class PromptTokenizer:
    """Token ids of OpenAI request bodies, by the served model's tokenizer.

    Args:
        tokenizer: A ``transformers`` tokenizer or a :class:`~goodserve.models.gguf_tokenizer.GGUFTokenizer`.
        chat_template: The model's chat template (``None``: the tokenizer's own).
    """

    def __init__(self, tokenizer: Any, chat_template: Optional[str] = None) -> None:
        self.tokenizer, self.chat_template = tokenizer, chat_template

    @classmethod
    def load(cls, path: str) -> "PromptTokenizer":
        """The tokenizer of a ``.gguf`` file or a HF model directory.

        Raises:
            FileNotFoundError: if ``path`` does not exist.
            ValueError: if it holds no tokenizer ``transformers`` can read.
        """
        if not os.path.exists(path):
            raise FileNotFoundError(f"--tokenizer {path!r} does not exist")
        if os.path.isfile(path):
            from goodserve.models.gguf_reader import GGUFFile
            from goodserve.models.gguf_tokenizer import gguf_tokenizer

            f = GGUFFile(path)
            tokenizer = gguf_tokenizer(f, path)
            return cls(tokenizer, f.get("tokenizer.chat_template") or getattr(tokenizer, "chat_template", None))
        from transformers import AutoTokenizer

        try:
            tokenizer = AutoTokenizer.from_pretrained(path)
        except (OSError, ValueError) as e:
            raise ValueError(f"no tokenizer in {path!r}: {e}") from None
        return cls(tokenizer, getattr(tokenizer, "chat_template", None))

    def token_ids(self, body: dict[str, Any]) -> Optional[tuple[int, ...]]:
        """The prompt's token ids (a batch's first prompt), or ``None`` when the body has none the engine
        would accept (the backend answers the error)."""
        prompt = body.get("prompt")
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], str):
            prompt = prompt[0]
        try:
            if isinstance(prompt, str):
                return tuple(self.tokenizer.encode(prompt))
            if prompt is None and isinstance(body.get("messages"), list):
                return tuple(render_chat(self.tokenizer, self.chat_template, conversation(body["messages"])))
        except Exception:  # noqa: BLE001 - the backend validates the request and answers its error
            return None
        return None
