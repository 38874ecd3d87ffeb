"""Pagoda against transformers' static batching: the same workload, one run, one machine.

    python bench/compare.py                                   # the aim's workload (below), spawned service
    python bench/compare.py --num-requests 8 --prompt-len 32:64 --output-len 8:16   # a quick check
    python bench/compare.py --batch-size 8,16,32              # the baseline at each size; the best one counts

Order: measure the machine (matmul GFLOP/s, memory bandwidth), start Pagoda (scheduler + CPU
executor), run the workload through gRPC, stop Pagoda, then run the same requests with
transformers `generate` in static batches in this process. Prints the machine, both results
side by side and how many times better Pagoda is (rates: Pagoda / baseline; times: baseline /
Pagoda), and checks the aim:

    default model, float32, this CPU: Pagoda output tokens/s >= 2.5 x transformers static batching
    on 64 requests, prompts U[32..384], outputs U[16..160], all submitted at once.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repository root, when run as a script

import torch  # noqa: E402

from bench.baseline_hf import load_model, run_baseline  # noqa: E402
from bench.common import (  # noqa: E402
    OUT_DIR,
    add_workload_flags,
    exit_on_sigterm,
    format_table,
    machine_info,
    machine_line,
    metrics_table,
    plot_runs,
    records_json,
    timestamp,
    workload_from_args,
    write_json,
)
from bench.loadgen import add_service_flags, run_pagoda, service_target  # noqa: E402
from bench.matmul_roofline import roofline, roofline_lines  # noqa: E402

AIM = 2.5


def token_agreement(pagoda_records, hf_records) -> tuple[int, float]:
    """Requests whose greedy tokens are identical, and the mean share of tokens before the first difference."""
    same, shares = 0, []
    for a, b in zip(pagoda_records, hf_records):
        n = 0
        while n < min(len(a.token_ids), len(b.token_ids)) and a.token_ids[n] == b.token_ids[n]:
            n += 1
        same += a.token_ids == b.token_ids
        shares.append(n / max(len(b.token_ids), 1))
    return same, sum(shares) / max(len(shares), 1)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_workload_flags(parser)
    add_service_flags(parser)
    parser.add_argument("--batch-size", default="16", help="baseline batch size, or a list 8,16,32: the best counts")
    parser.add_argument("--threads", type=int, default=None,
                        help="torch threads of the baseline and of the executor (--num-threads); default: torch's")
    parser.add_argument("--warmup", type=int, default=2, help="short Pagoda requests before the measured run")
    parser.add_argument("--no-roofline", action="store_true", help="skip the matmul / bandwidth measurement")
    parser.add_argument("--out", default=None, help=f"JSON path (default {OUT_DIR}/compare-<time>.json)")
    parser.add_argument("--no-plot", action="store_true")
    args = parser.parse_args()
    exit_on_sigterm()
    if not args.target:
        args.spawn = True
    if args.threads:
        torch.set_num_threads(args.threads)
        if "--num-threads" not in args.executor_args:
            args.executor_args = f"{args.executor_args} --num-threads {args.threads}".strip()
    batch_sizes = [int(b) for b in args.batch_size.split(",")]

    workload = workload_from_args(args)
    specs = workload.build(args.model)
    machine = machine_info()
    print(f"machine   {machine_line(machine)}", flush=True)
    roof = None
    if not args.no_roofline:
        roof = roofline(args.model, seconds=0.3, specs=specs)
        print("\n".join(f"roofline  {line}" for line in roofline_lines(roof)), flush=True)

    print(f"\n[1/2] Pagoda: {workload.describe()}", flush=True)
    with service_target(args) as target:
        pagoda = run_pagoda(target, specs, workload.max_concurrency, args.warmup)
    print(f"      {pagoda['summary']['output_tokens_per_s']:.1f} output tokens/s in {pagoda['summary']['duration_s']:.1f} s",
          flush=True)

    hf, pad_id, name = load_model(args.model)
    baselines = {}
    for b in batch_sizes:
        print(f"[2/2] transformers static batches of {b}", flush=True)
        baselines[b] = run_baseline(hf, pad_id, specs, b, workload.max_concurrency)
        print(f"      {baselines[b]['summary']['output_tokens_per_s']:.1f} output tokens/s in "
              f"{baselines[b]['summary']['duration_s']:.1f} s", flush=True)
    best = max(baselines, key=lambda b: baselines[b]["summary"]["output_tokens_per_s"])
    base = baselines[best]
    hf_label = f"transformers b={best}"

    server = pagoda["server"]
    print()
    print(f"machine   {machine_line(machine)}")
    print(f"model     {name} ({server['model']} served), float32 on CPU, greedy, EOS ignored")
    print(f"workload  {workload.describe()}")
    print(f"pagoda    {args.target or 'spawned'}: scheduler {args.scheduler_args or '(defaults)'}; executor "
          f"{args.executor_args or '(defaults)'}; {server['executors'][0]['num_total_blocks']} KV blocks of "
          f"{server['block_size']}; {pagoda['summary']['num_preemptions']} preemptions")
    print(f"baseline  transformers generate, static batches of {best} (left-padded, each until its longest), "
          f"{torch.get_num_threads()} torch thread(s)")
    if len(baselines) > 1:
        print("          " + ", ".join(f"b={b}: {r['summary']['output_tokens_per_s']:.1f} tok/s"
                                       for b, r in baselines.items()))
    print(f"cpu load  runnable tasks on average: {pagoda['summary']['runnable_tasks']:.1f} during Pagoda, "
          f"{base['summary']['runnable_tasks']:.1f} during transformers, on {machine['cores_usable']} cores "
          f"(alone, a run keeps about its threads runnable; more = the cores were shared)")
    print()
    print(metrics_table({"pagoda": pagoda["summary"], hf_label: base["summary"]}, ratio_of=("pagoda", hf_label)))
    same, share = token_agreement(pagoda["records"], base["records"])
    print(f"\ngreedy tokens identical in {same}/{len(specs)} requests "
          f"({share:.0%} of tokens before the first difference, on average)")
    if roof:
        floor = roof["workload_compute_floor_s"]
        print(format_table(
            ["", "duration s", "useful GFLOP/s", "of measured peak"],
            [[run, r["summary"]["duration_s"], roof["workload_gflop"] / r["summary"]["duration_s"],
              f"{floor / r['summary']['duration_s']:.0%}"] for run, r in (("pagoda", pagoda), (hf_label, base))]))
    ratio = pagoda["summary"]["output_tokens_per_s"] / base["summary"]["output_tokens_per_s"]
    verdict = "MET" if ratio >= AIM else "NOT MET"
    print(f"\naim: Pagoda output tokens/s >= {AIM}x transformers static batching: {ratio:.2f}x -> {verdict}")

    out = Path(args.out) if args.out else OUT_DIR / f"compare-{timestamp()}.json"
    write_json(out, {
        "machine": machine, "model": name, "workload": workload, "server": server, "roofline": roof,
        "ratio_output_tokens_per_s": ratio, "aim": AIM,
        "pagoda": {"summary": pagoda["summary"], "requests": records_json(pagoda["records"], pagoda["t0"])},
        "transformers": {str(b): {"summary": r["summary"], "requests": records_json(r["records"], r["t0"])}
                         for b, r in baselines.items()},
        "transformers_best_batch_size": best,
    })
    print(f"JSON: {out}")
    if not args.no_plot:
        png = plot_runs({"pagoda": (pagoda["records"], pagoda["t0"], pagoda["t_end"]),
                         hf_label: (base["records"], base["t0"], base["t_end"])},
                        out.with_suffix(".png"), f"{name}: {workload.describe()}")
        if png:
            print(f"plot: {png}")


if __name__ == "__main__":
    main()
