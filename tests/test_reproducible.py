"""Same request, same answer on the served default model (issue 34): case C21 and seeded ``n > 1``.

A fresh ``goodserve serve`` with its default flags (batch-invariant numerics are a server's default for bfloat16
on a CPU with AMX; elsewhere the test asks for them). The prompts are longer than a KV block, so the later sends
hit the prefix cache the first one filled: their prompts' tails run as smaller chunks beside other choices.
"""

import os
import subprocess
import sys
import time

import httpx
import openai
import pytest

from goodserve.engine.args import resolve_batch_invariant
from server_fixtures import free_port

PROMPTS = ["Write a short story about a robot who learns to paint in the city of Lisbon during the winter festival.",
           "Explain in simple words why the sky looks blue during the day and red at sunset, for a child."]


@pytest.fixture(scope="module")
def default_server():
    port = free_port()
    flags = [] if resolve_batch_invariant(None, "cpu", "bfloat16", "auto", serving=True) else ["--batch-invariant"]
    proc = subprocess.Popen([sys.executable, "-m", "goodserve.cli", "serve", "--port", str(port),
                             "--log-stats-interval", "0", *flags], stderr=subprocess.PIPE, stdout=subprocess.DEVNULL,
                            text=True, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 180
    while True:
        assert proc.poll() is None, proc.stderr.read()
        try:
            if httpx.get(url + "/health", timeout=1).status_code == 200:
                break
        except httpx.HTTPError:
            pass
        assert time.monotonic() < deadline, "server did not start"
        time.sleep(0.3)
    client = openai.OpenAI(base_url=url + "/v1", api_key="unused", timeout=300)
    try:
        yield client, client.models.list().data[0].id
    finally:
        proc.terminate()
        proc.communicate(timeout=30)


def _texts(client, model, **kw) -> list[str]:
    if kw.pop("stream", False):
        texts: dict[int, str] = {}
        for chunk in client.completions.create(model=model, stream=True, **kw):
            for c in chunk.choices:
                texts[c.index] = texts.get(c.index, "") + c.text
        return [texts[i] for i in sorted(texts)]
    out = client.completions.create(model=model, **kw)
    return [c.text for c in sorted(out.choices, key=lambda c: c.index)]


@pytest.mark.slow
def test_c21_seeded_sampling_is_the_same_from_the_first_request(default_server):
    """C21: the first request on a fresh server samples the text the identical request samples afterwards,
    plain, with logprobs and streamed."""
    client, model = default_server
    body = dict(prompt=PROMPTS, n=2, seed=7, temperature=0.8, max_tokens=32)
    first = _texts(client, model, **body)
    assert len(first) == 4 and len(set(first)) == 4  # two prompts x two choices, each its own seed
    assert _texts(client, model, logprobs=1, **body) == first
    assert _texts(client, model, stream=True, **body) == first
    assert _texts(client, model, **body) == first


@pytest.mark.slow
def test_seeded_n4_request_reproduces_across_sends(default_server):
    client, model = default_server
    body = dict(prompt="Name a colour, then a fruit, then an animal:", n=4, seed=3, temperature=1.0, max_tokens=24)
    first = _texts(client, model, **body)
    assert len(set(first)) > 1  # choice i samples with seed + i
    assert _texts(client, model, **body) == first
    assert _texts(client, model, stream=True, **body) == first
