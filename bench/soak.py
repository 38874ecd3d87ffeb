"""Soak: mixed hostile load for N minutes, then leaks. Does the service stay flat?

    python bench/soak.py --minutes 60                   # spawns scheduler + 2 executors on a tiny random model
    python bench/soak.py --minutes 10 --model /path/to/model --clients 6

Load, from `--clients` threads: greedy and sampled streams, n > 1, beam search, streams
cancelled mid-way, short client deadlines, Abort, bad requests; one executor is killed
(SIGKILL) at 40 % of the run and a fresh one joins. Every `--sample-every` seconds it
records each process's RSS and open fds (/proc) and the scheduler's asyncio task count
(its /metrics), and the KV blocks in use.

Reports, as a table and a plot: leaked blocks once idle at the end (in use though nothing
runs), the RSS slope of each process (MB/min, least squares over the second half of the
run, after warm-up), fds and asyncio tasks at start / end / max, and the unexpected
statuses (e.g. INTERNAL, UNKNOWN, or UNAVAILABLE for a stream that should have moved to
the surviving executor). Exits 1 on a leaked block or an unexpected status.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import random
import signal
import sys
import tempfile
import threading
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repository root, when run as a script

import grpc  # noqa: E402

from bench.common import OUT_DIR, exit_on_sigterm, format_table, pyplot, timestamp, write_json  # noqa: E402
from bench.fuzz import all_blocks_free, tiny_model  # noqa: E402
from pagoda.v1 import generation_pb2 as pb  # noqa: E402
from pagoda.v1 import generation_pb2_grpc as pb_grpc  # noqa: E402

# kind of request -> the statuses it may end with
EXPECTED = {
    "greedy": {"OK"},
    "sampled": {"OK"},
    "n4": {"OK"},
    "beam": {"OK"},
    "cancel": {"OK", "CANCELLED"},
    "deadline": {"OK", "DEADLINE_EXCEEDED"},
    "abort": {"OK"},
    "bad": {"INVALID_ARGUMENT", "RESOURCE_EXHAUSTED"},  # the latter: over --max-request-bytes
    # structured output: a small schema, a tool call's grammar (tool_choice "required"), a regex or a
    # choice; or a bad or hostile one (eight strings of large maxLength: over the compile bound)
    "constrained": {"OK"},
    # (OK: the hostile schema compiled within the bounds, the scheduler's 10 s and the executor's 30 s)
    "bad_constraint": {"OK", "INVALID_ARGUMENT", "RESOURCE_EXHAUSTED", "DEADLINE_EXCEEDED"},
}

_TOOL_SCHEMA = (
    '{"type": "array", "minItems": 1, "items": {"anyOf": [{"type": "object", "properties": {"name": {"type": "string", '
    '"enum": ["get_weather"]}, "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": '
    '["city"]}}, "required": ["name", "parameters"], "additionalProperties": false}]}}'
)


def make_request(kind: str, rng: random.Random, request_id: str) -> pb.GenerateRequest:
    req = pb.GenerateRequest(request_id=request_id)
    req.token_ids.ids.extend(rng.randrange(3, 40000) for _ in range(rng.randint(4, 200)))
    req.stopping.max_tokens = rng.randint(4, 48)
    req.stopping.ignore_eos = True
    if kind == "greedy" or kind in ("cancel", "deadline", "abort"):
        req.sampling.temperature = 0.0
    elif kind == "sampled":
        req.sampling.temperature, req.sampling.top_p, req.sampling.seed = 0.8, 0.9, rng.randrange(1000)
    elif kind == "n4":
        req.sampling.temperature, req.sampling.n = 1.0, 4
    elif kind == "beam":
        req.sampling.beam_width, req.sampling.n = 4, 2
        req.stopping.max_tokens = rng.randint(4, 16)
    elif kind == "bad":
        choice = rng.randrange(4)
        if choice == 0:
            req.sampling.temperature = float("inf")
        elif choice == 1:
            req.stopping.stop.append("s" * 10_000)
        elif choice == 2:
            req.token_ids.ids.append(10**6)
        else:
            req.ClearField("token_ids")
            req.text = "a" * 5_000_000 if rng.random() < 0.1 else ""
    elif kind in ("constrained", "bad_constraint"):
        req.sampling.temperature = 0.0
        req.stopping.ignore_eos = False  # refused with a constraint
        choice = rng.randrange(4)
        if kind == "bad_constraint":
            if choice == 0:
                props = {f"s{rng.randrange(10**6)}_{i}": {"type": "string", "maxLength": 100_000} for i in range(8)}
                req.constraint.json_schema = json.dumps({"type": "object", "properties": props, "required": list(props)})
            else:
                req.constraint.regex = ["(", "(ab", "a|("][choice - 1]  # unclosed: never compiles
        elif choice == 0:
            req.constraint.json_schema = '{"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"]}'
        elif choice == 1:
            req.constraint.json_schema = _TOOL_SCHEMA
        elif choice == 2:
            req.constraint.regex = r"[0-9]{1,4}"
        else:
            req.constraint.choice.choices.extend(["yes", "no", "maybe"])
    return req


@dataclass
class Samples:
    t: list[float] = field(default_factory=list)
    rss_mb: dict[str, list[tuple[float, float]]] = field(default_factory=lambda: collections.defaultdict(list))
    fds: dict[str, list[tuple[float, int]]] = field(default_factory=lambda: collections.defaultdict(list))
    tasks: list[tuple[float, float]] = field(default_factory=list)
    blocks_in_use: list[tuple[float, int]] = field(default_factory=list)


def _proc_rss_mb(pid: int) -> float | None:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    except OSError:
        return None
    return None


def _proc_fds(pid: int) -> int | None:
    try:
        return len(os.listdir(f"/proc/{pid}/fd"))
    except OSError:
        return None


def _scrape(port: int, name: str) -> float | None:
    from prometheus_client.parser import text_string_to_metric_families

    try:
        text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
    except OSError:
        return None
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == name:
                return sample.value
    return None


def slope_per_min(points: list[tuple[float, float]]) -> float:
    """Least-squares slope (units per minute) over the second half of `points`."""
    half = points[len(points) // 2 :]
    if len(half) < 2:
        return 0.0
    n = len(half)
    mean_t = sum(t for t, _ in half) / n
    mean_v = sum(v for _, v in half) / n
    var = sum((t - mean_t) ** 2 for t, _ in half)
    return 60 * sum((t - mean_t) * (v - mean_v) for t, v in half) / var if var else 0.0


def run_soak(minutes: float, model: str | None = None, clients: int = 4, sample_every: float = 5.0, seed: int = 0) -> dict:
    from tests.service.harness import Service

    with tempfile.TemporaryDirectory() as tmp:
        model = model or str(tiny_model(Path(tmp)))
        with Service(model, executor_args=["--num-kv-blocks", "512"], num_executors=2) as svc:
            return _soak(svc, minutes, clients, sample_every, seed)


def _soak(svc, minutes: float, clients: int, sample_every: float, seed: int) -> dict:
    stub = svc.stub
    stop = threading.Event()
    lock = threading.Lock()
    statuses: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)
    unexpected: list[str] = []
    t0 = time.monotonic()
    end = t0 + minutes * 60
    procs = {"scheduler": svc.scheduler, "executor0": svc.executors[0], "executor1": svc.executors[1]}

    def client(index: int) -> None:
        rng = random.Random(seed * 1000 + index)
        kinds = list(EXPECTED)
        weights = [4, 2, 1, 1, 1, 1, 1, 1, 1, 1]
        i = 0
        while not stop.is_set():
            kind = rng.choices(kinds, weights)[0]
            i += 1
            request_id = f"c{index}-{i}"
            code = _one(stub, make_request(kind, rng, request_id), kind, rng)
            with lock:
                statuses[kind][code] += 1
                if code not in EXPECTED[kind]:
                    unexpected.append(f"{time.monotonic() - t0:.0f}s {kind} {request_id}: {code}")

    samples = Samples()

    def sample() -> None:
        now = time.monotonic() - t0
        for name, proc in list(procs.items()):
            if proc.poll() is None:
                if (rss := _proc_rss_mb(proc.pid)) is not None:
                    samples.rss_mb[name].append((now, rss))
                if (fds := _proc_fds(proc.pid)) is not None:
                    samples.fds[name].append((now, fds))
        if (tasks := _scrape(svc.metrics_port, "pagoda:asyncio_tasks")) is not None:
            samples.tasks.append((now, tasks))
        info = svc.server_info()
        samples.blocks_in_use.append((now, sum(e.num_total_blocks - e.num_free_blocks for e in info.executors)))

    threads = [threading.Thread(target=client, args=(i,), daemon=True) for i in range(clients)]
    for thread in threads:
        thread.start()
    restarted = False
    try:
        while time.monotonic() < end:
            sample()
            if not restarted and time.monotonic() - t0 > 0.4 * minutes * 60:
                restarted = True
                print(f"{time.monotonic() - t0:.0f}s: SIGKILL executor1, starting executor2", flush=True)
                procs["executor1"].send_signal(signal.SIGKILL)
                procs["executor2"] = svc.add_executor()
            time.sleep(min(sample_every, max(end - time.monotonic(), 0)))
    finally:
        stop.set()
        for thread in threads:
            thread.join(timeout=120)
    info = all_blocks_free(stub, timeout_s=60)
    sample()
    leaked = sum(e.num_total_blocks - e.num_free_blocks for e in info.executors)
    deaths = [name for name, proc in procs.items() if name != "executor1" and proc.poll() is not None]
    return {
        "minutes": minutes,
        "clients": clients,
        "statuses": {kind: dict(counter) for kind, counter in statuses.items()},
        "unexpected": unexpected,
        "leaked_blocks": leaked,
        "process_deaths": deaths,
        "executors_at_end": len(info.executors),
        "rss_slope_mb_per_min": {name: slope_per_min(points) for name, points in samples.rss_mb.items()},
        "samples": {
            "rss_mb": dict(samples.rss_mb), "fds": dict(samples.fds), "asyncio_tasks": samples.tasks,
            "blocks_in_use": samples.blocks_in_use,
        },
    }


def _one(stub, req: pb.GenerateRequest, kind: str, rng: random.Random) -> str:
    timeout = rng.uniform(0.05, 0.5) if kind == "deadline" else 120
    call = stub.Generate(req, timeout=timeout)
    try:
        for i, _ in enumerate(call):
            if kind == "cancel" and i >= rng.randint(0, 3):
                call.cancel()
            if kind == "abort" and i == 1:
                stub.Abort(pb.AbortRequest(request_ids=[req.request_id]), timeout=10)
    except grpc.RpcError as exc:
        return exc.code().name
    return "OK"


def report_table(report: dict) -> str:
    s = report["samples"]
    rows = []
    for name, points in sorted(s["rss_mb"].items()):
        fds = [v for _, v in s["fds"].get(name, [])] or [0]
        rows.append([name, f"{points[0][1]:.0f}", f"{points[-1][1]:.0f}", f"{report['rss_slope_mb_per_min'][name]:+.2f}",
                     fds[0], fds[-1], max(fds)])
    table = format_table(["process", "RSS start MB", "RSS end MB", "RSS slope MB/min (2nd half)", "fds start", "fds end", "fds max"], rows)
    tasks = [v for _, v in s["asyncio_tasks"]] or [0]
    lines = [
        table,
        f"scheduler asyncio tasks: start {tasks[0]:.0f}, end {tasks[-1]:.0f}, max {max(tasks):.0f}",
        f"leaked blocks {report['leaked_blocks']}, unexpected statuses {len(report['unexpected'])}, "
        f"process deaths {report['process_deaths'] or 0}, executors at end {report['executors_at_end']}",
        "statuses: " + "; ".join(f"{k} {v}" for k, v in sorted(report["statuses"].items())),
    ]
    lines += [f"  unexpected: {u}" for u in report["unexpected"][:20]]
    return "\n".join(lines)


def plot(report: dict, path: Path) -> Path | None:
    plt = pyplot()
    if plt is None:
        return None
    s = report["samples"]
    fig, axes = plt.subplots(2, 2, figsize=(12, 8))
    for name, points in sorted(s["rss_mb"].items()):
        axes[0][0].plot([t / 60 for t, _ in points], [v for _, v in points], label=name)
    for name, points in sorted(s["fds"].items()):
        axes[0][1].plot([t / 60 for t, _ in points], [v for _, v in points], label=name)
    axes[1][0].plot([t / 60 for t, _ in s["asyncio_tasks"]], [v for _, v in s["asyncio_tasks"]])
    axes[1][1].plot([t / 60 for t, _ in s["blocks_in_use"]], [v for _, v in s["blocks_in_use"]])
    for ax, title in zip([*axes[0], *axes[1]], ["RSS (MB)", "open fds", "scheduler asyncio tasks", "KV blocks in use"]):
        ax.set_title(title)
        ax.set_xlabel("minutes")
    axes[0][0].legend()
    axes[0][1].legend()
    fig.suptitle(f"Pagoda soak, {report['minutes']:g} min, {report['clients']} clients")
    fig.tight_layout()
    fig.savefig(path)
    return path


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--minutes", type=float, default=10.0)
    parser.add_argument("--model", default=None, help="default: a tiny random model (fast; leaks do not depend on size)")
    parser.add_argument("--clients", type=int, default=4)
    parser.add_argument("--sample-every", type=float, default=5.0, help="seconds between samples")
    parser.add_argument("--out", default=None, help=f"JSON path (default {OUT_DIR}/soak-<time>.json; the plot beside it)")
    args = parser.parse_args(argv)
    exit_on_sigterm()
    report = run_soak(args.minutes, args.model, args.clients, args.sample_every)
    print(report_table(report))
    out = Path(args.out) if args.out else OUT_DIR / f"soak-{timestamp()}.json"
    write_json(out, report)
    if (png := plot(report, out.with_suffix(".png"))) is not None:
        print(f"plot: {png}")
    print(f"json: {out}")
    return 1 if report["leaked_blocks"] or report["unexpected"] or report["process_deaths"] else 0


if __name__ == "__main__":
    sys.exit(main())
