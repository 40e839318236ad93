"""Structured outputs (``response_format``) with xgrammar, through the real server and the ``openai`` client, on a
tiny random-weight model: its logits are noise, so every valid output is the grammar's doing. Outputs are
checked with ``jsonschema`` over many prompts and seeds; invalid schemas are 400s; unconstrained requests in
the same batch are unaffected. The sampler-level tests check that only constrained rows are masked.
"""

from __future__ import annotations

import asyncio
import json

import httpx
import jsonschema
import openai
import pytest
import torch

from goodserve.engine.args import EngineArgs
from goodserve.engine.async_engine import AsyncEngine
from goodserve.engine.engine import Engine
from goodserve.runner.sampler import Sampler, SamplingMetadata, SamplingRow
from goodserve.runner.structured_output import StructuredOutputCompiler
from goodserve.sampling_params import SamplingParams, StructuredOutputsParams
from server_fixtures import wait_idle
from tiny_models import SMOLLM2_VOCAB, make_tiny_hf_model, smollm2_tokenizer

MODEL = "tiny"
EOS = 2  # SmolLM2's <|im_end|>

PERSON = {"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 12}, "age": {"type": "integer", "minimum": 0, "maximum": 150},
    "ok": {"type": "boolean"}, "tags": {"type": "array", "items": {"enum": ["red", "green", "blue"]}, "maxItems": 3},
    "kind": {"enum": ["cat", "dog"]}}, "required": ["name", "age", "ok", "tags", "kind"], "additionalProperties": False}
POINTS = {"type": "array", "minItems": 1, "maxItems": 4, "items": {
    "type": "object", "properties": {"x": {"type": "integer", "minimum": -9, "maximum": 9},
                                     "y": {"type": "number", "minimum": 0, "maximum": 1}},
    "required": ["x", "y"], "additionalProperties": False}}
CHOICE = {"anyOf": [{"type": "boolean"}, {"type": "null"}, {"enum": ["yes", "no", 7]}]}
SCHEMAS = [PERSON, POINTS, CHOICE]


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    model = make_tiny_hf_model(tmp_path_factory.mktemp("tiny"), "llama")
    eng = AsyncEngine(Engine(EngineArgs(model=model, dtype="float32", num_blocks=512, block_size=4,
                                        max_num_batched_tokens=256, max_model_len=512, log_stats_interval=0)))
    yield eng
    eng.shutdown()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.base_url + "/v1", api_key="none", max_retries=0, timeout=120)


def json_schema(schema: dict) -> dict:
    return {"type": "json_schema", "json_schema": {"name": "out", "schema": schema, "strict": True}}


@pytest.mark.parametrize("schema", SCHEMAS, ids=["person", "points", "choice"])
def test_json_schema_outputs_always_validate(client, engine, schema):
    """Every output, over prompts, seeds, temperatures, both endpoints and streaming, parses and validates;
    the grammar ends it with EOS (finish_reason "stop") once the value is complete."""
    for seed in range(8):
        kw = dict(model=MODEL, temperature=[1.0, 0.0, 1.5, 0.7][seed % 4], seed=seed, max_tokens=400,
                  response_format=json_schema(schema))
        if seed % 2:
            out = client.chat.completions.create(messages=[{"role": "user", "content": f"item {seed}"}], **kw)
            text, finish = out.choices[0].message.content, out.choices[0].finish_reason
        elif seed % 4 == 2:
            chunks = list(client.completions.create(prompt=f"Item number {seed}:", stream=True, **{
                k: v for k, v in kw.items() if k != "response_format"}, extra_body={"response_format": kw["response_format"]}))
            text, finish = "".join(c.choices[0].text for c in chunks), chunks[-1].choices[0].finish_reason
        else:
            out = client.completions.create(prompt=f"Item number {seed}:", **{
                k: v for k, v in kw.items() if k != "response_format"}, extra_body={"response_format": kw["response_format"]})
            text, finish = out.choices[0].text, out.choices[0].finish_reason
        assert finish == "stop", text
        jsonschema.validate(json.loads(text), schema)
    wait_idle(engine)


def test_json_object_outputs_are_objects(client, engine):
    """``json_object``: an output the grammar let finish is one JSON object. (A random model's strings can run
    past max_tokens; the grammar keeps what it wrote a prefix of an object.)"""
    finished = 0
    for seed in range(10):
        out = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": f"obj {seed}"}],
                                             temperature=1.0, seed=seed, max_tokens=120,
                                             response_format={"type": "json_object"}).choices[0]
        assert out.message.content.startswith("{")
        if out.finish_reason == "stop":
            assert isinstance(json.loads(out.message.content), dict)
            finished += 1
    assert finished >= 2


def test_invalid_schemas_and_combinations_are_400s(client):
    msgs = [{"role": "user", "content": "hi"}]
    cases = [({"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nope"}}},
              "response_format.json_schema.schema"),
             ({"type": "json_schema", "json_schema": {"name": "x"}}, "response_format.json_schema.schema"),
             ({"type": "xml"}, "response_format.type")]
    for rf, param in cases:
        with pytest.raises(openai.BadRequestError) as e:
            client.chat.completions.create(model=MODEL, messages=msgs, response_format=rf)
        assert e.value.body["param"] == param, e.value.body
    for extra, param in (({"min_tokens": 3}, "min_tokens"), ({"ignore_eos": True}, "ignore_eos")):
        with pytest.raises(openai.BadRequestError) as e:
            client.chat.completions.create(model=MODEL, messages=msgs, response_format={"type": "json_object"},
                                           extra_body=extra)
        assert e.value.body["param"] == param
    ok = client.chat.completions.create(model=MODEL, messages=msgs, max_tokens=2, response_format={"type": "text"})
    assert ok.choices[0].finish_reason == "length"


def test_logprobs_under_a_grammar_are_of_allowed_tokens(client):
    """The grammar is a logit processor: logprobs are taken after it, so the sampled token's logprob equals
    its top entry and forbidden tokens never appear among the top logprobs."""
    out = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "x"}], temperature=1.0,
                                         seed=3, max_tokens=200, logprobs=True, top_logprobs=5,
                                         response_format=json_schema(CHOICE)).choices[0]
    jsonschema.validate(json.loads(out.message.content), CHOICE)
    first = out.logprobs.content[0]
    assert all(e.token.lstrip()[:1] in ("t", "f", "n", '"', "7", "") for e in first.top_logprobs)
    for t in out.logprobs.content:
        assert [e.logprob for e in t.top_logprobs if e.token == t.token] == [t.logprob]


def test_unconstrained_requests_in_the_same_batch_are_unaffected(server, engine):
    """Constrained and unconstrained requests run concurrently (one batch); the unconstrained ones give
    exactly what they give alone."""
    prompts = [f"Story {i}: once upon a time" for i in range(6)]
    plain = {"model": MODEL, "max_tokens": 12, "temperature": 0, "ignore_eos": True}

    async def main():
        async with httpx.AsyncClient(base_url=server.base_url, timeout=120) as c:
            async def text(body):
                r = await c.post("/v1/completions", json=body)
                assert r.status_code == 200, r.text
                return r.json()["choices"][0]["text"]

            alone = [await text({**plain, "prompt": p}) for p in prompts]
            constrained = [{"model": MODEL, "prompt": p, "max_tokens": 300, "temperature": 1.0, "seed": i,
                            "response_format": json_schema(PERSON)} for i, p in enumerate(prompts)]
            mixed = await asyncio.gather(*(text(b) for pair in zip([{**plain, "prompt": p} for p in prompts],
                                                                   constrained) for b in pair))
            return alone, mixed

    alone, mixed = asyncio.run(main())
    assert mixed[0::2] == alone
    for text in mixed[1::2]:
        jsonschema.validate(json.loads(text), PERSON)
    wait_idle(engine)


# ------------------------------------------------------------------------------------- sampler level
def test_only_constrained_rows_are_masked():
    compiler = StructuredOutputCompiler(smollm2_tokenizer(), SMOLLM2_VOCAB, [EOS])
    spec = StructuredOutputsParams(json=json.dumps(CHOICE))
    logits = torch.randn(4, SMOLLM2_VOCAB, generator=torch.Generator().manual_seed(0))

    def rows(with_grammar: bool):
        out = []
        for i in range(4):
            p = SamplingParams(temperature=0.9, seed=i, logprobs=3)
            g = compiler.new_state(spec) if with_grammar and i % 2 else None
            out.append(SamplingRow(p, [1, 2], [], (EOS,), grammar=g))
        return out

    constrained = rows(True)
    meta = SamplingMetadata.from_requests(constrained, SMOLLM2_VOCAB)
    assert meta.grammar_rows == [1, 3] and meta.grammar_bitmask.shape == (4, SMOLLM2_VOCAB // 32)
    assert SamplingMetadata.from_requests(rows(False), SMOLLM2_VOCAB).grammar_rows is None
    masked = Sampler(0)(logits, meta)
    free = Sampler(0)(logits, SamplingMetadata.from_requests(rows(False), SMOLLM2_VOCAB))
    assert masked.token_ids[0::2] == free.token_ids[0::2]
    assert masked.logprobs[0::2] == free.logprobs[0::2] and masked.top_logprobs[0::2] == free.top_logprobs[0::2]
    tok = smollm2_tokenizer()
    for i in (1, 3):
        first = tok.decode([masked.token_ids[i]]).lstrip()
        assert first[:1] in ("t", "f", "n", '"', "7")
        assert constrained[i].grammar.accept(masked.token_ids[i])
