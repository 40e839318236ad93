"""The tokenizer embedded in a GGUF file, built with ``tokenizers`` directly when it is a GPT-2-style BPE.

A GGUF has no ``tokenizer.json``: it stores the vocabulary, merges and special token ids as metadata.
transformers rebuilds a tokenizer from them (``PreTrainedTokenizerFast.from_pretrained(dir, gguf_file=...)``,
``transformers/integrations/gguf/gguf_tokenizer_mapping.py``); for a byte-level BPE vocabulary
(``tokenizer.ggml.model == "gpt2"``) that is ``GPT2Tokenizer``'s backend: a ``BPE`` model over the vocabulary
respelled in GPT-2's byte alphabet, a ``ByteLevel`` pre-tokenizer and decoder, the file's control tokens as
special tokens and its user-defined tokens as added ones, and a ``TemplateProcessing`` post-processor that adds
BOS only if the file says so. :func:`build_gguf_backend` builds the same ``tokenizers.Tokenizer`` from the
metadata :class:`~goodserve.models.gguf_reader.GGUFFile` has already read, without importing transformers'
converters (loading them and re-reading the file took most of a second of a one-shot ``goodserve chat``).

Only pre-tokenizers that split text with GPT-2's own regex are built here (:data:`GPT2_REGEX_PRE`); any
other vocabulary (sentencepiece, unigram, or a BPE with its own split regex such as ``llama-bpe``/``qwen2``)
returns ``None`` and goes through transformers as before. ``tests/test_gguf_tokenizer.py`` checks the result
against transformers' tokenizer of the default model: the same serialized tokenizer, token for token the
same ids, and the same decoded text and chat prompts.
"""

from __future__ import annotations

import functools
import threading
from typing import Any, Optional

#: ``tokenizer.ggml.pre`` values whose text is split by GPT-2's byte-level regex (llama.cpp
#: ``LLAMA_VOCAB_PRE_TYPE_GPT2`` / ``SMOLLM``), which transformers leaves at ``ByteLevel``'s default.
GPT2_REGEX_PRE = ("gpt-2", "smollm")

_CONTROL, _USER_DEFINED = 3, 4  # llama.cpp token types (gguf.TokenType)
_GPT2_DEFAULT_SPECIAL = "<|endoftext|>"  # GPT2Tokenizer's unk/bos/eos before the file's are applied
# GGUF key -> the transformers tokenizer argument naming that special token.
_SPECIAL_IDS = {"bos_token": "bos_token_id", "eos_token": "eos_token_id", "unk_token": "unknown_token_id",
                "pad_token": "padding_token_id"}


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte -> printable character table (the alphabet byte-level BPE vocabularies are spelled in)."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) \
        + list(range(ord("®"), ord("ÿ") + 1))
    chars, extra = {}, 0
    for b in range(256):
        if b in printable:
            chars[b] = chr(b)
        else:
            chars[b] = chr(256 + extra)
            extra += 1
    return chars


def tokenizer_config(fields: dict[str, Any]) -> dict[str, Any]:
    """The arguments transformers gives its GGUF tokenizer: special tokens by text, BOS/EOS flags, template.

    Args:
        fields: The file's metadata (:attr:`GGUFFile.fields`).
    """
    tokens = fields.get("tokenizer.ggml.tokens") or []
    config: dict[str, Any] = {}
    for key in ("chat_template",):
        if f"tokenizer.{key}" in fields:
            config[key] = fields[f"tokenizer.{key}"]
    for key in ("add_bos_token", "add_eos_token"):
        if f"tokenizer.ggml.{key}" in fields:
            config[key] = fields[f"tokenizer.ggml.{key}"]
    for name, key in _SPECIAL_IDS.items():
        token_id = fields.get(f"tokenizer.ggml.{key}")
        config[name] = tokens[token_id] if token_id is not None else None
    return config


def check_split_rule(fields: dict[str, Any]) -> None:
    """Refuse a byte-level BPE vocabulary whose text split no tokenizer here knows.

    Such a vocabulary's merges were learned on text split by its own regex (llama.cpp's ``tokenizer.ggml.pre``,
    e.g. ``deepseek-llm``); split by GPT-2's instead, as transformers' GGUF tokenizer does for a name it does
    not list, the same text gets other token ids and nothing says so. Known: :data:`GPT2_REGEX_PRE`, a missing
    or ``default`` name (GPT-2's split, as llama.cpp), and transformers' ``GGUF_PRE_TOKENIZER_SPLITS``.

    Raises:
        ValueError: Naming the file's ``tokenizer.ggml.pre``.
    """
    pre = fields.get("tokenizer.ggml.pre")
    if fields.get("tokenizer.ggml.model") != "gpt2" or pre in (None, "default", *GPT2_REGEX_PRE):
        return
    from transformers.integrations.gguf.gguf_tokenizer_mapping import GGUF_PRE_TOKENIZER_SPLITS

    if pre not in GGUF_PRE_TOKENIZER_SPLITS:
        known = sorted({*GPT2_REGEX_PRE, "default", *GGUF_PRE_TOKENIZER_SPLITS})
        raise ValueError(f"GGUF tokenizer.ggml.pre={pre!r} is not supported: its pre-tokenizer split is not "
                         f"implemented (a byte-level BPE split another way gives other token ids); known: "
                         f"{', '.join(known)}")


def build_gguf_backend(fields: dict[str, Any]) -> Optional[Any]:
    """The ``tokenizers.Tokenizer`` of a GGUF's GPT-2-style byte-level BPE vocabulary.

    Args:
        fields: The file's metadata (:attr:`GGUFFile.fields`).

    Returns:
        The tokenizer, or ``None`` when the vocabulary is of another kind (see :data:`GPT2_REGEX_PRE`).
    """
    if fields.get("tokenizer.ggml.model") != "gpt2" or fields.get("tokenizer.ggml.pre") not in GPT2_REGEX_PRE \
            or "tokenizer.ggml.merges" not in fields:
        return None
    from tokenizers import AddedToken, Tokenizer, decoders, pre_tokenizers, processors
    from tokenizers.models import BPE

    tokens = fields["tokenizer.ggml.tokens"]
    types = fields.get("tokenizer.ggml.token_type") or ()
    spelling = _bytes_to_unicode()
    alphabet = set(spelling.values())
    vocab = {t if set(t) <= alphabet else "".join(spelling[b] for b in t.encode("utf-8")): i
             for i, t in enumerate(tokens)}
    merges = [tuple(m.split(" ")) for m in fields["tokenizer.ggml.merges"]]
    tok = Tokenizer(BPE(vocab=vocab, merges=merges, dropout=None, continuing_subword_prefix="",
                        end_of_word_suffix="", fuse_unk=False))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    # In transformers' order: GPT2Tokenizer's default special token, then the file's control tokens (those
    # spelled outside the byte alphabet are llama.cpp mislabels and skipped), then its user-defined tokens.
    tok.add_special_tokens([AddedToken(_GPT2_DEFAULT_SPECIAL, special=True, normalized=False)])
    control = [AddedToken(t, special=True, normalized=False)
               for t, kind in zip(tokens, types) if kind == _CONTROL and set(t) <= alphabet]
    if control:
        tok.add_special_tokens(control)
    user = [AddedToken(t, special=False, normalized=False)
            for t, kind in zip(tokens, types) if kind == _USER_DEFINED and t in vocab]
    if user:
        tok.add_tokens(user)
    config = tokenizer_config(fields)
    for name in _SPECIAL_IDS:
        if config[name] is not None:
            tok.add_special_tokens([AddedToken(config[name], special=True, normalized=False)])
    bos = config["bos_token"] if config.get("add_bos_token") else None
    eos = config["eos_token"] if config.get("add_eos_token") else None
    single = " ".join(([f"{bos}:0"] if bos else []) + ["$A:0"] + ([f"{eos}:0"] if eos else []))
    pair = " ".join([single] + ([f"{bos}:1"] if bos else []) + ["$B:1"] + ([f"{eos}:1"] if eos else []))
    specials = [(t, tok.token_to_id(t)) for t in (bos, eos) if t]
    tok.post_processor = processors.TemplateProcessing(single=single, pair=pair, special_tokens=specials)
    return tok


_REASONING_KEYS = ("reasoning_content", "thinking", "reasoning")  # transformers aliases these to one another


class GGUFTokenizer:
    """A GGUF's byte-level BPE tokenizer that encodes and renders chat prompts without importing transformers.

    The engine's per-request calls are answered here: :meth:`encode`, :meth:`apply_chat_template` for plain
    conversations, ``eos_token_id``, ``chat_template`` and ``backend_tokenizer`` (for the detokenizers).
    Anything else (``decode``, ``len()``, the server's vocabulary tables, xgrammar's ``TokenizerInfo``, a call
    with options these methods do not take) goes to :attr:`transformers_tokenizer`, transformers'
    ``PreTrainedTokenizerFast`` over the same backend, built on first use (~1 s of imports a one-shot
    ``goodserve chat`` never pays). Both give the same ids and text (``tests/test_gguf_tokenizer.py``).

    Args:
        backend: :func:`build_gguf_backend`'s tokenizer.
        config: :func:`tokenizer_config` of the same file.
    """

    def __init__(self, backend: Any, config: dict[str, Any]) -> None:
        self.backend_tokenizer = backend
        self.chat_template: Optional[str] = config.get("chat_template")
        self._config = config
        # transformers' special_tokens_map: what a chat template sees as bos_token, eos_token, ...
        self._special_tokens = {name: config[name] for name in _SPECIAL_IDS if config.get(name) is not None}
        self.eos_token_id = backend.token_to_id(config["eos_token"]) if config.get("eos_token") else None
        self.bos_token_id = backend.token_to_id(config["bos_token"]) if config.get("bos_token") else None
        self._hf: Any = None
        self._lock = threading.Lock()

    @property
    def transformers_tokenizer(self) -> Any:
        """transformers' ``PreTrainedTokenizerFast`` of this tokenizer (built once, thread-safe)."""
        with self._lock:
            if self._hf is None:
                from transformers import PreTrainedTokenizerFast

                self._hf = PreTrainedTokenizerFast(tokenizer_object=self.backend_tokenizer, **self._config)
            return self._hf

    def __getattr__(self, name: str) -> Any:
        if name.startswith("_"):
            raise AttributeError(name)
        return getattr(self.transformers_tokenizer, name)

    def __len__(self) -> int:
        return len(self.transformers_tokenizer)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.transformers_tokenizer(*args, **kwargs)

    def encode(self, text: Any, add_special_tokens: bool = True, **kwargs: Any) -> list[int]:
        """Token ids of ``text`` (with the post-processor's BOS/EOS when ``add_special_tokens``)."""
        if kwargs or not isinstance(text, str):
            return self.transformers_tokenizer.encode(text, add_special_tokens=add_special_tokens, **kwargs)
        return self.backend_tokenizer.encode(text, add_special_tokens=add_special_tokens).ids

    def apply_chat_template(self, conversation: Any, add_generation_prompt: bool = False, tokenize: bool = True,
                            chat_template: Optional[str] = None, return_dict: bool = True, **kwargs: Any) -> Any:
        """The conversation rendered by the chat template as transformers renders it (text, or ids with
        ``return_dict=False``); conversations other than string-valued messages go to transformers."""
        template = chat_template or self.chat_template
        plain = isinstance(conversation, (list, tuple)) and conversation and all(
            isinstance(m, dict) and all(type(k) is str and type(v) is str for k, v in m.items())
            and not any(k in m for k in _REASONING_KEYS) for m in conversation)
        if kwargs or not template or not plain or (tokenize and return_dict):
            return self.transformers_tokenizer.apply_chat_template(
                conversation, add_generation_prompt=add_generation_prompt, tokenize=tokenize,
                chat_template=chat_template, return_dict=return_dict, **kwargs)
        try:
            compiled = _compile_template(template)
        except Exception:  # noqa: BLE001 - e.g. a `{% generation %}` tag: transformers' environment knows more
            return self.transformers_tokenizer.apply_chat_template(
                conversation, add_generation_prompt=add_generation_prompt, tokenize=tokenize,
                chat_template=chat_template, return_dict=return_dict)
        text = compiled.render(messages=[dict(m) for m in conversation], tools=None, documents=None,
                               add_generation_prompt=add_generation_prompt, **self._special_tokens)
        return self.encode(text, add_special_tokens=False) if tokenize else text


@functools.lru_cache(maxsize=8)
def _compile_template(template: str) -> Any:
    """A chat template compiled in the Jinja environment transformers renders chat templates in
    (``transformers.utils.chat_template_utils._compile_jinja_template``: sandboxed, ``trim_blocks``,
    ``lstrip_blocks``, loop controls, an unescaped ``tojson``, ``raise_exception`` and ``strftime_now``)."""
    import datetime
    import json

    import jinja2
    import jinja2.ext
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message: str) -> None:
        raise jinja2.exceptions.TemplateError(message)

    def tojson(x: Any, ensure_ascii: bool = False, indent: Any = None, separators: Any = None,
               sort_keys: bool = False) -> str:
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols])
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.datetime.now().strftime(fmt)
    return env.from_string(template)


def gguf_tokenizer(file: Any, path: str) -> Any:
    """The tokenizer of a GGUF file: a :class:`GGUFTokenizer` over :func:`build_gguf_backend`'s tokenizer where
    it applies, else transformers' fast tokenizer from its own GGUF conversion.

    Args:
        file: The opened :class:`~goodserve.models.gguf_reader.GGUFFile`.
        path: Its path (for the fallback, which reads the file again).
    """
    backend = build_gguf_backend(file.fields)
    if backend is None:
        from goodserve.models.checkpoint import load_gguf_tokenizer

        return load_gguf_tokenizer(path)
    return GGUFTokenizer(backend, tokenizer_config(file.fields))
