"""The baseline: the same workload with Hugging Face transformers `generate` in static batches.

    python bench/baseline_hf.py --batch-size 16
    python bench/baseline_hf.py --num-requests 8 --prompt-len 64 --output-len 16 --batch-size 4

What a user without a serving engine does: take up to `--batch-size` requests that have
arrived (in arrival order), left-pad them to the longest prompt, and run `generate` until the
longest output of the batch is done (greedy, EOS ignored, float32, KV cache on); then the next
batch. Requests that arrive meanwhile wait for the running batch to finish.

Metrics, as in bench/loadgen.py, with these meanings here:
    TTFT    the batch's first decode step - the request's arrival (its whole prefill, queueing included)
    ITL     the batch's step times, over the request's own tokens (a streamer timestamps each step)
    E2E     the batch's end - arrival: `generate` returns every sequence together
    tokens  only each request's own output tokens count; steps past its length are waste
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repository root, when run as a script

import torch  # noqa: E402

from bench.common import (  # noqa: E402
    OUT_DIR,
    RequestRecord,
    RequestSpec,
    RunQueueSampler,
    add_workload_flags,
    exit_on_sigterm,
    machine_info,
    machine_line,
    metrics_table,
    plot_runs,
    records_json,
    summarize,
    timestamp,
    workload_from_args,
    write_json,
)


class StepClock:
    """A `generate` streamer that only timestamps each call: the prompt first, then every step."""

    def __init__(self) -> None:
        self.times: list[float] = []

    def put(self, value) -> None:
        self.times.append(time.perf_counter())

    def end(self) -> None:
        pass


def load_model(model: str | None):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from pagoda.model_files import model_name, resolve_model

    path = str(resolve_model(model))
    tokenizer = AutoTokenizer.from_pretrained(path)
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    gen = hf.generation_config
    gen.eos_token_id = None  # ignore EOS: every request runs to its exact length
    gen.do_sample, gen.temperature, gen.top_p, gen.top_k = False, None, None, None
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else hf.config.pad_token_id or 0
    gen.pad_token_id = pad
    return hf, pad, model_name(model)


def generate_batch(hf, pad_id: int, batch: list[RequestSpec]) -> tuple[torch.Tensor, list[float], int]:
    """Left-padded greedy `generate` of `batch`; returns the output ids, step times, padded prompt length."""
    width = max(len(s.prompt_ids) for s in batch)
    ids = torch.full((len(batch), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(batch), width), dtype=torch.long)
    for row, spec in enumerate(batch):
        ids[row, width - len(spec.prompt_ids) :] = torch.tensor(spec.prompt_ids)
        mask[row, width - len(spec.prompt_ids) :] = 1
    clock = StepClock()
    with torch.inference_mode():
        out = hf.generate(
            input_ids=ids,
            attention_mask=mask,
            max_new_tokens=max(s.max_tokens for s in batch),
            do_sample=False,
            streamer=clock,
        )
    return out, clock.times[1:], width


def run_static_batches(
    hf, pad_id: int, specs: list[RequestSpec], batch_size: int, max_concurrency: int | None = None
) -> tuple[list[RequestRecord], float, float]:
    batch_size = min(batch_size, max_concurrency or batch_size)
    records = {s.index: RequestRecord(s.index, len(s.prompt_ids), s.max_tokens) for s in specs}
    pending = sorted(specs, key=lambda s: (s.arrival_s, s.index))
    t0 = time.perf_counter()
    while pending:
        now = time.perf_counter() - t0
        if pending[0].arrival_s > now:
            time.sleep(pending[0].arrival_s - now)
            continue
        arrived = [s for s in pending if s.arrival_s <= now]
        batch = arrived[:batch_size]
        pending = [s for s in pending if s not in batch]
        batch_start = time.perf_counter()
        out, step_times, width = generate_batch(hf, pad_id, batch)
        batch_end = time.perf_counter()
        for row, spec in enumerate(batch):
            record = records[spec.index]
            arrival = t0 + spec.arrival_s
            record.start = max(arrival, batch_start) if max_concurrency else arrival
            record.token_times = step_times[: spec.max_tokens]
            record.token_counts = [1] * len(record.token_times)
            record.token_ids = out[row, width : width + spec.max_tokens].tolist()
            record.end = batch_end
    t_end = time.perf_counter()
    return [records[s.index] for s in specs], t0, t_end


def run_baseline(hf, pad_id: int, specs: list[RequestSpec], batch_size: int, max_concurrency: int | None = None) -> dict:
    warm = [RequestSpec(0, [1000 + j for j in range(32)], 4, 0.0), RequestSpec(1, [2000 + j for j in range(16)], 4, 0.0)]
    generate_batch(hf, pad_id, warm)
    with RunQueueSampler() as load:
        records, t0, t_end = run_static_batches(hf, pad_id, specs, batch_size, max_concurrency)
    summary = summarize(records, t0, t_end)
    summary["runnable_tasks"] = load.mean()
    return {"records": records, "t0": t0, "t_end": t_end, "summary": summary}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_workload_flags(parser)
    parser.add_argument("--model", default=None, help="HF directory or .gguf (default: SmolLM2-135M-Instruct)")
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    parser.add_argument("--out", default=None, help=f"JSON path (default {OUT_DIR}/baseline-hf-<time>.json)")
    parser.add_argument("--no-plot", action="store_true")
    args = parser.parse_args()
    exit_on_sigterm()
    if args.threads:
        torch.set_num_threads(args.threads)

    workload = workload_from_args(args)
    specs = workload.build(args.model)
    machine = machine_info()
    hf, pad_id, name = load_model(args.model)
    result = run_baseline(hf, pad_id, specs, args.batch_size, workload.max_concurrency)
    label = f"transformers b={args.batch_size}"

    print()
    print(f"machine   {machine_line(machine)}")
    print(f"model     {name}, transformers static batches of {args.batch_size}, float32, CPU")
    print(f"workload  {workload.describe()}")
    print()
    print(metrics_table({label: result["summary"]}))
    out = Path(args.out) if args.out else OUT_DIR / f"baseline-hf-{timestamp()}.json"
    write_json(out, {
        "machine": machine, "model": name, "batch_size": args.batch_size, "workload": workload,
        "summary": result["summary"], "requests": records_json(result["records"], result["t0"]),
    })
    print(f"\nJSON: {out}")
    if not args.no_plot:
        png = plot_runs({label: (result["records"], result["t0"], result["t_end"])}, out.with_suffix(".png"),
                        f"{name}: {workload.describe()}")
        if png:
            print(f"plot: {png}")


if __name__ == "__main__":
    main()
