"""The executor's execution choices: one typed record (`BackendOptions`), read from the environment in
one place, and each choice taking effect on a model replica (`Backend`)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch

from executor_svc.backend import ENV_SWITCHES, BackendOptions
from executor_svc.fused_ops import cpu_ops_library
from executor_svc.model import ModelOps
from executor_svc.model_runner import ModelRunner
from executor_svc.quant.gguf_kernel import get_kernel
from executor_svc.quant.gguf_linear import BF16_COPY_FUSED_MAX_ROWS, BF16_FUSED_MAX_ROWS, GGUFLinear
from pagoda import model_files
from tests.executor.plans import PlanBuilder, run_to_completion

REPO = Path(__file__).resolve().parents[2]


def test_from_env_reads_every_switch_and_refuses_bad_values_by_name():
    env = {
        "PAGODA_CPU_OPS": "0", "PAGODA_CPU_DECODE_KERNEL": "0", "PAGODA_CPU_DECODE_PATH": "0",
        "PAGODA_GGUF_KERNEL": "1", "PAGODA_GGUF_FUSED_MAX_ROWS": "8", "PAGODA_GGUF_BF16_FUSED_MAX_ROWS": "",
    }
    options = BackendOptions.from_env(env, attention="torch")
    assert options == BackendOptions(
        attention="torch", cpu_ops=False, cpu_decode_kernel=False, cpu_decode_path=False, gguf_fused_max_rows=8
    )
    assert BackendOptions.from_env({}) == BackendOptions()
    assert options.describe() == (
        "attention=torch, cpu_ops=False, cpu_decode_kernel=False, cpu_decode_path=False, gguf_fused_max_rows=8"
    )
    with pytest.raises(ValueError, match="PAGODA_CPU_OPS='off': expected 0 or 1"):
        BackendOptions.from_env({"PAGODA_CPU_OPS": "off"})
    with pytest.raises(ValueError, match="PAGODA_GGUF_FUSED_MAX_ROWS='many': expected an integer"):
        BackendOptions.from_env({"PAGODA_GGUF_FUSED_MAX_ROWS": "many"})
    with pytest.raises(ValueError, match="gguf_bf16_fused_max_rows: expected an integer >= 0"):
        BackendOptions(gguf_bf16_fused_max_rows=-1)


def test_no_module_reads_an_execution_switch_but_the_backend():
    """Every PAGODA_* execution switch is read by `BackendOptions.from_env` alone."""
    names = "|".join(ENV_SWITCHES.values())
    readers = [
        str(path.relative_to(REPO))
        for path in sorted((REPO / "executor_svc").rglob("*.py"))
        if path.name != "backend.py" and re.search(rf"environ[^\n]*({names})|({names})[^\n]*environ|getenv", path.read_text())
    ]
    assert readers == []


@pytest.fixture(scope="module")
def default_model_dir() -> Path:
    return model_files.resolve_model(None, weights=False)


def _runner(model_dir, **options) -> ModelRunner:
    return ModelRunner(model_dir, device="cpu", block_size=16, num_kv_blocks=64, backend=BackendOptions(**options))


def _greedy_tokens(runner: ModelRunner) -> dict[str, list[int]]:
    builder = PlanBuilder(block_size=16, num_blocks=64)
    builder.add("a", list(range(100, 120)), max_tokens=6)
    builder.add("b", list(range(300, 307)), max_tokens=6)
    return run_to_completion(runner, builder)


@pytest.mark.skipif(get_kernel() is None or cpu_ops_library() is None, reason="no C compiler: no C paths to choose")
def test_each_option_takes_effect_and_the_tokens_stay_the_same(default_model_dir):
    default = _runner(default_model_dir)
    assert default.quantization == "gguf" and default.backend.decode_step is not None
    assert default.attention.uses_decode_kernel and type(default.model.ops) is ModelOps
    assert default.model.ops != ModelOps()  # the C elementwise ops
    want = _greedy_tokens(default)

    plain = _runner(default_model_dir, cpu_ops=False, cpu_decode_kernel=False, cpu_decode_path=False, gguf_fused_max_rows=4)
    assert plain.backend.decode_step is None and not plain.attention.uses_decode_kernel
    assert plain.model.ops == ModelOps()  # torch's ops
    linears = [m for m in plain.model.modules() if isinstance(m, GGUFLinear)]
    assert linears and {m.fused_max_rows for m in linears} == {4}
    # no C decode path without the C ops it calls, even when asked for
    assert _runner(default_model_dir, cpu_ops=False).backend.decode_step is None
    assert _greedy_tokens(plain) == want

    dequantized = _runner(default_model_dir, gguf_kernel=False)
    assert dequantized.quantization == "none"
    assert not any(isinstance(m, GGUFLinear) for m in dequantized.model.modules())
    assert dequantized.backend.decode_step is None  # its linears are not GGUF blocks
    assert _greedy_tokens(dequantized) == want
    with pytest.raises(Exception, match="int8.*gguf_kernel off"):
        ModelRunner(default_model_dir, device="cpu", num_kv_blocks=8, quantization="int8",
                    backend=BackendOptions(gguf_kernel=False))


@pytest.mark.skipif(get_kernel() is None or cpu_ops_library() is None, reason="no C compiler: no C paths to choose")
def test_bfloat16_takes_the_decode_step_but_keeps_torch_ops_in_its_modules(default_model_dir):
    runner = ModelRunner(default_model_dir, device="cpu", dtype="bfloat16", block_size=16, num_kv_blocks=16)
    assert runner.model.dtype == torch.bfloat16 and runner.model.ops == ModelOps()
    step = runner.backend.decode_step
    assert step is not None and step.max_rows == runner.backend.options.bf16_fused_rows == BF16_FUSED_MAX_ROWS


def test_the_bf16_fused_rows_default_depends_on_the_bf16_copy():
    """Fused up to 16 rows of bfloat16 x on the blocks alone; with a bfloat16 copy of the weights
    the GEMM wins from 6 rows; a value given wins either way."""
    assert BackendOptions().bf16_fused_rows == BF16_FUSED_MAX_ROWS == 16
    assert BackendOptions(gguf_bf16_weights=True).bf16_fused_rows == BF16_COPY_FUSED_MAX_ROWS == 5
    assert BackendOptions(gguf_bf16_weights=True, gguf_bf16_fused_max_rows=16).bf16_fused_rows == 16
    assert BackendOptions.from_env({"PAGODA_GGUF_BF16_FUSED_MAX_ROWS": "7"}).bf16_fused_rows == 7
