"""Where the time goes: py-spy samples the executor and the scheduler while a workload runs.

    python bench/profile_step_loop.py                      # the aim's workload (compare.py's), spawned service
    python bench/profile_step_loop.py --num-requests 16 --prompt-len 64:128 --output-len 32   # ~1 min

Starts Pagoda (scheduler + 1 CPU executor), attaches `py-spy record` (raw stacks, every thread,
idle ones included, without pausing the processes) to both, runs the workload through gRPC,
and sorts every sample of the executor's main thread into one stage of the step:

    waiting for a plan       the executor has nothing to do (the scheduler's turn, sockets)
    decode wire              protobuf <-> StepPlan/StepResult
    inputs                   update_states + prepare_inputs (index tensors, block tables)
    linear (matmuls)         the packed q/k/v, o, gate/up, down projections
    attention: ...           decode kernel / SDPA (prefill chunks, fallback) / KV write / layout
    elementwise ops          RMSNorm, residual add, rotary, SiLU-and-mul, embedding
    LM head + final norm     compute_logits on the sampled rows
    sampling                 sampler + appending tokens

The decode kernel also runs on a helper thread (its share of the sequences); those samples
are counted apart. The scheduler's samples give its busy share. Needs py-spy (`pip install
py-spy`; it reads the processes' memory: root, or ptrace allowed). Writes the table to
stdout and the raw stacks beside the JSON in bench/out/.
"""

from __future__ import annotations

import argparse
import collections
import shlex
import shutil
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repository root, when run as a script

from bench.common import (  # noqa: E402
    OUT_DIR,
    add_workload_flags,
    exit_on_sigterm,
    format_table,
    machine_info,
    machine_line,
    metrics_table,
    timestamp,
    workload_from_args,
    write_json,
)
from bench.loadgen import run_pagoda, warm_up  # noqa: E402

# (stage, function names); a frame "function (file:line)" matches a name equal to it or
# ending in "." + name. The stages of CALLERS win wherever they appear in the stack (the LM
# head is a linear layer called from compute_logits); otherwise the frame nearest the leaf
# that matches decides, so attention inside a layer wins over the layer.
CALLERS = ("waiting for a plan", "decode wire", "LM head + final norm", "sampling", "inputs")
STAGES: list[tuple[str, tuple[str, ...]]] = [
    ("waiting for a plan", ("Worker._recv", "Poller.poll", "Socket.recv")),
    ("decode wire", ("plan_from_proto", "result_to_proto", "Worker._send")),
    ("attention: decode kernel", ("CpuDecodeKernel.__call__",)),
    ("attention: KV write", ("TorchBackend._write_kv",)),
    ("attention: layout", ("_build_layout", "TorchBackend._layout_for")),
    ("attention: SDPA", ("TorchBackend._attend", "_gather", "scaled_dot_product_attention")),
    ("attention: other", ("TorchBackend.forward", "TritonBackend.forward")),
    ("linear (matmuls)", ("PackedLinear.forward", "Linear.forward")),
    ("elementwise ops", ("rms_norm", "add_rms_norm", "apply_rotary", "rotate", "silu_and_mul", "silu")),
    ("LM head + final norm", ("compute_logits",)),
    ("sampling", ("ModelRunner.sample", "Sampler.__call__", "finish_step")),
    ("inputs", ("prepare_inputs", "update_states")),
    ("decoder (other)", ("DecoderModel.forward", "DecoderLayer.forward")),
]
OTHER = "other"


def _matches(frame: str, keys: tuple[str, ...]) -> bool:
    name = frame.split(" (", 1)[0]
    return any(name == k or name.endswith("." + k) for k in keys)


def classify(frames: list[str]) -> str:
    """The stage of one sample: `frames` from the root to the leaf."""
    for stage, keys in STAGES:
        if stage in CALLERS and any(_matches(f, keys) for f in frames):
            return stage
    for frame in reversed(frames):
        for stage, keys in STAGES:
            if _matches(frame, keys):
                return stage
    return OTHER


def parse_raw(path: Path) -> dict[str, list[tuple[list[str], int]]]:
    """py-spy raw output with --threads: {"thread (tid): name": [(frames root->leaf, count)]}."""
    threads: dict[str, list[tuple[list[str], int]]] = collections.defaultdict(list)
    if not path.exists():
        return threads
    for line in path.read_text().splitlines():
        if line.strip():
            stack, count = line.rsplit(" ", 1)
            thread, *frames = stack.split(";")
            threads[thread].append((frames, int(count)))
    return threads


def _thread(threads, name: str) -> list[tuple[list[str], int]]:
    return [x for label, stacks in threads.items() if label.endswith(": " + name) for x in stacks]


def executor_table(threads) -> tuple[list[list], dict]:
    """Stages of the executor's main thread, and how often the decode kernel's helper threads ran."""
    stages: collections.Counter = collections.Counter()
    for frames, n in _thread(threads, "MainThread"):
        stages[classify(frames)] += n
    # helper threads: busy while a submitted call runs (_WorkItem.run), idle in the queue's get
    helpers = [x for label, stacks in threads.items() if "decode-attn" in label for x in stacks]
    helper_busy = sum(n for frames, n in helpers if frames and frames[-1].startswith("_WorkItem.run"))
    total = sum(stages.values())
    busy = total - stages["waiting for a plan"]
    order = [s for s, _ in STAGES] + [OTHER]
    rows = [
        [s, stages[s], 100 * stages[s] / max(total, 1), "" if s == "waiting for a plan" else 100 * stages[s] / max(busy, 1)]
        for s in order
        if stages[s]
    ]
    rows.append(["total (main thread)", total, 100.0, ""])
    return rows, {"stages": dict(stages), "samples": total, "busy": busy, "decode_kernel_helper_samples": helper_busy}


def scheduler_busy(threads) -> tuple[int, int]:
    """(samples the scheduler's event loop thread was running code, all its samples)."""
    stacks = _thread(threads, "MainThread")
    idle = ("select (", "poll (", "epoll", "EpollSelector.select", "_PollLikeSelector.select")
    busy = sum(n for frames, n in stacks if frames and not frames[-1].startswith(idle))
    return busy, sum(n for _, n in stacks)


def py_spy_record(py_spy: str, pid: int, out: Path, rate: int) -> subprocess.Popen:
    return subprocess.Popen(
        [py_spy, "record", "--pid", str(pid), "--rate", str(rate), "--format", "raw", "--threads", "--idle",
         "--nonblocking", "--output", str(out)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_workload_flags(parser)
    parser.add_argument("--model", default=None, help="HF directory or .gguf (default: SmolLM2-135M-Instruct)")
    parser.add_argument("--scheduler-args", default="", help="extra scheduler flags")
    parser.add_argument("--executor-args", default="", help="extra executor flags")
    parser.add_argument("--rate", type=int, default=100, help="py-spy samples per second")
    args = parser.parse_args()
    exit_on_sigterm()
    py_spy = shutil.which("py-spy") or str(Path(sys.executable).with_name("py-spy"))
    if not Path(py_spy).exists():
        parser.error("needs py-spy: pip install py-spy")

    from tests.service.harness import Service

    workload = workload_from_args(args)
    specs = workload.build(args.model)
    machine = machine_info()
    stem = OUT_DIR / f"profile-{timestamp()}"
    OUT_DIR.mkdir(parents=True, exist_ok=True)
    raw = {"executor": stem.with_name(stem.name + "-executor.txt"), "scheduler": stem.with_name(stem.name + "-scheduler.txt")}
    with Service(args.model, shlex.split(args.scheduler_args), shlex.split(args.executor_args), 1) as svc:
        target = f"127.0.0.1:{svc.port}"
        warm_up(target)
        pids = {"executor": svc.executors[0].pid, "scheduler": svc.scheduler.pid}
        spies = {name: py_spy_record(py_spy, pid, raw[name], args.rate) for name, pid in pids.items()}
        time.sleep(1.0)  # py-spy attached
        result = run_pagoda(target, specs, workload.max_concurrency, warmup=0, timeout_s=1800.0)
        for spy in spies.values():
            spy.send_signal(2)  # SIGINT: py-spy writes its output and exits
        for name, spy in spies.items():
            try:
                _, err = spy.communicate(timeout=60)
            except subprocess.TimeoutExpired:
                spy.kill()
                err = "timed out"
            if not raw[name].exists():
                sys.exit(f"py-spy wrote nothing for the {name} (pid {pids[name]}): {err.strip()[-500:]}")

    rows, ex = executor_table(parse_raw(raw["executor"]))
    sched_busy, sched_samples = scheduler_busy(parse_raw(raw["scheduler"]))

    print()
    print(f"machine   {machine_line(machine)}")
    print(f"workload  {workload.describe()}")
    print()
    print(metrics_table({"pagoda": result["summary"]}))
    print()
    print(f"executor main thread, {ex.get('samples', 0)} samples at {args.rate}/s (py-spy, idle included):")
    print(format_table(["stage", "samples", "% of wall", "% of busy"], rows))
    helper = ex.get("decode_kernel_helper_samples", 0)
    print(f"decode kernel on its helper thread(s): {helper} samples (their share of the sequences, beside the main thread)")
    print(f"scheduler event loop thread: running code in {sched_busy} of {sched_samples} samples "
          f"({100 * sched_busy / max(sched_samples, 1):.1f} %), the rest waiting in its selector")
    out = write_json(
        stem.with_suffix(".json"),
        {"machine": machine, "workload": workload, "summary": result["summary"], "executor": ex,
         "scheduler": {"busy_samples": sched_busy, "samples": sched_samples}, "raw": {k: str(v) for k, v in raw.items()}},
    )
    print(f"\nJSON: {out}; raw stacks: {raw['executor']}, {raw['scheduler']}")


if __name__ == "__main__":
    main()
