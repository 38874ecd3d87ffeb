"""transformers' greedy continuations, the reference of every greedy test: one computation
(`hf_greedy`) and one cache of its results (`GreedyReferences`).

The cache is shared by every test of a session and kept on disk for later sessions on the same
machine (`$PAGODA_CACHE_DIR/test-references/`, one JSON file per entry), keyed by the weights'
SHA-256, the transformers and torch versions, the prompt's token ids and the stop rule. A
continuation of N tokens also answers every request for fewer. The model is loaded only on a
miss, so a run whose references are all cached never loads it.

A test whose service work must not wait behind a long reference asks for its references in a
fixture, before the service starts, and times only its function
(`@pytest.mark.timeout(..., func_only=True)`): a slow machine makes the reference slow, never the
test fail after the service has done its part.
"""

from __future__ import annotations

import hashlib
import json
import os
import tempfile
from collections.abc import Callable
from pathlib import Path

import torch


def hf_greedy(model, prompt_ids: list[int], max_new_tokens: int, ignore_eos: bool = False) -> list[int]:
    """transformers' greedy continuation of `prompt_ids` (stops at EOS unless `ignore_eos`)."""
    with torch.inference_mode():
        if ignore_eos:  # transformers' own forward with its KV cache, argmax each step, no EOS check
            out = model(torch.tensor([prompt_ids]), use_cache=True)
            tokens = [int(out.logits[0, -1].argmax())]
            while len(tokens) < max_new_tokens:
                out = model(torch.tensor([[tokens[-1]]]), past_key_values=out.past_key_values, use_cache=True)
                tokens.append(int(out.logits[0, -1].argmax()))
            return tokens
        out = model.generate(
            torch.tensor([prompt_ids]),
            attention_mask=torch.ones(1, len(prompt_ids), dtype=torch.long),
            max_new_tokens=max_new_tokens,
            do_sample=False,
        )
    return out[0, len(prompt_ids) :].tolist()


def file_sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 22):
            digest.update(chunk)
    return digest.hexdigest()


class GreedyReferences:
    """Greedy continuations of one model, from memory, then disk, then `hf_greedy`.

    `load_model` is called at most once, on the first miss; `weights_id` names the weights
    (e.g. their SHA-256); `cache_dir` None keeps the results in memory only."""

    def __init__(self, load_model: Callable[[], object], weights_id: str, cache_dir: Path | None):
        self._load_model = load_model
        self._model = None
        import transformers

        self._key_prefix = f"{weights_id}|transformers {transformers.__version__}|torch {torch.__version__}"
        self._cache_dir = cache_dir
        self._memory: dict[str, list[int]] = {}

    def greedy(self, prompt_ids: list[int], max_new_tokens: int, ignore_eos: bool = False) -> list[int]:
        key = hashlib.sha256(f"{self._key_prefix}|{ignore_eos}|{list(prompt_ids)}".encode()).hexdigest()
        entry = self._memory.get(key) or self._read(key)  # (tokens, whether they ended at EOS)
        if entry is None or (len(entry[0]) < max_new_tokens and not entry[1]):
            tokens = hf_greedy(self.model, list(prompt_ids), max_new_tokens, ignore_eos)
            entry = (tokens, not ignore_eos and len(tokens) < max_new_tokens)
            self._write(key, entry)
        self._memory[key] = entry
        return entry[0][:max_new_tokens]

    @property
    def model(self):
        if self._model is None:
            self._model = self._load_model()
        return self._model

    def _path(self, key: str) -> Path | None:
        return None if self._cache_dir is None else self._cache_dir / f"{key}.json"

    def _read(self, key: str) -> tuple[list[int], bool] | None:
        path = self._path(key)
        if path is None or not path.is_file():
            return None
        try:
            entry = json.loads(path.read_text())
            return [int(t) for t in entry["tokens"]], bool(entry["ended"])
        except (OSError, ValueError, KeyError, TypeError):
            return None  # unreadable: computed again and rewritten

    def _write(self, key: str, entry: tuple[list[int], bool]) -> None:
        path = self._path(key)
        if path is None:
            return
        path.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile("w", dir=path.parent, delete=False, suffix=".tmp") as f:
            json.dump({"tokens": entry[0], "ended": entry[1]}, f)
        os.replace(f.name, path)  # atomic: parallel sessions never read half a file
