"""The default model served with its GGUF blocks kept (Q4_1, Q8_0 head): greedy output equals
transformers' (which dequantizes the same file to float32), with prefill chunked into small
pieces and requests preempted for KV memory; the executor reports its weights' resident size."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

from tests.service.harness import Service, chat_ids, collect, greedy_request, hf_greedy

CHATS = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "Give me three tips for learning Python.",
    "Explain photosynthesis in one sentence.",
]
MAX_TOKENS = 32


def test_kept_blocks_under_chunked_prefill_and_preemption(hf_reference):
    model, tokenizer = hf_reference
    prompts = [chat_ids(tokenizer, c) for c in CHATS]
    # 24-token steps: every prompt (~35-45 tokens) is prefilled in pieces, beside other requests'
    # decodes; 10 blocks (144 token slots) for 4 requests of ~70 tokens: some must be preempted.
    with Service(
        executor_args=["--quantization", "gguf", "--num-kv-blocks", "10"],
        scheduler_args=["--max-num-batched-tokens", "24"],
    ) as svc:
        executor = svc.server_info().executors[0]
        assert 85 * 2**20 < executor.weight_bytes < 100 * 2**20  # float32 would be 515 MiB
        with ThreadPoolExecutor(len(prompts)) as pool:
            results = list(
                pool.map(
                    lambda p: collect(svc.stub.Generate(greedy_request(prompt_ids=p, max_tokens=MAX_TOKENS, ignore_eos=True), timeout=600)),
                    prompts,
                )
            )
        info = svc.wait_all_blocks_free()
        assert info.num_preemptions > 0
        assert "weights gguf" in svc.logs(tail=100_000)
    for content, prompt, result in zip(CHATS, prompts, results):
        assert result["outputs"][0]["token_ids"] == hf_greedy(model, prompt, MAX_TOKENS, ignore_eos=True), content
