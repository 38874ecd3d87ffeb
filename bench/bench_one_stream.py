"""One chat stream and 4 streams, side by side: Pagoda (GGUF blocks kept), Pagoda with
`--gguf-int8-activations` (llama.cpp's int8 x for Q5_0 / Q4_K / Q6_K at one row), Pagoda (float32),
transformers batch 1, and llama.cpp's server on the same GGUF file.

    nice -n 10 .venv/bin/python bench/bench_one_stream.py [--llama-server PATH] [--rounds 1] [--model FILE.gguf ...]

Every request: the same 64-token prompt, 256 output tokens, greedy, ignore_eos. Reported:
output tokens/s of one stream (all 256 tokens over the request's wall time, first token
included) and of 4 concurrent streams (4 x 256 over the wall time of all four), plus the
decode rate alone (tokens after the first over the time after the first). Systems run one
after another in one process run, each after a warm-up request; with `--rounds N` each is
measured N times (interleaved) and the best is kept, since the machine is shared and noisy.
`--model` (repeatable; "default" is the default model) measures each GGUF file in turn, every
system on the same file; the prompt is the default tokenizer's ids (a file whose vocabulary
holds them, e.g. one made by bench/random_family_gguf.py with that tokenizer).

llama.cpp is a benchmark peer, not a dependency: build `llama-server` from the
`llama-cpp-python` source package, which vendors llama.cpp (see bench/README.md), and pass
its path (or set LLAMA_SERVER). It runs with the same thread count as the executor.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from bench.common import format_table, machine_info, machine_line  # noqa: E402
from pagoda import model_files  # noqa: E402
from tests.service.harness import Service, free_port, greedy_request  # noqa: E402

PROMPT_TEXT = (
    "You are a helpful assistant. Please write a long, detailed story about a lighthouse keeper who "
    "discovers a message in a bottle, describing the sea, the weather, the village and the people in it, "
    "and what he decides to do next."
)
PROMPT_LEN, OUTPUT_LEN, STREAMS = 64, 256, 4


def prompt_ids() -> list[int]:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(model_files.resolve_model(None, weights=False)))
    ids = tok(PROMPT_TEXT)["input_ids"]
    return (ids * (PROMPT_LEN // len(ids) + 1))[:PROMPT_LEN]


class Timing:
    """Wall time of a request and of its first token."""

    def __init__(self, tokens: int, total_s: float, first_s: float) -> None:
        self.tokens, self.total_s, self.first_s = tokens, total_s, first_s


def _rates(timings: list[Timing], wall_s: float) -> tuple[float, float]:
    total = sum(t.tokens for t in timings) / wall_s
    decode = sum((t.tokens - 1) / (t.total_s - t.first_s) for t in timings)
    return total, decode


# ---- the systems -------------------------------------------------------------------------

def gguf_file(model: str | None) -> Path:
    return model_files.default_gguf_path() if model is None else Path(model)


class Pagoda:
    def __init__(self, quantization: str, threads: int, scheduler_args: list[str], model: str | None = None,
                 executor_args: tuple[str, ...] = ()) -> None:
        self.svc = Service(model=model, scheduler_args=scheduler_args,
                           executor_args=["--quantization", quantization, "--num-threads", str(threads), *executor_args])

    def __enter__(self):
        self.svc.start()
        return self

    def __exit__(self, *exc):
        self.svc.stop()

    def info(self) -> str:
        return f"{self.svc.server_info().executors[0].weight_bytes / 2**20:.0f} MiB weights"

    def one(self, ids: list[int]) -> Timing:
        req = greedy_request(prompt_ids=ids, max_tokens=OUTPUT_LEN, ignore_eos=True)
        t0, first, n = time.perf_counter(), None, 0
        for response in self.svc.stub.Generate(req, timeout=600):
            for out in response.outputs:
                if out.token_ids and first is None:
                    first = time.perf_counter() - t0
                n += len(out.token_ids)
        return Timing(n, time.perf_counter() - t0, first)


class LlamaCpp:
    def __init__(self, binary: str, threads: int, model: str | None = None) -> None:
        self.port = free_port()
        self.cmd = [
            binary, "-m", str(gguf_file(model)), "--host", "127.0.0.1", "--port", str(self.port),
            "-t", str(threads), "-tb", str(threads), "-np", str(STREAMS), "-c", str(STREAMS * 1024), "--no-webui",
        ]

    def __enter__(self):
        self.log = open("/tmp/bench-llama-server.log", "w")
        self.proc = subprocess.Popen(self.cmd, stdout=self.log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{self.port}/health", timeout=2) as r:
                    if r.status == 200:
                        return self
            except OSError:
                time.sleep(0.5)
            if self.proc.poll() is not None:  # e.g. SIGILL: a -march=native build using instructions a VM hides
                break
        self.proc.kill()
        raise TimeoutError(f"llama-server did not start (exit {self.proc.poll()}): see /tmp/bench-llama-server.log")

    def __exit__(self, *exc):
        self.proc.terminate()
        self.proc.wait(timeout=20)
        self.log.close()

    def info(self) -> str:
        return "weights in the GGUF file's blocks"

    def one(self, ids: list[int]) -> Timing:
        body = {"prompt": ids, "n_predict": OUTPUT_LEN, "temperature": 0.0, "top_k": 1, "ignore_eos": True,
                "cache_prompt": False, "stream": True}
        req = urllib.request.Request(
            f"http://127.0.0.1:{self.port}/completion", data=json.dumps(body).encode(), headers={"Content-Type": "application/json"}
        )
        t0, first, n = time.perf_counter(), None, 0
        with urllib.request.urlopen(req, timeout=600) as r:
            for line in r:
                if not line.startswith(b"data: "):
                    continue
                event = json.loads(line[6:])
                if event.get("content") or event.get("tokens"):
                    n += 1
                    if first is None:
                        first = time.perf_counter() - t0
                if event.get("stop"):
                    n = event.get("tokens_predicted", n)
                    break
        return Timing(n, time.perf_counter() - t0, first)


class Transformers:
    """`generate`, batch 1, float32, the model dequantized from the same file."""

    def __init__(self, threads: int, model: str | None = None) -> None:
        from transformers import AutoModelForCausalLM

        torch.set_num_threads(threads)
        model_dir = str(model_files.resolve_model(model))
        self.model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        pass

    def info(self) -> str:
        return "float32"

    def one(self, ids: list[int]) -> Timing:
        from transformers import TextStreamer

        times: list[float] = []

        class Clock(TextStreamer):
            def __init__(self):
                pass

            def put(self, value):
                times.append(time.perf_counter())

            def end(self):
                pass

        t0 = time.perf_counter()
        with torch.inference_mode():
            out = self.model.generate(
                torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long), do_sample=False,
                max_new_tokens=OUTPUT_LEN, min_new_tokens=OUTPUT_LEN, streamer=Clock(),
            )
        n = out.shape[1] - len(ids)
        return Timing(n, time.perf_counter() - t0, times[1] - t0)  # times[0]: the prompt itself


class ForwardAlone:
    """The step's floor: the executor's own ModelRunner (GGUF blocks, same threads) in this process,
    one request decoded by hand-built plans, no scheduler and no sockets. `one()` reports the time of
    `model(...) + compute_logits` alone per token; `execute_s` keeps each whole `execute` beside it."""

    def __init__(self, threads: int, model: str | None = None) -> None:
        from executor_svc.model_runner import ModelRunner

        self.runner = ModelRunner(model_files.resolve_model(model, weights=False), device="cpu", quantization="gguf",
                                  num_kv_blocks=64, num_threads=threads)
        self.forward_s: list[float] = []
        self.execute_s: list[float] = []

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        pass

    def info(self) -> str:
        med = lambda xs: 1e3 * sorted(xs)[len(xs) // 2]  # noqa: E731
        return (f"{self.runner.weight_bytes / 2**20:.0f} MiB weights; median decode step: forward {med(self.forward_s):.2f} ms, "
                f"whole execute {med(self.execute_s):.2f} ms")

    def one(self, ids: list[int]) -> Timing:
        from pagoda.step import NewRequestData, SamplingParams, StepPlan

        runner, model = self.runner, self.runner.model
        forward = []
        original = model.forward

        def timed(*a, **k):
            t = time.perf_counter()
            out = original(*a, **k)
            forward.append(time.perf_counter() - t)
            return out

        compute_logits = model.compute_logits

        def timed_logits(*a, **k):
            t = time.perf_counter()
            out = compute_logits(*a, **k)
            forward[-1] += time.perf_counter() - t
            return out

        model.forward, model.compute_logits = timed, timed_logits
        blocks = list(range(1, -(-(len(ids) + OUTPUT_LEN) // runner.block_size) + 1))
        new = NewRequestData("fwd", list(ids), len(ids), SamplingParams(), blocks, 0)
        executes = []
        try:
            plan = StepPlan(step_id=0, new_requests=[new], num_scheduled_tokens={"fwd": len(ids)})
            for step in range(OUTPUT_LEN):
                t = time.perf_counter()
                runner.execute(plan)
                executes.append(time.perf_counter() - t)
                plan = StepPlan(step_id=step + 1, num_scheduled_tokens={"fwd": 1})
            runner.execute(StepPlan(step_id=OUTPUT_LEN + 1, finished_req_ids=["fwd"]))
        finally:
            del model.forward, model.compute_logits
        self.forward_s, self.execute_s = forward[1:], executes[1:]  # decode steps (the first: the prompt)
        return Timing(OUTPUT_LEN, sum(forward), forward[0])


def measure(system, ids: list[int], streams: bool) -> dict:
    system.one(ids[:16])  # warm-up
    t0 = time.perf_counter()
    one = system.one(ids)
    row = {"one_stream": _rates([one], time.perf_counter() - t0)}
    if streams:
        t0 = time.perf_counter()
        with ThreadPoolExecutor(STREAMS) as pool:
            timings = list(pool.map(system.one, [ids] * STREAMS))
        row["streams"] = _rates(timings, time.perf_counter() - t0)
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--llama-server", default=os.environ.get("LLAMA_SERVER"), help="path of llama.cpp's llama-server")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument("--model", action="append", help='a GGUF file or "default" (repeatable)')
    parser.add_argument("--only", default="", help="comma-separated subset of: gguf,gguf-int8,fp32,hf,forward,llama.cpp")
    parser.add_argument("--scheduler-args", default="", help='extra scheduler flags, e.g. "--no-async-scheduling"')
    args = parser.parse_args()
    sched = args.scheduler_args.split()
    ids = prompt_ids()
    models = [None if m == "default" else m for m in (args.model or ["default"])]
    only = set(filter(None, args.only.split(",")))
    results: dict[tuple[str, str], dict] = {}  # (file name, system) -> best row
    for _ in range(args.rounds):
        for model in models:
            for name, (key, make, streams) in systems(args, sched, model).items():
                if only and key not in only:
                    continue
                try:
                    with make() as system:
                        row = measure(system, ids, streams)
                        row["info"] = system.info()
                except (OSError, TimeoutError) as e:  # a peer that does not start here: say so, measure the rest
                    print(f"{name}: not measured ({e})", flush=True)
                    continue
                print(f"{gguf_file(model).name} {name}: one stream {row['one_stream'][0]:.1f} tok/s; "
                      f"{STREAMS} streams {row.get('streams', ('—',))[0]}", flush=True)
                best = results.setdefault((gguf_file(model).name, name), row)
                for k in ("one_stream", "streams"):
                    if k in row and row[k][0] > best[k][0]:
                        best[k] = row[k]
    print(machine_line(machine_info()))
    print(f"prompt {PROMPT_LEN} tokens, {OUTPUT_LEN} output tokens, greedy, ignore_eos; {args.threads} threads each; "
          f"best of {args.rounds} round(s); scheduler flags: {args.scheduler_args or '(defaults)'}")
    rows = []
    for (file, name), r in results.items():
        base = results.get((file, "llama.cpp server"), {})
        one_total, one_decode = r["one_stream"]
        many = r.get("streams")
        ratio = lambda ours, k: f"{ours / base[k][0]:.2f}x" if base.get(k) and ours else "—"  # noqa: E731
        rows.append([
            file, name, f"{one_total:.1f}", f"{one_decode:.1f}", f"{many[0]:.1f}" if many else "—",
            ratio(one_total, "one_stream"), ratio(many[0] if many else None, "streams"), r["info"],
        ])
    print(format_table(["file", "system", "1 stream tok/s", "1 stream decode tok/s", f"{STREAMS} streams tok/s",
                        "1 stream vs llama.cpp", f"{STREAMS} streams vs llama.cpp", "weights"], rows))
    for file in dict.fromkeys(f for f, _ in results):
        floor = results.get((file, "forward pass alone (GGUF)"), {}).get("one_stream", (None, None))[1]
        served = results.get((file, "Pagoda (GGUF blocks)"), {}).get("one_stream", (None, None))[1]
        if floor and served:
            print(f"{file}: step overhead, one stream: a served decode step takes {floor / served:.3f}x the "
                  f"forward pass alone ({1e3 / served:.2f} vs {1e3 / floor:.2f} ms per token)")


def systems(args, sched: list[str], model: str | None) -> dict:
    """name -> (--only key, a function making the system, whether 4 streams are measured too)."""
    found = {
        "Pagoda (GGUF blocks)": ("gguf", lambda: Pagoda("gguf", args.threads, sched, model), True),
        "Pagoda (GGUF, int8 x)": ("gguf-int8", lambda: Pagoda("gguf", args.threads, sched, model,
                                                              ("--gguf-int8-activations",)), True),
        "Pagoda (float32)": ("fp32", lambda: Pagoda("none", args.threads, sched, model), True),
        "transformers batch 1": ("hf", lambda: Transformers(args.threads, model), False),
        "forward pass alone (GGUF)": ("forward", lambda: ForwardAlone(args.threads, model), False),
    }
    if args.llama_server:
        found["llama.cpp server"] = ("llama.cpp", lambda: LlamaCpp(args.llama_server, args.threads, model), True)
    return found


if __name__ == "__main__":
    main()
