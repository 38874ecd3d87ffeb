"""The executor with --attention-backend triton (the interpreter on the CPU) against transformers."""

from __future__ import annotations

from tests.service.harness import Service, collect, greedy_request, hf_greedy
from tests.service.test_tiny_models import build_tiny


def test_triton_backend_greedy_equals_transformers(tmp_path, default_model_dir):
    reference = build_tiny("llama", tmp_path, default_model_dir, shard=False)
    prompts = [[1, 700 + i, 33, 1200 + 5 * i, 9] * (2 + 3 * i) for i in range(3)]  # 10, 25, 40 tokens
    with Service(
        model=str(tmp_path),
        scheduler_args=["--max-num-batched-tokens", "32"],
        executor_args=["--attention-backend", "triton", "--num-kv-blocks", "64"],
    ) as svc:
        for prompt in prompts:
            result = collect(svc.stub.Generate(greedy_request(prompt_ids=prompt, max_tokens=6, ignore_eos=True), timeout=600))
            assert result["outputs"][0]["token_ids"] == hf_greedy(reference, prompt, 6, ignore_eos=True)
        assert "attention triton" in svc.logs()
        info = svc.wait_all_blocks_free()
        assert all(e.num_free_blocks == e.num_total_blocks for e in info.executors)
