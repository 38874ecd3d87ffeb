"""Set before anything imports triton: without CUDA, Triton kernels run in Triton's interpreter.

Session fixtures every test folder shares: the default model's tokenizer and its transformers
greedy references (`tests/references.py`: computed once, cached on disk)."""

import os

import pytest
import torch

from pagoda import model_files
from tests.references import GreedyReferences, file_sha256

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


@pytest.fixture(scope="session")
def default_tokenizer():
    """transformers' tokenizer of the default GGUF file."""
    from transformers import AutoTokenizer

    gguf = model_files.default_gguf_path()
    return AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)


@pytest.fixture(scope="session")
def default_greedy() -> GreedyReferences:
    """transformers' greedy continuations of the default GGUF file (loaded by transformers itself,
    fp32, only on a cache miss). PAGODA_TEST_REFERENCE_CACHE=0 keeps them in memory only."""
    gguf = model_files.default_gguf_path()

    def load():
        from transformers import AutoModelForCausalLM

        model = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32)
        return model.eval()

    on_disk = os.environ.get("PAGODA_TEST_REFERENCE_CACHE", "1") != "0"
    return GreedyReferences(load, f"gguf sha256 {file_sha256(gguf)}",
                            model_files.cache_dir() / "test-references" if on_disk else None)
