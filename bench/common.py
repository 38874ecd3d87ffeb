"""Shared pieces of the benchmark scripts: workloads, per-request records, metrics, tables, plots.

A workload is a list of `RequestSpec`s (prompt token ids, exact output length, arrival time),
built from length distributions and a seed, so Pagoda and the transformers baseline run the
same requests. A run of either yields one `RequestRecord` per request: when it was sent,
when each output token arrived, and when the request's result was complete. `summarize` turns
records into the numbers every script prints:

    throughput   requests/s, output tokens/s, total (prompt + output) tokens/s over the run
    TTFT         first output token - request sent
    ITL          gap between consecutive token-bearing messages of one request, pooled
    TPOT         (last token - first token) / (output tokens - 1), per request
    E2E          result complete - request sent
"""

from __future__ import annotations

import json
import os
import platform
import random
import signal
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

OUT_DIR = ROOT / "bench" / "out"
SAFE_TOKEN_IDS = (1000, 40000)  # random prompt tokens: clear of special and byte tokens


# ---------------------------------------------------------------- workloads


@dataclass(frozen=True)
class LengthDist:
    """A length distribution written as text: `128` fixed, `32:384` uniform (inclusive),
    `16,64,256` a uniform choice from a list, `@file` one length per line, used in order."""

    spec: str

    def sample(self, rng: random.Random, n: int) -> list[int]:
        spec = self.spec.strip()
        if spec.startswith("@"):
            values = [int(line) for line in Path(spec[1:]).read_text().split() if line.strip()]
            return [values[i % len(values)] for i in range(n)]
        if ":" in spec:
            low, high = (int(x) for x in spec.split(":"))
            if not 0 < low <= high:
                raise ValueError(f"length range {spec!r}: need 0 < low <= high")
            return [rng.randint(low, high) for _ in range(n)]
        if "," in spec:
            values = [int(x) for x in spec.split(",")]
            return [rng.choice(values) for _ in range(n)]
        return [int(spec)] * n

    def __str__(self) -> str:
        spec = self.spec
        return f"U[{spec.replace(':', '..')}]" if ":" in spec else spec


@dataclass(frozen=True)
class RequestSpec:
    index: int
    prompt_ids: list[int]
    max_tokens: int  # the exact output length: requests ignore EOS
    arrival_s: float  # offset from the start of the run; 0 for all at once


@dataclass(frozen=True)
class Workload:
    num_requests: int
    prompt_len: LengthDist
    output_len: LengthDist
    seed: int = 0
    max_concurrency: int | None = None  # None: no limit
    request_rate: float | None = None  # requests/s, Poisson arrivals; None: all at once
    prompt_source: str = "random"  # "random" token ids, or a path to a text file

    def describe(self) -> str:
        arrival = f"Poisson {self.request_rate}/s" if self.request_rate else "all at once"
        limit = f", concurrency <= {self.max_concurrency}" if self.max_concurrency else ""
        source = "random token ids" if self.prompt_source == "random" else f"text of {Path(self.prompt_source).name}"
        return (
            f"{self.num_requests} requests, prompt {self.prompt_len} tokens ({source}), output {self.output_len} "
            f"tokens (ignore_eos, greedy), {arrival}{limit}, seed {self.seed}"
        )

    def build(self, model: str | None = None) -> list[RequestSpec]:
        rng = random.Random(self.seed)
        prompt_lens = self.prompt_len.sample(rng, self.num_requests)
        output_lens = self.output_len.sample(rng, self.num_requests)
        arrivals = [0.0] * self.num_requests
        if self.request_rate:
            t = 0.0
            for i in range(self.num_requests):
                t += rng.expovariate(self.request_rate)
                arrivals[i] = t
        if self.prompt_source == "random":
            low, high = SAFE_TOKEN_IDS
            prompts = [[rng.randint(low, high) for _ in range(n)] for n in prompt_lens]
        else:
            prompts = _text_prompts(self.prompt_source, prompt_lens, rng, model)
        return [
            RequestSpec(i, prompts[i], output_lens[i], arrivals[i]) for i in range(self.num_requests)
        ]


def _text_prompts(path: str, lengths: list[int], rng: random.Random, model: str | None) -> list[list[int]]:
    """Slices of the text's token ids at random offsets (the text repeats when it is short)."""
    from transformers import AutoTokenizer

    from pagoda.model_files import resolve_model

    tokenizer = AutoTokenizer.from_pretrained(str(resolve_model(model)))
    ids = tokenizer.encode(Path(path).read_text(), add_special_tokens=False)
    if not ids:
        raise ValueError(f"{path}: no text")
    while len(ids) < 2 * max(lengths):
        ids = ids + ids
    prompts = []
    for n in lengths:
        start = rng.randrange(0, len(ids) - n)
        prompts.append(ids[start : start + n])
    return prompts


def add_workload_flags(parser, *, num_requests=64, prompt_len="32:384", output_len="16:160") -> None:
    g = parser.add_argument_group("workload")
    g.add_argument("--num-requests", type=int, default=num_requests)
    g.add_argument("--prompt-len", default=prompt_len, help="128 | 32:384 (uniform) | 16,64,256 (choice) | @file")
    g.add_argument("--output-len", default=output_len, help="same forms as --prompt-len; exact (ignore_eos)")
    g.add_argument("--max-concurrency", type=int, default=None, help="requests in flight at most (default: no limit)")
    g.add_argument("--request-rate", type=float, default=None, help="Poisson arrivals per second (default: all at once)")
    g.add_argument("--prompt-source", default="random", help="'random' token ids or a text file to slice prompts from")
    g.add_argument("--seed", type=int, default=0)


def workload_from_args(args) -> Workload:
    return Workload(
        num_requests=args.num_requests,
        prompt_len=LengthDist(args.prompt_len),
        output_len=LengthDist(args.output_len),
        seed=args.seed,
        max_concurrency=args.max_concurrency,
        request_rate=args.request_rate,
        prompt_source=args.prompt_source,
    )


# ---------------------------------------------------------------- records and metrics


@dataclass
class RequestRecord:
    index: int
    num_prompt_tokens: int
    max_tokens: int
    start: float = 0.0  # request sent (perf_counter seconds)
    end: float = 0.0  # result complete
    token_times: list[float] = field(default_factory=list)  # one per token-bearing message
    token_counts: list[int] = field(default_factory=list)  # tokens in that message
    token_ids: list[int] = field(default_factory=list)
    error: str = ""

    @property
    def num_output_tokens(self) -> int:
        return sum(self.token_counts)

    def ttft(self) -> float | None:
        return self.token_times[0] - self.start if self.token_times else None

    def itls(self) -> list[float]:
        return [b - a for a, b in zip(self.token_times, self.token_times[1:])]

    def tpot(self) -> float | None:
        n = self.num_output_tokens
        return (self.token_times[-1] - self.token_times[0]) / (n - 1) if n > 1 else None


def percentile(values: list[float], q: float) -> float:
    """Linear interpolation between closest ranks (numpy's default); nan when empty."""
    if not values:
        return float("nan")
    xs = sorted(values)
    pos = (len(xs) - 1) * q / 100
    lo = int(pos)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


def summarize(records: list[RequestRecord], t0: float, t_end: float) -> dict:
    ok = [r for r in records if not r.error]
    duration = t_end - t0
    out_tokens = sum(r.num_output_tokens for r in ok)
    prompt_tokens = sum(r.num_prompt_tokens for r in ok)
    ttft = [r.ttft() for r in ok if r.ttft() is not None]
    itl = [x for r in ok for x in r.itls()]
    tpot = [r.tpot() for r in ok if r.tpot() is not None]
    e2e = [r.end - r.start for r in ok]
    summary = {
        "num_requests": len(records),
        "num_errors": len(records) - len(ok),
        "num_wrong_length": sum(1 for r in ok if r.num_output_tokens != r.max_tokens),
        "duration_s": duration,
        "prompt_tokens": prompt_tokens,
        "output_tokens": out_tokens,
        "requests_per_s": len(ok) / duration,
        "output_tokens_per_s": out_tokens / duration,
        "total_tokens_per_s": (out_tokens + prompt_tokens) / duration,
    }
    for name, values in (("ttft", ttft), ("itl", itl), ("tpot", tpot), ("e2e", e2e)):
        summary[f"{name}_mean_ms"] = 1000 * sum(values) / len(values) if values else float("nan")
        for q in (50, 90, 99):
            summary[f"{name}_p{q}_ms"] = 1000 * percentile(values, q)
        summary[f"{name}_max_ms"] = 1000 * max(values) if values else float("nan")
    return summary


def throughput_over_time(records: list[RequestRecord], t0: float, t_end: float, bins: int = 40):
    """(bin start s, output tokens/s) pairs over the run."""
    width = max((t_end - t0) / bins, 0.5)
    counts = [0] * (int((t_end - t0) / width) + 1)
    for r in records:
        for t, n in zip(r.token_times, r.token_counts):
            counts[min(int((t - t0) / width), len(counts) - 1)] += n
    return [(i * width, c / width) for i, c in enumerate(counts)]


# ---------------------------------------------------------------- machine and output


def machine_info() -> dict:
    cpu, flags = platform.processor() or platform.machine(), set()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
            elif line.startswith("flags"):
                flags = set(line.split(":", 1)[1].split())
                break
    except OSError:
        pass
    isa = [name for flag, name in (("avx512f", "AVX-512"), ("avx512_bf16", "AVX512-BF16"), ("amx_tile", "AMX"))
           if flag in flags] or (["AVX2"] if "avx2" in flags else [])
    if isa:
        cpu = f"{cpu} ({', '.join(isa)})"
    info = {
        "cpu": cpu,
        "cores": os.cpu_count(),
        "cores_usable": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count(),
        "python": platform.python_version(),
        "load_avg_1m": os.getloadavg()[0],
        "omp_wait_policy": os.environ.get("OMP_WAIT_POLICY", "(default)"),
    }
    try:
        import torch

        info["torch"] = torch.__version__
        info["torch_threads"] = torch.get_num_threads()
        if torch.cuda.is_available():
            info["gpu"] = torch.cuda.get_device_name(0)
    except ImportError:
        pass
    return info


class RunQueueSampler:
    """Samples the number of runnable tasks (/proc/loadavg) twice a second while a run goes on:
    on a machine shared with others, a mean well above the run's own processes means contention."""

    def __init__(self, period_s: float = 0.5) -> None:
        import threading

        self.samples: list[int] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, args=(period_s,), daemon=True)

    def _loop(self, period_s: float) -> None:
        while not self._stop.wait(period_s):
            try:
                running = int(Path("/proc/loadavg").read_text().split()[3].split("/")[0])
            except (OSError, ValueError, IndexError):
                return
            self.samples.append(running - 1)  # less this sampler

    def mean(self) -> float:
        return sum(self.samples) / len(self.samples) if self.samples else float("nan")

    def __enter__(self) -> "RunQueueSampler":
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()


def machine_line(info: dict) -> str:
    gpu = f", GPU {info['gpu']}" if "gpu" in info else ""
    return (
        f"{info['cpu']}, {info['cores_usable']} of {info['cores']} cores usable{gpu}; torch {info.get('torch', '?')} "
        f"({info.get('torch_threads', '?')} thread(s) in this process), OMP_WAIT_POLICY {info['omp_wait_policy']}; "
        f"python {info['python']}; "
        f"load average {info['load_avg_1m']:.2f} at start (others' load skews results)"
    )


def format_table(headers: list[str], rows: list[list]) -> str:
    cells = [[_fmt(x) for x in row] for row in rows]
    widths = [max(len(h), *(len(r[i]) for r in cells)) for i, h in enumerate(headers)]
    line = lambda row: "  ".join(c.rjust(w) if i else c.ljust(w) for i, (c, w) in enumerate(zip(row, widths)))  # noqa: E731
    return "\n".join([line(headers), "  ".join("-" * w for w in widths), *(line(r) for r in cells)])


def _fmt(x) -> str:
    if isinstance(x, float):
        if x != x:
            return "-"
        return f"{x:.3g}" if abs(x) < 10 else f"{x:,.0f}" if abs(x) >= 1000 else f"{x:.1f}"
    return str(x)


METRIC_ROWS = [
    ("requests/s", "requests_per_s"),
    ("output tokens/s", "output_tokens_per_s"),
    ("total tokens/s", "total_tokens_per_s"),
    ("duration s", "duration_s"),
    ("TTFT p50 ms", "ttft_p50_ms"),
    ("TTFT p90 ms", "ttft_p90_ms"),
    ("TTFT p99 ms", "ttft_p99_ms"),
    ("ITL p50 ms", "itl_p50_ms"),
    ("ITL p90 ms", "itl_p90_ms"),
    ("ITL p99 ms", "itl_p99_ms"),
    ("ITL max ms", "itl_max_ms"),
    ("TPOT p50 ms", "tpot_p50_ms"),
    ("E2E p50 ms", "e2e_p50_ms"),
    ("E2E p90 ms", "e2e_p90_ms"),
    ("E2E p99 ms", "e2e_p99_ms"),
    ("runnable tasks (mean)", "runnable_tasks"),
    ("errors", "num_errors"),
    ("wrong output lengths", "num_wrong_length"),
]


def metrics_table(columns: dict[str, dict], ratio_of: tuple[str, str] | None = None) -> str:
    """One row per metric, one column per run; with `ratio_of=(a, b)` a column of how many times
    better a is than b: a/b for rates, b/a for times (so > 1 means a is better either way)."""
    names = list(columns)
    headers = ["metric", *names] + ([f"{ratio_of[0]} vs {ratio_of[1]}"] if ratio_of else [])
    rows = []
    for label, key in METRIC_ROWS:
        row = [label, *(columns[n].get(key, float("nan")) for n in names)]
        if ratio_of:
            a, b = columns[ratio_of[0]].get(key), columns[ratio_of[1]].get(key)
            if key.startswith("num_") or key == "runnable_tasks" or not a or not b or a != a or b != b:
                row.append("")
            else:
                row.append(f"{a / b if key.endswith('_per_s') else b / a:.2f}x")
        rows.append(row)
    return format_table(headers, rows)


def write_json(path: Path, payload: dict) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(payload, indent=1, default=_json_default))
    return path


def _json_default(obj):
    if isinstance(obj, (LengthDist,)):
        return obj.spec
    if hasattr(obj, "__dataclass_fields__"):
        return asdict(obj)
    return str(obj)


def records_json(records: list[RequestRecord], t0: float) -> list[dict]:
    return [
        {
            "index": r.index,
            "prompt_tokens": r.num_prompt_tokens,
            "max_tokens": r.max_tokens,
            "output_tokens": r.num_output_tokens,
            "start_s": r.start - t0,
            "end_s": r.end - t0,
            "token_times_s": [round(t - t0, 6) for t in r.token_times],
            "token_counts": r.token_counts,
            "error": r.error,
        }
        for r in records
    ]


def exit_on_sigterm() -> None:
    """Turn SIGTERM (e.g. from `timeout`) into SystemExit, so spawned services are stopped on the way out."""
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))


def timestamp() -> str:
    return time.strftime("%Y%m%d-%H%M%S")


# ---------------------------------------------------------------- plots


def pyplot():
    """matplotlib.pyplot with a file-only backend, or None when matplotlib is not installed."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        return plt
    except ImportError:
        return None


def plot_runs(runs: dict[str, tuple[list[RequestRecord], float, float]], path: Path, title: str) -> Path | None:
    """Latency distributions (TTFT, ITL, E2E as CDFs) and output tokens/s over time, one line per run."""
    plt = pyplot()
    if plt is None:
        print("matplotlib is not installed: no plot (pip install -r requirements.txt)")
        return None
    fig, axes = plt.subplots(2, 2, figsize=(12, 8))
    panels = [
        (axes[0][0], "TTFT (s)", lambda rs: [r.ttft() for r in rs if r.ttft() is not None]),
        (axes[0][1], "inter-token latency (ms)", lambda rs: [1000 * x for r in rs for x in r.itls()]),
        (axes[1][0], "end-to-end latency (s)", lambda rs: [r.end - r.start for r in rs if not r.error]),
    ]
    for ax, label, values_of in panels:
        for name, (records, _, _) in runs.items():
            xs = sorted(values_of(records))
            if xs:
                ax.step([xs[0], *xs], [0, *((i + 1) / len(xs) for i in range(len(xs)))], where="post", label=name)
        ax.set_xlabel(label)
        ax.set_ylabel("fraction of token gaps" if "inter-token" in label else "fraction of requests")
        ax.xaxis.get_major_formatter().set_useOffset(False)
        ax.grid(alpha=0.3)
        ax.legend()
    axes[0][1].set_xscale("log")
    ax = axes[1][1]
    for name, (records, t0, t_end) in runs.items():
        series = throughput_over_time(records, t0, t_end)
        ax.step([t for t, _ in series], [v for _, v in series], where="post", label=name)
    ax.set_xlabel("time since start (s)")
    ax.set_ylabel("output tokens/s")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
