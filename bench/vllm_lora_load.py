"""vLLM's half of `bench_lora.py --vllm-python`: run under vLLM's own Python (its CPU build), not Pagoda's.

    <vllm python> bench/vllm_lora_load.py SPEC.json

SPEC.json (written by bench_lora.py): `model` (a Hugging Face folder), `adapters` (PEFT folders),
`workload` ([[prompt ids, max tokens], ...]), `rank`, `dtype`, `rounds`. vLLM's offline `LLM` with
`enable_lora` (`max_loras` 4, `max_lora_rank` the adapters' rank), prompts as token ids, greedy,
`ignore_eos`: the whole workload on the base model, then spread over the adapters (request i on
adapter i % 4), alternating, best of `rounds`. Prints one JSON line: output tokens/s of each.
"""

import json
import sys
import time


def main() -> None:
    spec = json.loads(open(sys.argv[1]).read())
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt
    from vllm.lora.request import LoRARequest

    llm = LLM(model=spec["model"], dtype=spec["dtype"], enable_lora=True, max_loras=4, max_lora_rank=spec["rank"],
              max_model_len=2048, enable_prefix_caching=False, max_num_batched_tokens=512, generation_config="vllm")
    prompts = [TokensPrompt(prompt_token_ids=ids) for ids, _ in spec["workload"]]
    params = [SamplingParams(temperature=0.0, max_tokens=n, min_tokens=n, ignore_eos=True) for _, n in spec["workload"]]
    loras = [LoRARequest(f"a{i}", i + 1, path) for i, path in enumerate(spec["adapters"])]
    total = sum(n for _, n in spec["workload"])
    llm.generate(prompts[:2], params[:2], lora_request=loras[:2], use_tqdm=False)  # warm-up: the LoRA paths compiled
    best = {"base": 0.0, "lora": 0.0}
    for r in range(spec["rounds"]):
        for which in (["base", "lora"] if r % 2 == 0 else ["lora", "base"]):
            requests = None if which == "base" else [loras[i % len(loras)] for i in range(len(prompts))]
            t0 = time.perf_counter()
            outputs = llm.generate(prompts, params, lora_request=requests, use_tqdm=False)
            seconds = time.perf_counter() - t0
            assert sum(len(o.outputs[0].token_ids) for o in outputs) == total
            best[which] = max(best[which], total / seconds)
            print(f"vllm round {r} {which}: {total / seconds:.1f} tok/s", file=sys.stderr, flush=True)
    print(json.dumps(best))


if __name__ == "__main__":
    main()
