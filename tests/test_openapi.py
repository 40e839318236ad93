"""``/openapi.json`` says what the server does, checked by schemathesis against the real server; and a
hypothesis run over every text field with non-BMP characters and lone surrogates (C19), health checked
after each case. A tiny random model keeps both fast.
"""

from __future__ import annotations

import json

import httpx
import pytest
import schemathesis
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from goodserve.engine.args import EngineArgs
from goodserve.engine.async_engine import AsyncEngine
from goodserve.engine.engine import Engine
from goodserve.server.app import build_app
from server_fixtures import ServerThread
from tiny_models import make_tiny_hf_model

MODEL = "tiny"


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    model = make_tiny_hf_model(tmp_path_factory.mktemp("tiny"), "llama")
    engine = AsyncEngine(Engine(EngineArgs(model=model, dtype="float32", num_blocks=512, block_size=4,
                                           max_num_batched_tokens=64, max_model_len=256, log_stats_interval=0)))
    with ServerThread(build_app(engine, served_model_name=MODEL, max_waiting_requests=64)) as srv:
        srv.engine = engine
        yield srv
    engine.shutdown()


def test_schema_documents_real_responses(server):
    spec = httpx.get(server.base_url + "/openapi.json").json()
    for path in ("/v1/completions", "/v1/chat/completions"):
        responses = spec["paths"][path]["post"]["responses"]
        assert set(responses) == {"200", "400", "404", "413", "415", "429", "500", "503"}
        assert set(responses["200"]["content"]) == {"application/json", "text/event-stream"}
        assert "Retry-After" in responses["429"]["headers"]
        for code in ("400", "404", "413", "415", "429", "500", "503"):
            assert responses[code]["content"]["application/json"]["schema"]["$ref"].endswith("/ErrorResponse")
    assert "422" not in json.dumps(spec["paths"]) and "HTTPValidationError" not in json.dumps(spec)
    assert set(spec["paths"]["/health"]["get"]["responses"]) == {"200", "503"}
    assert "text/plain" in spec["paths"]["/metrics"]["get"]["responses"]["200"]["content"]
    props = spec["components"]["schemas"]["CompletionRequest"]["properties"]
    assert props["temperature"]["anyOf"][0] == {"type": "number", "minimum": 0.0, "maximum": 2.0}


_OPERATIONS = [(path, "POST", mode) for path in ("/v1/completions", "/v1/chat/completions", "/tokenize", "/detokenize")
               for mode in schemathesis.GenerationMode]
_OPERATIONS += [(path, "GET", schemathesis.GenerationMode.POSITIVE) for path in ("/v1/models", "/health", "/metrics")]


@pytest.mark.parametrize("path,method,mode", _OPERATIONS)
def test_api_conforms_to_its_schema(server, path, method, mode):
    """No 5xx, and every status, content type, header and body is the one the schema documents; data the
    schema forbids is refused; /health stays 200 after every case. Not checked: that every schema-valid
    body is accepted (a prompt plus ``max_tokens`` over the context, or token ids past the vocabulary, are
    400s no schema can express). Generated data includes lone surrogates and non-BMP text."""
    operation = schemathesis.openapi.from_url(server.base_url + "/openapi.json")[path][method]

    @given(case=operation.as_strategy(generation_mode=mode))
    @settings(max_examples=40, deadline=None, suppress_health_check=list(HealthCheck))
    def check(case) -> None:
        case.call_and_validate(base_url=server.base_url, timeout=60,
                               excluded_checks=[schemathesis.checks.positive_data_acceptance])
        assert httpx.get(server.base_url + "/health").status_code == 200

    check()


# Text with what JSON allows and UTF-8 does not: lone surrogates; and what UTF-16 needs two units for.
_chars = st.one_of(st.characters(codec="utf-8"), st.characters(min_codepoint=0x10000),
                   st.characters(min_codepoint=0xD800, max_codepoint=0xDFFF, categories=["Cs"]))
_text = st.text(_chars, min_size=1, max_size=8)


def _valid(text: str) -> bool:
    try:
        text.encode("utf-8")
        return True
    except UnicodeEncodeError:
        return False


@st.composite
def _bodies(draw) -> tuple[str, dict, list[str]]:
    """A request with random text in one or more text fields, and the texts it holds."""
    kind = draw(st.sampled_from(["completion", "chat", "tokenize"]))
    texts = [draw(_text)]
    if kind == "completion":
        body = {"prompt": texts[0], "max_tokens": 2}
        if draw(st.booleans()):
            texts.append(draw(_text))
            body["stop"] = [texts[1]]
        body["stream"] = draw(st.booleans())
        return "/v1/completions", body, texts
    if kind == "chat":
        return "/v1/chat/completions", {"messages": [{"role": "user", "content": texts[0]}], "max_tokens": 2,
                                        "stream": draw(st.booleans())}, texts
    return "/tokenize", {"prompt": texts[0]}, texts


def _num_tokens(server, text: str) -> int:
    r = httpx.post(server.base_url + "/tokenize", json={"model": MODEL, "prompt": text}, timeout=60)
    assert r.status_code == 200, r.text
    return r.json()["count"]


@given(_bodies())
@example(("/v1/completions", {"prompt": "\x16", "max_tokens": 2}, ["\x16"]))
@settings(max_examples=60, deadline=None, suppress_health_check=list(HealthCheck))
def test_any_text_is_served_or_refused_never_breaks_the_engine_C19(server, req):
    path, body, texts = req
    r = httpx.post(server.base_url + path, content=json.dumps({"model": MODEL, **body}),
                   headers={"content-type": "application/json"}, timeout=60)
    if all(_valid(t) for t in texts):
        if path == "/v1/completions" and not _num_tokens(server, texts[0]):
            # Bytes the vocabulary has no token for (SmolLM2's lacks 0x04, 0x16, 0x1d, ...) tokenize to nothing:
            # an empty prompt, refused.
            assert r.status_code == 400 and "prompt is empty" in r.json()["error"]["message"], r.text
        else:
            assert r.status_code == 200, r.text
    else:
        assert r.status_code == 400 and r.json()["error"]["code"] == "invalid_unicode", r.text
    assert httpx.get(server.base_url + "/health").status_code == 200
