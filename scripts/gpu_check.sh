#!/usr/bin/env bash
# GPU check of kernels/: the kernel tests compiled for CUDA (not the interpreter), then bench/bench_kernels.py,
# then bench/bench_tp.py (TP=1 vs TP=$TP_SIZE decode, needs that many GPUs).
#
#   bash scripts/gpu_check.sh                    # or: make gpu-check
#   PYTHON=.venv/bin/python PEAK_GBS=3350 BENCH_ARGS=--skip-model bash scripts/gpu_check.sh
#
# Assumes:
#   - an NVIDIA GPU with nvidia-smi; written for one H200 (~4.8 TB/s HBM3e, 141 GB). Set PEAK_GBS for
#     another GPU. The model table at batch 256 holds about 86 GiB (16 GiB of weights, the paged and
#     the contiguous KV caches side by side): use BENCH_ARGS=--skip-model on a smaller card.
#   - $PYTHON (default python3) already has a CUDA build of torch, triton, transformers and pytest
#     (e.g. installed from wheels; requirements.txt pins the versions). Nothing is downloaded: the
#     model is built from a config with random weights.
#   - run from anywhere; it works from the repository root and unsets TRITON_INTERPRET.
# Writes bench/out/gpu_check-<time>/{env.txt, pytest.txt, bench.txt, bench.json}; exits non-zero when a
# test fails or the benchmark fails, after running both.
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
unset TRITON_INTERPRET
out="bench/out/gpu_check-$(date +%Y%m%d-%H%M%S)"
mkdir -p "$out"

{
  nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.sm,clocks.max.mem --format=csv
  "$PY" -c 'import torch, triton, transformers; print("torch", torch.__version__, "cuda", torch.version.cuda, "| triton", triton.__version__, "| transformers", transformers.__version__); assert torch.cuda.is_available(), "torch sees no CUDA device"'
} 2>&1 | tee "$out/env.txt"
[ "${PIPESTATUS[0]}" -eq 0 ] || { echo "environment check failed: see $out/env.txt"; exit 2; }

echo "== kernel tests on CUDA"
# (test_fused_moe.py: the fused-MoE kernel at a Qwen3-30B-A3B-sized block, SparseMoE's default CUDA route, against the expert loop)
"$PY" -m pytest tests/kernels -q -p no:cacheprovider --durations=10 2>&1 | tee "$out/pytest.txt"
tests=${PIPESTATUS[0]}

echo "== benchmarks"
# shellcheck disable=SC2086  # BENCH_ARGS is a list of flags
"$PY" bench/bench_kernels.py --json "$out/bench.json" --peak-gbs "${PEAK_GBS:-4800}" ${BENCH_ARGS:-} 2>&1 | tee "$out/bench.txt"
bench=${PIPESTATUS[0]}

echo "== tensor parallelism: TP=1 vs TP=${TP_SIZE:-2} decode (NCCL; says so when there are fewer GPUs)"
"$PY" bench/bench_tp.py --device cuda --tp "${TP_SIZE:-2}" --hidden 4096 --layers 8 --batch 64 --steps 40 2>&1 | tee "$out/bench_tp.txt"
tp=${PIPESTATUS[0]}

echo "== tests exit $tests, bench exit $bench, tp bench exit $tp; results in $out"
[ "$tests" -eq 0 ] && [ "$bench" -eq 0 ] && [ "$tp" -eq 0 ]
