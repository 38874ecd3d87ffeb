from __future__ import annotations

import pytest

from pagoda import model_files


@pytest.fixture(scope="session")
def default_model_dir():
    return model_files.resolve_model(None)


@pytest.fixture(scope="session")
def hf_reference(default_greedy, default_tokenizer):
    """transformers' own load of the default GGUF file: the reference for every numeric claim
    (the one model `default_greedy` computes its cached continuations with)."""
    return default_greedy.model, default_tokenizer
