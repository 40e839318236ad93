"""The GGUF tokenizer built with ``tokenizers`` directly against transformers' GGUF tokenizer: the same ids,
text and chat prompts (and the same serialized tokenizer)."""

from __future__ import annotations

import json
import os

import pytest

from goodserve.models.gguf_reader import GGUFFile
from goodserve.models.gguf_tokenizer import GGUFTokenizer, build_gguf_backend, gguf_tokenizer
from tiny_models import smollm2_tokenizer

TEXTS = [
    "", " ", "Hello world", " Hello world", "What is the capital of France?",
    "  leading and trailing spaces  ", "tabs\tand\nnewlines\r\n\n\n", "    code:\n        return x  # indent",
    "Héllo, wörld! Ça va? Ñandú. Straße", "日本語のテキスト、中文文本。", "emoji 🤗👍🏽🇫🇷 and ZWJ 👩‍👩‍👧",
    "Здравствуй, мир", "مرحبا بالعالم", "x" * 300, "1234567890 3.14159 -42 1e-10",
    "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n", "<|endoftext|>text<|endoftext|>",
    "not<|im_end|>special? <|im_start|", "def f(a, b):\n\treturn {'k': [a, b]}\n", "\u00a0nbsp\u2009thin\u3000ideo",
    "'s 't 're 've 'm 'll 'd", "a\u0301 e\u0301 combining", "\x00\x01 control \x7f",
]


CONVERSATIONS = [
    [{"role": "user", "content": "What is the capital of France?"}],
    [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi  there\n\n"},
     {"role": "assistant", "content": "Hello! 🤗"}, {"role": "user", "content": "<|im_end|> é 日本\t"}],
    [{"role": "user", "content": ""}],
    [{"role": "user", "content": "  spaces  "}, {"role": "assistant", "content": "<|endoftext|>"},
     {"role": "user", "content": "x" * 200}],
]


def _fresh(path: str) -> GGUFTokenizer:
    tokenizer = gguf_tokenizer(GGUFFile(path), path)
    assert isinstance(tokenizer, GGUFTokenizer)  # the fast path, not transformers' conversion
    return tokenizer


def _same_tokenizer(path: str, ref) -> None:
    """Everything the engine calls without transformers first (which must not build it), then the rest."""
    ours = _fresh(path)
    assert json.loads(ours.backend_tokenizer.to_str()) == json.loads(ref.backend_tokenizer.to_str())
    assert ours.chat_template == ref.chat_template
    assert (ours.bos_token_id, ours.eos_token_id) == (ref.bos_token_id, ref.eos_token_id)
    for text in TEXTS:
        for special in (True, False):
            assert ours.encode(text, add_special_tokens=special) == ref.encode(text, add_special_tokens=special)
    for conv in CONVERSATIONS:
        for gen in (True, False):
            want_text = ref.apply_chat_template(conv, add_generation_prompt=gen, tokenize=False)
            assert ours.apply_chat_template(conv, add_generation_prompt=gen, tokenize=False) == want_text
            want_ids = ref.apply_chat_template(conv, add_generation_prompt=gen, return_dict=False)
            assert ours.apply_chat_template(conv, add_generation_prompt=gen, return_dict=False) == want_ids
    assert ours._hf is None, "the lean calls built the transformers tokenizer"

    assert ours._special_tokens == ref.special_tokens_map  # what templates see as bos_token, eos_token, ...
    assert len(ours) == len(ref) and ours.pad_token_id == ref.pad_token_id
    assert {i: str(t) for i, t in ours.added_tokens_decoder.items()} == \
        {i: str(t) for i, t in ref.added_tokens_decoder.items()}
    hf = ours.transformers_tokenizer
    assert json.loads(hf.backend_tokenizer.to_str()) == json.loads(ref.backend_tokenizer.to_str())
    for text in TEXTS:
        ids = ref.encode(text)
        assert hf.encode(text) == ids and ours(text).input_ids == ref(text).input_ids
        for skip in (True, False):
            assert ours.decode(ids, skip_special_tokens=skip) == ref.decode(ids, skip_special_tokens=skip)
    conv = CONVERSATIONS[1]
    assert ours.apply_chat_template(conv)["input_ids"] == ref.apply_chat_template(conv)["input_ids"]


@pytest.mark.slow
def test_default_model_tokenizer_is_transformers_one(default_model_path):
    _same_tokenizer(default_model_path, smollm2_tokenizer())
    ours = _fresh(default_model_path)
    assert ours.encode("Hello world") == [19556, 905]
    prompt = ours.apply_chat_template(CONVERSATIONS[0], add_generation_prompt=True, tokenize=False)
    assert prompt.startswith("<|im_start|>system\n") and prompt.endswith("<|im_start|>assistant\n")


def test_chat_template_errors_and_extras_like_transformers(default_model_path):
    import jinja2

    ours = _fresh(default_model_path)
    raising = "{{ raise_exception('roles must alternate') }}"
    with pytest.raises(jinja2.TemplateError, match="roles must alternate"):
        ours.apply_chat_template(CONVERSATIONS[0], chat_template=raising, tokenize=False)
    tojson = "{{ messages | tojson }}{{ bos_token }}{% for m in messages %}{% if loop.first %}{% continue %}" \
             "{% endif %}{{ m.content }}{% endfor %}"
    conv = [{"role": "user", "content": "<é>"}, {"role": "user", "content": "b"}]
    assert ours.apply_chat_template(conv, chat_template=tojson, tokenize=False) == \
        '[{"role": "user", "content": "<é>"}, {"role": "user", "content": "b"}]<|im_start|>b'
    assert ours._hf is None


def _tokenizer_gguf(tmp_path, model="gpt2", pre="smollm", add_bos=False, extra_user=False) -> str:
    """A GGUF holding only the default model's tokenizer metadata (with the given changes)."""
    import gguf

    from goodserve.models.loader import default_model_path

    fields = GGUFFile(default_model_path()).fields
    types = list(fields["tokenizer.ggml.token_type"])
    if extra_user:  # mark a couple of ordinary tokens user-defined
        types[300] = types[301] = 4
    path = str(tmp_path / f"tok-{model}-{pre}-{add_bos}-{extra_user}.gguf")
    w = gguf.GGUFWriter(path, "llama")
    w.add_tokenizer_model(model)
    w.add_tokenizer_pre(pre)
    w.add_token_list(fields["tokenizer.ggml.tokens"])
    w.add_token_types(types)
    w.add_token_merges(fields["tokenizer.ggml.merges"])
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_pad_token_id(2)
    w.add_add_bos_token(add_bos)
    w.add_chat_template(fields["tokenizer.chat_template"])
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


@pytest.mark.slow
@pytest.mark.parametrize("add_bos, extra_user", [(True, False), (False, True)])
def test_variants_match_transformers(tmp_path, add_bos, extra_user):
    from transformers import PreTrainedTokenizerFast

    path = _tokenizer_gguf(tmp_path, add_bos=add_bos, extra_user=extra_user)
    ref = PreTrainedTokenizerFast.from_pretrained(os.path.dirname(path), gguf_file=os.path.basename(path))
    _same_tokenizer(path, ref)
    assert (_fresh(path).encode("hi")[0] == 1) is add_bos


@pytest.mark.slow
def test_other_vocabularies_go_through_transformers(tmp_path):
    path = _tokenizer_gguf(tmp_path, pre="qwen2")  # a BPE with its own split regex
    file = GGUFFile(path)
    assert build_gguf_backend(file.fields) is None
    tokenizer = gguf_tokenizer(file, path)  # transformers' conversion, as before
    assert not isinstance(tokenizer, GGUFTokenizer) and tokenizer.encode("Hello world")


def test_unknown_split_rule_refused_by_name(tmp_path):
    """A byte-level BPE whose ``tokenizer.ggml.pre`` names a split no tokenizer here implements (DeepSeek-V2's
    ``deepseek-llm``) is refused by that name before any weight is read: transformers would split it with GPT-2's
    regex and give other token ids without a word."""
    from goodserve.models.gguf_tokenizer import check_split_rule

    fields = GGUFFile(_tokenizer_gguf(tmp_path, pre="deepseek-llm")).fields
    with pytest.raises(ValueError, match="tokenizer.ggml.pre='deepseek-llm' is not supported"):
        check_split_rule(fields)
    for pre in ("smollm", "qwen2", "llama-bpe", "default"):
        check_split_rule({**fields, "tokenizer.ggml.pre": pre})
    check_split_rule({k: v for k, v in fields.items() if k != "tokenizer.ggml.pre"})
