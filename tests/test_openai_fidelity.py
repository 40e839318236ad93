"""OpenAI API fidelity (issue #11), end to end with the real ``openai`` client against uvicorn, over the default
model (SmolLM2-135M) on CPU: logprobs that mean one thing (C15, C16), every parameter applied or refused
(C17), chat roles (C18), error bodies, echo with logprobs, and the model card. See /work/shared/cases/CASES.md.
"""

from __future__ import annotations

import json
import math

import jsonschema
import openai
import pytest

from goodserve.engine.args import EngineArgs
from goodserve.engine.async_engine import AsyncEngine
from goodserve.engine.engine import Engine
from server_fixtures import wait_idle

pytestmark = pytest.mark.slow

MAX_MODEL_LEN = 512
MODEL = "smol"


@pytest.fixture(scope="module")
def engine():
    eng = AsyncEngine(Engine(EngineArgs(dtype="float32", num_blocks=256, max_num_batched_tokens=256,
                                        max_model_len=MAX_MODEL_LEN, log_stats_interval=0)))
    yield eng
    eng.shutdown()


def refused(param: str, call, *args, **kwargs) -> dict:
    """Run an ``openai`` call that must be a 400 naming ``param``; return the error body."""
    with pytest.raises(openai.BadRequestError) as e:
        call(*args, **kwargs)
    err = e.value.body
    assert err["param"] == param, err
    return err


def incomplete_utf8(tail: bytes) -> bool:
    """Whether ``tail`` is the start of one UTF-8 character that is not finished."""
    if not 0 < len(tail) < 4:
        return False
    try:
        tail.decode("utf-8")
        return False
    except UnicodeDecodeError as e:
        return e.reason == "unexpected end of data"


# -------------------------------------------------------------------------------- C15: logprob bytes
@pytest.mark.parametrize("question", ["请用中文回答：春天是什么？",
                                      "Reply with the Japanese word for cat and a cat emoji."])
def test_c15_logprob_bytes_are_each_tokens_own(client, question):
    """C15: a token holding part of a character has its real bytes (a partial UTF-8 sequence); all bytes
    joined are the content's UTF-8 (plus, when max_tokens cut a character in two, that character's start)."""
    kw = dict(model=MODEL, messages=[{"role": "user", "content": question}], temperature=0, max_tokens=24,
              logprobs=True, top_logprobs=1)
    choice = client.chat.completions.create(**kw).choices[0]
    tokens = choice.logprobs.content
    joined = b"".join(bytes(t.bytes) for t in tokens)
    content = choice.message.content.encode()
    assert joined.startswith(content)
    assert joined == content or (choice.finish_reason == "length" and incomplete_utf8(joined[len(content):]))
    partial = [t for t in tokens if incomplete_utf8(bytes(t.bytes)) or not _decodes(bytes(t.bytes))]
    assert partial, "the case needs tokens that hold part of a character"
    for t in partial:
        assert "\ufffd" not in t.token and "\\x" in t.token  # written as \xNN, as OpenAI does
    for t in tokens:  # greedy: the top-1 entry is the token itself, with its logprob and bytes
        assert (t.top_logprobs[0].token, t.top_logprobs[0].bytes, t.top_logprobs[0].logprob) == \
            (t.token, t.bytes, t.logprob)
    streamed = [c for c in client.chat.completions.create(stream=True, **kw) if c.choices]
    stream_tokens = [t for c in streamed if c.choices[0].logprobs for t in c.choices[0].logprobs.content]
    assert [(t.token, t.bytes) for t in stream_tokens] == [(t.token, t.bytes) for t in tokens]
    # (the second call reads the prompt from the prefix cache: the same numbers up to float rounding)
    assert [t.logprob for t in stream_tokens] == pytest.approx([t.logprob for t in tokens], abs=1e-4)


def _decodes(b: bytes) -> bool:
    try:
        b.decode("utf-8")
        return True
    except UnicodeDecodeError:
        return False


def test_c15_text_offset_indexes_text(client):
    """C15: completions ``text_offset`` indexes ``text``: each token's text starts at its offset (a token
    continuing a character starts where that character does)."""
    for stream in (False, True):
        kw = dict(model=MODEL, prompt="请用中文写一首关于春天的短诗：", max_tokens=24, temperature=0, logprobs=1)
        if stream:
            chunks = list(client.completions.create(stream=True, **kw))
            text = "".join(c.choices[0].text for c in chunks)
            lp = [c.choices[0].logprobs for c in chunks if c.choices[0].logprobs]
            tokens = [t for x in lp for t in x.tokens]
            offsets = [o for x in lp for o in x.text_offset]
        else:
            choice = client.completions.create(**kw).choices[0]
            text, tokens, offsets = choice.text, choice.logprobs.tokens, choice.logprobs.text_offset
        assert offsets[0] == 0 and offsets == sorted(offsets) and offsets[-1] <= len(text)
        whole = [i for i, t in enumerate(tokens) if "\\x" not in t]
        assert whole
        for i in whole:
            if i == 0 or "\\x" not in tokens[i - 1]:  # starts on a character boundary
                assert text[offsets[i]:offsets[i] + len(tokens[i])] == tokens[i]


ZWJ_SCIENTISTS = "\U0001F468\u200d\U0001F52C" * 3  # "👨‍🔬👨‍🔬👨‍🔬"


def test_c22_zwj_emoji_logprob_bytes(client):
    """C22: chat at temperature 0 repeating "👨‍🔬👨‍🔬👨‍🔬" with ``logprobs: true``: each token's ``bytes`` are its
    own (the byte pieces of the emoji and the joiner), never U+FFFD's; joined they are the content's UTF-8;
    ``token`` writes a byte that is not a whole character as ``\\xNN``. Completions' ``text_offset`` over the
    same text indexes it (a token continuing a character starts where that character does)."""
    choice = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": f'Repeat "{ZWJ_SCIENTISTS}" exactly.'}],
        temperature=0, max_tokens=24, logprobs=True).choices[0]
    tokens = choice.logprobs.content
    assert ZWJ_SCIENTISTS[:3] in choice.message.content  # the model repeats at least one scientist
    assert all(t.bytes != list("\ufffd".encode()) and "\ufffd" not in t.token for t in tokens)
    joined = b"".join(bytes(t.bytes) for t in tokens)
    content = choice.message.content.encode()
    assert joined == content or (choice.finish_reason == "length" and joined.startswith(content)
                                 and incomplete_utf8(joined[len(content):]))
    partial = [t for t in tokens if not _decodes(bytes(t.bytes))]
    assert partial and all(t.token == bytes(t.bytes).decode("utf-8", "backslashreplace") for t in partial)

    lp = client.completions.create(model=MODEL, prompt=ZWJ_SCIENTISTS, echo=True, max_tokens=1, temperature=0,
                                   logprobs=0).choices[0]
    text, offsets, strings = lp.text, lp.logprobs.text_offset, lp.logprobs.tokens
    assert text.startswith(ZWJ_SCIENTISTS)
    prompt_offsets = offsets[:len(offsets) - 1]
    # The emoji's tokens: man (3 byte pieces), joiner (2), microscope (3), so offsets 0 0 0 1 1 2 2 2, 3 3 3 ...
    assert prompt_offsets == [c + 3 * k for k in range(3) for c in (0, 0, 0, 1, 1, 2, 2, 2)]
    assert strings[:5] == ["\\xf0\\x9f", "\\x91", "\\xa8", "\\xe2\\x80", "\\x8d"]


# ------------------------------------------------------------------------------ C16: logprob meaning
def test_c16_logprobs_do_not_move_with_temperature_top_p(client):
    """C16: the sampled token's logprob equals its entry in top_logprobs, and equals what a temperature-0
    request reports at the same position (same prefix): logprobs are the model's, not the sampler's."""
    base = dict(model=MODEL, prompt="Once upon a time, in a small village,", max_tokens=12, logprobs=5)
    greedy = client.completions.create(temperature=0, **base).choices[0].logprobs
    for kw in (dict(temperature=0.5, seed=1), dict(temperature=1.0, top_p=0.5, seed=2),
               dict(temperature=1.5, extra_body={"top_k": 3}, seed=3)):
        lp = client.completions.create(**base, **kw).choices[0].logprobs
        for i, (tok, value, top) in enumerate(zip(lp.tokens, lp.token_logprobs, lp.top_logprobs)):
            assert tok in top or "top_p" in kw  # top-k 3 and temperature 0.5 keep to the top 5 here
            if tok in top:
                assert top[tok] == value  # the same number, to the bit
            if lp.tokens[:i] != greedy.tokens[:i]:
                break  # the prefixes differ from here on: so do the distributions
            assert top == pytest.approx(greedy.top_logprobs[i], abs=1e-4)
            if tok in greedy.top_logprobs[i]:
                assert value == pytest.approx(greedy.top_logprobs[i][tok], abs=1e-4)


def test_c16_chat_logprob_equals_its_top_entry_when_sampling(client):
    r = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Tell me a story."}],
                                       max_tokens=10, temperature=1.3, top_p=0.8, seed=5, logprobs=True,
                                       top_logprobs=20)
    for t in r.choices[0].logprobs.content:
        assert math.isfinite(t.logprob)
        match = [e.logprob for e in t.top_logprobs if e.token == t.token]
        if match:
            assert match[0] == t.logprob


# ---------------------------------------------------------------------- C17: parameters applied or refused
def _greedy_next(client, engine, prompt: str) -> tuple[int, str]:
    ids = engine.tokenizer.encode(prompt)
    text = client.completions.create(model=MODEL, prompt=ids, max_tokens=1, temperature=0).choices[0].text
    both = engine.tokenizer.encode(prompt + text)
    assert both[:len(ids)] == ids and len(both) == len(ids) + 1
    return both[-1], text


def test_c17_logit_bias_bans_and_forces(client, engine):
    """C17: logit_bias -100 on the greedy next token: a different token, and it never appears; +100 forces."""
    prompt = "The capital of France is"
    token, text = _greedy_next(client, engine, prompt)
    assert text == " Paris"
    banned = client.completions.create(model=MODEL, prompt=prompt, max_tokens=8, temperature=0, logprobs=1,
                                       logit_bias={str(token): -100})
    assert text not in banned.choices[0].logprobs.tokens
    assert banned.choices[0].logprobs.tokens[0] != text
    forced = client.completions.create(model=MODEL, prompt=prompt, max_tokens=4, temperature=0.8, seed=1,
                                       logit_bias={str(token): 100})
    assert forced.choices[0].text == text * 4
    chat = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Say hi"}],
                                          max_tokens=3, temperature=0, logit_bias={str(token): 100})
    assert chat.choices[0].message.content == text * 3


def test_c17_unimplemented_fields_are_400s_naming_them(client):
    """C17: an OpenAI field the server does not implement is a 400 naming it, never a 200 that ignores it."""
    msgs = [{"role": "user", "content": "hi"}]
    err = refused("suffix", client.completions.create, model=MODEL, prompt="def f(", suffix="x", max_tokens=2)
    assert err["code"] == "unsupported_parameter" and "suffix" in err["message"]
    refused("best_of", client.completions.create, model=MODEL, prompt="hi", best_of=2, max_tokens=2)
    assert client.completions.create(model=MODEL, prompt="hi", best_of=1, max_tokens=2).choices  # best_of == n
    tool = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}
    refused("tools", client.chat.completions.create, model=MODEL, messages=msgs, tools=[tool])
    refused("tool_choice", client.chat.completions.create, model=MODEL, messages=msgs, tool_choice="required")
    refused("audio", client.chat.completions.create, model=MODEL, messages=msgs,
            audio={"voice": "alloy", "format": "wav"}, modalities=["text", "audio"])
    refused("modalities", client.chat.completions.create, model=MODEL, messages=msgs, modalities=["audio"])
    refused("prediction", client.chat.completions.create, model=MODEL, messages=msgs,
            prediction={"type": "content", "content": "x"})
    refused("n_choices", client.chat.completions.create, model=MODEL, messages=msgs, extra_body={"n_choices": 2})
    refused("messages[0].tool_calls", client.chat.completions.create, model=MODEL,
            messages=[{"role": "assistant", "content": None, "tool_calls": []}, *msgs])
    # Fields that mean "off" are accepted; identifiers are ignored by design.
    ok = client.chat.completions.create(model=MODEL, messages=msgs, max_tokens=2, tools=None, store=False,
                                        user="u1", metadata={"k": "v"}, modalities=["text"])
    assert ok.choices[0].finish_reason == "length"


def test_c17_max_completion_tokens_is_honoured(client):
    msgs = [{"role": "user", "content": "Write a long story about the sea."}]
    r = client.chat.completions.create(model=MODEL, messages=msgs, max_completion_tokens=3, temperature=0)
    assert r.usage.completion_tokens == 3 and r.choices[0].finish_reason == "length"
    r = client.chat.completions.create(model=MODEL, messages=msgs, max_completion_tokens=5, max_tokens=9,
                                       temperature=0)
    assert r.usage.completion_tokens == 5  # max_completion_tokens wins over the deprecated max_tokens


# -------------------------------------------------------------------------------------- C18: roles
def test_c18_developer_is_system_and_unknown_roles_are_400(client, http):
    """C18: developer renders exactly as system (same prompt tokens); an unknown role is a 400; content as a
    list of text parts is accepted."""
    text = "You answer in French."
    user = {"role": "user", "content": "Say hello."}
    tokens = {role: http.post("/tokenize", json={"messages": [{"role": role, "content": text}, user]}).json()["tokens"]
              for role in ("developer", "system")}
    assert tokens["developer"] == tokens["system"]
    kw = dict(model=MODEL, max_tokens=8, temperature=0)
    dev = client.chat.completions.create(messages=[{"role": "developer", "content": text}, user], **kw)
    sys_ = client.chat.completions.create(messages=[{"role": "system", "content": text}, user], **kw)
    assert dev.usage.prompt_tokens == sys_.usage.prompt_tokens == len(tokens["system"])
    assert dev.choices[0].message.content == sys_.choices[0].message.content
    refused("messages[0].role", client.chat.completions.create,
            messages=[{"role": "wizard", "content": text}, user], **kw)
    refused("messages[1].role", client.chat.completions.create,
            messages=[user, {"role": "tool", "content": "42", "tool_call_id": "x"}], **kw)
    parts = client.chat.completions.create(messages=[{"role": "system", "content": [
        {"type": "text", "text": "You answer"}, {"type": "text", "text": "in French."}]}, user], **kw)
    joined = client.chat.completions.create(messages=[{"role": "system", "content": "You answer\nin French."},
                                                      user], **kw)
    assert parts.usage.prompt_tokens == joined.usage.prompt_tokens
    assert parts.choices[0].message.content == joined.choices[0].message.content
    refused("messages[0].content[0]", client.chat.completions.create, messages=[{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": "http://x/y.png"}}]}], **kw)


# ------------------------------------------------------------------------ errors and small gaps (item 6)
def test_error_bodies_name_the_right_field(client, http):
    msgs = [{"role": "user", "content": "hi"}]
    refused("top_logprobs", client.chat.completions.create, model=MODEL, messages=msgs, logprobs=True, top_logprobs=21)
    refused("top_logprobs", client.chat.completions.create, model=MODEL, messages=msgs, top_logprobs=2)
    refused("logprobs", client.completions.create, model=MODEL, prompt="hi", logprobs=21)
    refused("logit_bias", client.completions.create, model=MODEL, prompt="hi", logit_bias={"abc": 1})
    refused("logit_bias", client.completions.create, model=MODEL, prompt="hi", logit_bias={"1": 101})
    refused("logit_bias", client.completions.create, model=MODEL, prompt="hi", logit_bias={"99999999": 1})
    for call in (lambda: client.completions.create(model=MODEL, prompt="hello " * 600, max_tokens=4),
                 lambda: client.chat.completions.create(model=MODEL, messages=[{"role": "user",
                                                                                 "content": "hi " * 600}])):
        with pytest.raises(openai.BadRequestError) as e:
            call()
        err = e.value.body
        assert err["code"] == "context_length_exceeded"
        assert f"maximum context length is {MAX_MODEL_LEN} tokens" in err["message"]
        assert "cmpl-" not in err["message"]  # no internal request id
    r = http.post("/v1/completions", content=b'{"model": "smol", "prompt": ',
                  headers={"content-type": "application/json"})
    assert r.status_code == 400 and r.json()["error"]["param"] is None
    assert "not valid JSON" in r.json()["error"]["message"]


def test_model_card(client, http):
    card = client.models.retrieve(MODEL)
    assert card.id == MODEL and card.object == "model"
    r = http.get("/v1/models/no-such-model")
    assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"


def test_echo_with_logprobs_lists_the_prompt_tokens(client, engine):
    """Echo + logprobs: the prompt's tokens come first (the first with null logprobs), ``text_offset`` counts
    from the start of the echoed text; each prompt logprob is the model's, as a request that stops before
    that token reports it among its top logprobs."""
    prompt = "The capital of France is Paris, and the capital of Italy is"
    ids = engine.tokenizer.encode(prompt)
    for stream in (False, True):
        kw = dict(model=MODEL, prompt=prompt, max_tokens=3, temperature=0, logprobs=2, echo=True)
        if stream:
            chunks = list(client.completions.create(stream=True, **kw))
            text = "".join(c.choices[0].text for c in chunks)
            parts = [c.choices[0].logprobs for c in chunks if c.choices[0].logprobs]
            tokens = [t for p in parts for t in p.tokens]
            values = [v for p in parts for v in p.token_logprobs]
            tops = [t for p in parts for t in p.top_logprobs]
            offsets = [o for p in parts for o in p.text_offset]
        else:
            choice = client.completions.create(**kw).choices[0]
            lp = choice.logprobs
            text, tokens, values, tops, offsets = choice.text, lp.tokens, lp.token_logprobs, lp.top_logprobs, \
                lp.text_offset
        assert text.startswith(prompt) and len(tokens) == len(ids) + 3
        assert values[0] is None and tops[0] is None and all(v is not None for v in values[1:])
        assert offsets[0] == 0 and offsets[len(ids)] == len(prompt)
        assert "".join(tokens) == text
        for i, tok in enumerate(tokens):
            assert text[offsets[i]:offsets[i] + len(tok)] == tok
    checked = 0
    for k in range(1, len(ids)):
        top = client.completions.create(model=MODEL, prompt=ids[:k], max_tokens=1, temperature=0,
                                        logprobs=20).choices[0].logprobs.top_logprobs[0]
        if tokens[k] in top:
            assert values[k] == pytest.approx(top[tokens[k]], abs=1e-4)
            checked += 1
    assert checked >= len(ids) // 2


def test_streamed_chat_logprobs_equal_full(client, engine):
    kw = dict(model=MODEL, messages=[{"role": "user", "content": "Name three colours."}], max_tokens=10,
              temperature=0.7, seed=11, logprobs=True, top_logprobs=3)
    full = client.chat.completions.create(**kw).choices[0].logprobs.content
    chunks = [c for c in client.chat.completions.create(stream=True, **kw) if c.choices and c.choices[0].logprobs]
    streamed = [t for c in chunks for t in c.choices[0].logprobs.content]
    assert [(t.token, t.bytes, [e.token for e in t.top_logprobs]) for t in streamed] == \
        [(t.token, t.bytes, [e.token for e in t.top_logprobs]) for t in full]
    assert [t.logprob for t in streamed] == pytest.approx([t.logprob for t in full], abs=1e-4)
    wait_idle(engine)


def test_structured_output_with_the_real_model(client):
    """response_format json_schema on the real model: the answer validates (jsonschema)."""
    schema = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 40},
                                               "country": {"type": "string", "maxLength": 40},
                                               "population_millions": {"type": "integer", "minimum": 0,
                                                                       "maximum": 100}},
              "required": ["city", "country"], "additionalProperties": False}
    for content in ("What is the capital of France? Answer in JSON.", "Name a big city in Japan, as JSON."):
        r = client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": content}], temperature=0, max_tokens=120,
            response_format={"type": "json_schema", "json_schema": {"name": "city", "schema": schema}})
        assert r.choices[0].finish_reason == "stop"
        jsonschema.validate(json.loads(r.choices[0].message.content), schema)
