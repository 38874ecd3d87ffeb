"""Every kernel variant the launchers choose compiles for sm_80, sm_89, sm_90 and gfx942, on any machine.

The interpreter checks the numbers but not what a GPU's compiler accepts (the FP8 formats of each
architecture, shared memory per block, dot shapes, loop-carried types). `bench/kernel_compile_table.py
--quick` compiles the launchers' own choices (the `*_config` functions in kernels/) for each target
with `triton.compile` (ptxas and AMD's linker ship with Triton: no GPU needed), checks each fits
its target's shared memory and prints the table (`pytest -s` shows it). It runs in a subprocess:
in this process `kernels` was imported under the interpreter.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "bench" / "kernel_compile_table.py"
TARGETS = ("sm_80", "sm_89", "sm_90", "gfx942")


def _run(*args: str) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    return subprocess.run(
        [sys.executable, *args], env=env, cwd=ROOT, capture_output=True, text=True, timeout=600
    )


def _launched_kernels() -> set[str]:
    """"module._name_kernel" of every @triton.jit function named *_kernel in kernels/ (the helpers are not)."""
    found = set()
    for path in (ROOT / "kernels").glob("*.py"):
        for name in re.findall(r"^@triton\.jit\s*\ndef (\w+_kernel)\(", path.read_text(), re.M):
            found.add(f"{path.stem}.{name}")
    return found


@pytest.mark.slow  # ~160 CPU-s in 2 compiling processes: ~1.5 min on 2 idle cores, ~4 beside other runs
def test_every_kernel_compiles_for_every_target():
    result = _run(str(SCRIPT), "--quick", "--jobs", "2")
    print(result.stdout)
    assert result.returncode == 0, result.stdout[-6000:] + result.stderr[-6000:]
    rows = [
        [cell.strip() for cell in line.strip("|").split("|")]
        for line in result.stdout.splitlines()
        if line.startswith("| ") and line.endswith("| ok |")
    ]
    compiled = {(target, kernel) for kernel, target, *_ in rows}
    kernels = _launched_kernels()
    assert len(kernels) >= 8
    assert {(t, k) for t in TARGETS for k in kernels} <= compiled

    def labels(target: str, kernel: str) -> str:
        return "\n".join(label for k, t, label, *_ in rows if (t, k) == (target, kernel))

    attention, cache = "paged_attention._paged_attention_kernel", "reshape_and_cache._reshape_and_cache_kernel"
    for kernel in (attention, cache):
        # FP8 KV as the executor accepts it: e5m2 everywhere, e4m3 from sm_89 (and on ROCm) only
        assert "kv=fp8_e5m2" in labels("sm_80", kernel) and "kv=fp8_e4m3" not in labels("sm_80", kernel)
        for target in ("sm_89", "sm_90", "gfx942"):
            assert "kv=fp8_e4m3" in labels(target, kernel) and "kv=fp8_e5m2" in labels(target, kernel)
    for target in TARGETS:
        chosen = labels(target, attention)
        for axis in ("fp16 ", "fp32 ", " decode ", " prefill ", " hd64 ", " hd256 ", " bs32 ", " gqa1 ", " gqa8 "):
            assert axis in chosen, (target, axis)
        assert re.search(r" seg([2-9]|\d\d+)$", chosen, re.M), (target, "split-KV")


CHECK_E4M3_ON_SM80 = """
from bench.kernel_compile_table import TARGETS, compile_variant, variants

variant = next(v for v in variants(TARGETS["sm_90"], quick=True) if "kv=fp8_e4m3 prefill" in v.label)
print(compile_variant(TARGETS["sm_80"], variant).error)
"""


@pytest.mark.slow  # a few seconds: one compile
def test_e4m3_does_not_compile_for_sm80_which_is_why_the_executor_refuses_it():
    """Once Triton converts e4m3 on sm_80 this fails: then drop the refusal in `kv_cache_dtype_for`."""
    result = _run("-c", CHECK_E4M3_ON_SM80)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "type fp8e4nv not supported in this architecture" in result.stdout
