"""Session fixtures for tests that need real vLLM classes.

Import the fixture object into a test module to make it available there
(kept out of conftest.py on purpose)::

    from tests.support.vllm_fixtures import tiny_model_dir_fixture  # noqa: F401

then request ``tiny_model_dir`` as a test argument.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from pushkv.harness.tiny_model import build_tiny_mla_model, build_tiny_model

__all__ = [
    "tiny_mla_model_dir_fixture",
    "tiny_model_1kv_dir_fixture",
    "tiny_model_dir_fixture",
]


@pytest.fixture(scope="session", name="tiny_model_dir")
def tiny_model_dir_fixture(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny random Llama (2 layers, hidden 128, vocab 1024), built once per session."""
    return build_tiny_model(tmp_path_factory.mktemp("tiny_model"))


@pytest.fixture(scope="session", name="tiny_model_1kv_dir")
def tiny_model_1kv_dir_fixture(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny random Llama with 1 KV head (4 attention heads): TP 2 replicates it."""
    return build_tiny_model(tmp_path_factory.mktemp("tiny_model_1kv"), kv_heads=1)


@pytest.fixture(scope="session", name="tiny_mla_model_dir")
def tiny_mla_model_dir_fixture(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny random DeepSeek-V2 (MLA: one 576-wide latent per token; 2 layers)."""
    return build_tiny_mla_model(tmp_path_factory.mktemp("tiny_mla_model"))
