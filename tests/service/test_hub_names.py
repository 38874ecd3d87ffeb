"""A scheduler and an executor started with a Hugging Face name and --revision, from a cache written by hand."""

from __future__ import annotations

import pytest

from pagoda import model_files
from pagoda.v1 import generation_pb2 as pb
from tests.hub_cache import write_snapshot
from tests.service.harness import Service, collect, greedy_request


@pytest.mark.slow
def test_scheduler_and_executor_serve_the_revision_they_are_given(tmp_path, monkeypatch, default_greedy):
    """org/smol-GGUF has the default model's file at v1 only (main holds another file): both services
    must resolve v1's snapshot, or the executor's fingerprint would not match and nothing would serve."""
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.delenv("HF_HUB_CACHE", raising=False)
    cache = tmp_path / "hf" / "hub"
    gguf = model_files.default_gguf_path()  # SmolLM2-135M-Instruct.Q4_1.gguf
    write_snapshot(cache, "org/smol-GGUF", "1" * 40, {gguf.name: gguf}, refs=("v1",))
    write_snapshot(cache, "org/smol-GGUF", "2" * 40, {"smol-Q4_1.gguf": b"GGUF"})
    revision = ["--revision", "v1"]
    prompt = [1, 520, 33, 1200, 9, 17]
    with Service(model="org/smol-GGUF:Q4_1", scheduler_args=revision, executor_args=revision) as svc:
        assert svc.stub.GetModelInfo(pb.GetModelInfoRequest(), timeout=10).name == "org/smol-GGUF:Q4_1"
        request = greedy_request(prompt_ids=prompt, max_tokens=8, ignore_eos=True)
        result = collect(svc.stub.Generate(request, timeout=120))
    assert result["outputs"][0]["token_ids"] == default_greedy.greedy(prompt, 8, ignore_eos=True)
