"""Structured output: what a constraint costs, and where the grammar matcher should live.

    .venv/bin/python bench/bench_structured.py                 # all three parts
    .venv/bin/python bench/bench_structured.py --parts compile,step
    .venv/bin/python bench/bench_structured.py --parts load --num-requests 48

Three tables, on the default model (SmolLM2-135M-Instruct, its GGUF Q4_1 blocks):

1. compile: each constraint kind compiled by xgrammar for the model's tokenizer, first
   time and again (xgrammar's cache by content), as the executor compiles them; and the
   scheduler's check (`scheduler_svc.constraint_check`: a child process), first and cached.
2. step: one ModelRunner, decode steps of 1 and 64 running requests, every request
   JSON-schema constrained vs none, steps interleaved; beside them the constraint's own
   parts (filling the bitmask, masking the logits) and what vLLM's layout would add to
   each step: the bitmask serialized into the step plan and parsed by the executor.
3. load: the W48-like workload of bench/loadgen.py (48 requests, prompts 32-384 random
   token ids, outputs 16-160, all at once) against one spawned service, unconstrained and
   every request constrained by a JSON schema (an object whose string must run past
   max_tokens, so every output has its exact length), runs interleaved A B B A (prefix
   caching off, so that no run reuses an earlier run's prompts); then the same
   unconstrained load with `--no-async-scheduling`, which is what a scheduler-side matcher
   costs: it needs step N's tokens before it can fill step N+1's bitmask, so it cannot
   plan a step ahead.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repository root, when run as a script

from bench.common import add_workload_flags, format_table, machine_info, machine_line, metrics_table, workload_from_args  # noqa: E402

PERSON = {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"}}, "required": ["name", "age"]}
# The load's schema: its string is longer than any output (160 tokens), so every request ends by max_tokens.
LONG_ANSWER = {"type": "object", "properties": {"answer": {"type": "string", "minLength": 2000}}, "required": ["answer"]}
KINDS = {
    "json_schema (2 fields)": ("json_schema", json.dumps(PERSON)),
    "json_schema (30 fields, patterns)": (
        "json_schema",
        json.dumps({"type": "object", "properties": {f"f{i}": {"type": "string", "pattern": "[a-z]{3,9}"} for i in range(30)}}),
    ),
    "json_object": ("json_object", ""),
    "regex (date)": ("regex", r"(19|20)\d\d-(0[1-9]|1[0-2])-(0[1-9]|[12]\d|3[01])"),
    "grammar (EBNF)": ("grammar", 'root ::= "The answer is " [0-9]+ "."'),
    "choice (3)": ("choice", ["positive", "negative", "neutral"]),
}


def _constraint(kind: str, value):
    from pagoda.constraint import Constraint, ConstraintKind

    if kind == "choice":
        return Constraint.choice(value)
    return Constraint(ConstraintKind(kind), value)


# ---------------------------------------------------------------- 1. compile


def bench_compile() -> str:
    import xgrammar as xgr

    from pagoda.grammars import compile_constraint, tokenizer_info
    from pagoda.model_files import resolve_model
    from scheduler_svc.constraint_check import ConstraintChecker

    model_dir = resolve_model(None, weights=False)
    t0 = time.perf_counter()
    info = tokenizer_info(model_dir)
    info_s = time.perf_counter() - t0
    compiler = xgr.GrammarCompiler(info, max_threads=1)
    rows = []
    checker = ConstraintChecker(model_dir)
    t0 = time.perf_counter()
    asyncio.run(checker.check(_constraint("regex", "warm-up")))  # starts the child: not a compile figure
    start_s = time.perf_counter() - t0
    for name, (kind, value) in KINDS.items():
        constraint = _constraint(kind, value)
        times = []
        for _ in range(2):
            t0 = time.perf_counter()
            compile_constraint(compiler, constraint)
            times.append(time.perf_counter() - t0)
        checks = []
        for _ in range(2):
            t0 = time.perf_counter()
            asyncio.run(checker.check(constraint))
            checks.append(time.perf_counter() - t0)
        rows.append([name, 1e3 * times[0], 1e3 * times[1], 1e3 * checks[0], 1e3 * checks[1]])
    checker.close()
    table = format_table(["constraint", "compile ms", "cached ms", "check ms", "check cached ms"], rows)
    return (f"tokenizer info for xgrammar: {info_s:.2f} s once per process; the check's child process started "
            f"in {start_s:.1f} s (once)\n{table}")


# ---------------------------------------------------------------- 2. per step


def bench_step(batch_sizes: list[int], num_steps: int, context: int) -> str:
    import torch
    import xgrammar as xgr

    from executor_svc.model_runner import ModelRunner
    from executor_svc.structured_output import apply_token_bitmask
    from pagoda import wire
    from pagoda.model_files import resolve_model
    from pagoda.step import NewRequestData, SamplingParams, StepPlan

    torch.set_num_threads(1)
    constraint = _constraint("json_schema", json.dumps(LONG_ANSWER))
    blocks_each = -(-(context + num_steps * 2 + 2) // 16)
    runner = ModelRunner(resolve_model(None), device="cpu", num_kv_blocks=2 * max(batch_sizes) * blocks_each + 8)
    vocab = runner.vocab_size
    rows = []
    step_id = 0
    for batch in batch_sizes:
        groups = {}
        block = 1
        for label, c in (("none", None), ("json_schema", constraint)):
            new = []
            for i in range(batch):
                sampling = SamplingParams(temperature=0.0, constraint=c)
                prompt = [1000 + (7 * i + j) % 20000 for j in range(context)]
                new.append(NewRequestData(f"{label}-{batch}-{i}", prompt, context, sampling, list(range(block, block + blocks_each)), 0))
                block += blocks_each
            runner.execute(StepPlan(step_id, new_requests=new, num_scheduled_tokens={n.req_id: context for n in new}))
            step_id += 1
            groups[label] = [n.req_id for n in new]
        times = {label: [] for label in groups}
        for _ in range(num_steps):  # interleaved: the machine's load hits both alike
            for label, req_ids in groups.items():
                plan = StepPlan(step_id, num_scheduled_tokens={r: 1 for r in req_ids})
                t0 = time.perf_counter()
                runner.execute(plan)
                times[label].append(time.perf_counter() - t0)
                step_id += 1
        # the constraint's own parts at this batch, on the constrained requests' current state
        req_ids = groups["json_schema"]
        fill, apply = [], []
        logits = torch.randn(batch, vocab)
        for _ in range(20):
            t0 = time.perf_counter()
            mask = runner.structured.bitmask(req_ids)
            fill.append(time.perf_counter() - t0)
            t0 = time.perf_counter()
            apply_token_bitmask(logits, mask)
            apply.append(time.perf_counter() - t0)
        # vLLM's layout: the bitmask rides in the plan (bytes), serialized and parsed each step
        plan = wire.plan_to_proto(StepPlan(step_id, num_scheduled_tokens={r: 1 for r in req_ids}))
        bare = plan.SerializeToString()
        payload = mask.numpy().tobytes()
        ser = []
        for _ in range(20):
            t0 = time.perf_counter()
            data = bare + payload  # a bytes field holding the mask: one copy out
            parsed = torch.frombuffer(bytearray(data[len(bare):]), dtype=torch.int32).view(batch, -1)  # and one in
            ser.append(time.perf_counter() - t0)
        assert parsed.shape == mask.shape
        none_ms, json_ms = (1e3 * statistics.median(times[k]) for k in ("none", "json_schema"))
        rows.append([
            batch, none_ms, json_ms, f"{json_ms / none_ms:.3f}x", 1e3 * statistics.median(fill), 1e3 * statistics.median(apply),
            len(payload) / 1024, 1e3 * statistics.median(ser),
        ])
        runner.execute(StepPlan(step_id, finished_req_ids=[r for ids in groups.values() for r in ids]))
        step_id += 1
    del xgr
    headers = ["running", "step ms (none)", "step ms (json_schema)", "ratio", "fill bitmask ms", "mask logits ms",
               "bitmask KiB/step", "bitmask wire copy ms"]
    return (f"decode steps of the default model, {context}-token contexts, median of {num_steps} interleaved steps each; "
            f"the last two columns are what shipping the bitmask in the plan adds (vLLM's layout)\n{format_table(headers, rows)}")


# ---------------------------------------------------------------- 3. load


def bench_load(args) -> str:
    from bench.loadgen import make_request, run_pagoda, service_target
    from pagoda import wire

    workload = workload_from_args(args)
    specs = workload.build(None)
    constraint = _constraint("json_schema", json.dumps(LONG_ANSWER))

    def constrained(spec):
        req = make_request(spec)
        req.stopping.ignore_eos = False  # refused with a constraint; the schema's string outlives max_tokens
        wire.constraint_to_proto(constraint, req.constraint)
        return req

    runs: dict[str, list[dict]] = {"unconstrained": [], "json_schema": []}
    args.spawn, args.target = True, None
    with service_target(args) as target:
        kinds = [("unconstrained", make_request), ("json_schema", constrained)]
        for round_ in range(args.rounds):
            for label, make in kinds if round_ % 2 == 0 else kinds[::-1]:  # A B B A: drift hits both alike
                result = run_pagoda(target, specs, workload.max_concurrency, warmup=2 if round_ == 0 else 0, make=make)
                runs[label].append(result["summary"])
                print(f"  round {round_ + 1} {label}: {result['summary']['output_tokens_per_s']:.1f} output tokens/s", flush=True)
    sync = None
    if args.compare_sync:
        with service_target(args, scheduler_args=f"{args.scheduler_args} --no-async-scheduling") as target:
            sync = run_pagoda(target, specs, workload.max_concurrency, warmup=2)["summary"]
            print(f"  no async scheduling, unconstrained: {sync['output_tokens_per_s']:.1f} output tokens/s", flush=True)
    best = {label: max(summaries, key=lambda s: s["output_tokens_per_s"]) for label, summaries in runs.items()}
    columns = {"unconstrained": best["unconstrained"], "json_schema": best["json_schema"]}
    ratios = [j["output_tokens_per_s"] / u["output_tokens_per_s"] for u, j in zip(runs["unconstrained"], runs["json_schema"])]
    if sync is not None:
        columns["unconstrained, no async"] = sync
    lines = [
        f"workload  {workload.describe()} (the constrained runs: no ignore_eos, schema {json.dumps(LONG_ANSWER)})",
        f"best of {args.rounds} interleaved rounds each; json_schema / unconstrained output tokens/s per round: "
        + ", ".join(f"{r:.3f}" for r in ratios),
        metrics_table(columns, ratio_of=("json_schema", "unconstrained")),
    ]
    if sync is not None:
        lines.append(f"async scheduling off / on (unconstrained): {sync['output_tokens_per_s'] / best['unconstrained']['output_tokens_per_s']:.3f}")
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--parts", default="compile,step,load", help="comma-separated: compile, step, load")
    parser.add_argument("--batch-sizes", default="1,64")
    parser.add_argument("--num-steps", type=int, default=12, help="decode steps timed per batch size and kind")
    parser.add_argument("--context", type=int, default=64, help="tokens of each request before its decode steps")
    parser.add_argument("--rounds", type=int, default=2, help="load: interleaved rounds of each kind")
    parser.add_argument("--no-compare-sync", dest="compare_sync", action="store_false",
                        help="load: skip the run without async scheduling")
    parser.add_argument("--scheduler-args", default="--no-enable-prefix-caching",
                        help="load: the service's scheduler flags (default: prefix caching off, see part 3)")
    parser.add_argument("--executor-args", default="")
    parser.add_argument("--num-executors", type=int, default=1)
    parser.add_argument("--model", default=None)
    add_workload_flags(parser, num_requests=48)
    args = parser.parse_args()
    parts = args.parts.split(",")
    print(f"machine   {machine_line(machine_info())}\nmodel     SmolLM2-135M-Instruct (GGUF Q4_1), xgrammar's default options\n", flush=True)
    if "compile" in parts:
        print("== compile ==\n" + bench_compile() + "\n", flush=True)
    if "step" in parts:
        print("== per step ==\n" + bench_step([int(b) for b in args.batch_sizes.split(",")], args.num_steps, args.context) + "\n", flush=True)
    if "load" in parts:
        print("== load ==\n" + bench_load(args) + "\n", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
