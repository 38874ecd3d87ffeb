"""tests/references.py: each greedy reference is computed once, served from memory or disk after,
shorter requests from a longer continuation, and equal to transformers' own greedy generate."""

from __future__ import annotations

import torch
from transformers import AutoModelForCausalLM, LlamaConfig

from tests.references import GreedyReferences, hf_greedy

CONFIG = dict(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
              num_key_value_heads=1, max_position_embeddings=128, bos_token_id=1, eos_token_id=2)


class CountingLoader:
    def __init__(self):
        self.loads = 0
        torch.manual_seed(0)
        self.model = AutoModelForCausalLM.from_config(LlamaConfig(**CONFIG), dtype=torch.float32).eval()

    def __call__(self):
        self.loads += 1
        return self.model


def test_computed_once_then_served_from_memory_and_from_disk(tmp_path, monkeypatch):
    loader = CountingLoader()
    refs = GreedyReferences(loader, "tiny", tmp_path)
    long = refs.greedy([5, 6, 7], 12, ignore_eos=True)
    assert long == hf_greedy(loader.model, [5, 6, 7], 12, ignore_eos=True) and len(long) == 12
    calls = []
    monkeypatch.setattr("tests.references.hf_greedy", lambda *a: calls.append(a) or [])
    assert refs.greedy([5, 6, 7], 5, ignore_eos=True) == long[:5]  # from the longer continuation
    fresh = GreedyReferences(CountingLoader(), "tiny", tmp_path)  # a later session: from disk
    assert fresh.greedy([5, 6, 7], 12, ignore_eos=True) == long
    assert calls == [] and loader.loads == 1 and fresh.model is not None


def test_the_key_holds_the_weights_the_stop_rule_and_the_prompt(tmp_path):
    loader = CountingLoader()
    refs = GreedyReferences(loader, "tiny", tmp_path)
    refs.greedy([5, 6, 7], 4, ignore_eos=True)
    refs.greedy([5, 6, 8], 4, ignore_eos=True)
    refs.greedy([5, 6, 7], 4, ignore_eos=False)
    GreedyReferences(loader, "other weights", tmp_path).greedy([5, 6, 7], 4, ignore_eos=True)
    assert len(list(tmp_path.glob("*.json"))) == 4


def test_a_longer_request_computes_again_unless_the_stored_one_ended_at_eos(tmp_path):
    loader = CountingLoader()
    refs = GreedyReferences(loader, "tiny", tmp_path)
    short = refs.greedy([9, 3], 3, ignore_eos=True)
    assert refs.greedy([9, 3], 6, ignore_eos=True)[:3] == short
    (path,) = tmp_path.glob("*.json")
    path.write_text('{"tokens": [4, 2], "ended": true}')  # as if generate had stopped at EOS
    assert GreedyReferences(loader, "tiny", tmp_path).greedy([9, 3], 50, ignore_eos=True) == [4, 2]
