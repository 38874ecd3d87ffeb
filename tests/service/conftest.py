from __future__ import annotations

import pytest
import torch

from pagoda import model_files


@pytest.fixture(scope="session")
def default_model_dir():
    return model_files.resolve_model(None)


@pytest.fixture(scope="session")
def hf_reference():
    """transformers' own load of the default GGUF file: the reference for every numeric claim."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    gguf = model_files.default_gguf_path()
    tokenizer = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    model = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32)
    model.eval()
    return model, tokenizer
