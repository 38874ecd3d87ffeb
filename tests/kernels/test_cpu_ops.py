"""The CPU elementwise ops (executor_svc/csrc/cpu_ops.c) against the torch ops they replace (executor_svc/model.py).

Same formulas in float32: rotary and SiLU-and-mul to the bit or an ulp or two, RMSNorm within
the rounding of a differently ordered sum. Strided rows (the q/k views of a merged q/k/v
projection, a residual view) go through the C path; more rows than CPU_OPS_MAX_ROWS, or
another dtype, fall back to torch.
"""

from __future__ import annotations

import pytest
import torch

from executor_svc import fused_ops
from executor_svc import model as torch_ops

OPS = fused_ops.cpu_model_ops()
pytestmark = pytest.mark.skipif(OPS is None, reason="no C compiler: the CPU ops are not built")
TOL = dict(atol=2e-6, rtol=2e-6)
ROWS = [1, 3, fused_ops.CPU_OPS_MAX_ROWS, fused_ops.CPU_OPS_MAX_ROWS + 1]  # the last: torch's path


@pytest.mark.parametrize("rows", ROWS)
@pytest.mark.parametrize("hidden", [576, 100, 7])
def test_rms_norm_and_add_rms_norm(rows, hidden):
    x = torch.randn(rows, hidden + 5)[:, :hidden]  # strided rows
    residual = torch.randn(rows, hidden)
    weight = 1 + 0.1 * torch.randn(hidden)
    torch.testing.assert_close(OPS.rms_norm(x, weight, 1e-5), torch_ops.rms_norm(x, weight, 1e-5), **TOL)
    out, total = OPS.add_rms_norm(x, residual, weight, 1e-5)
    want_out, want_total = torch_ops.add_rms_norm(x, residual, weight, 1e-5)
    torch.testing.assert_close(total, want_total, atol=0, rtol=0)
    torch.testing.assert_close(out, want_out, **TOL)
    assert total.data_ptr() not in (x.data_ptr(), residual.data_ptr())  # the inputs are left as they were


@pytest.mark.parametrize("rows", ROWS)
@pytest.mark.parametrize("heads, kv_heads, head_dim", [(9, 3, 64), (4, 4, 16), (2, 1, 6)])
def test_rotary_on_views_of_a_merged_projection(rows, heads, kv_heads, head_dim):
    qkv = torch.randn(rows, (heads + 2 * kv_heads) * head_dim)
    q, k, v = qkv.split((heads * head_dim, kv_heads * head_dim, kv_heads * head_dim), dim=-1)
    q, k = q.view(rows, heads, head_dim), k.view(rows, kv_heads, head_dim)
    angles = torch.rand(rows, head_dim // 2) * 100
    cos, sin = angles.cos(), angles.sin()
    want_q, want_k = torch_ops.apply_rotary(q.clone(), k.clone(), cos, sin)
    v_before = v.clone()
    got_q, got_k = OPS.apply_rotary(q, k, cos, sin)
    torch.testing.assert_close(got_q, want_q, atol=0, rtol=0)
    torch.testing.assert_close(got_k, want_k, atol=0, rtol=0)
    torch.testing.assert_close(v, v_before, atol=0, rtol=0)  # v, beside q and k in the same rows, untouched


@pytest.mark.parametrize("rows", ROWS)
@pytest.mark.parametrize("width", [1536, 3])
def test_silu_and_mul(rows, width):
    x = 4 * torch.randn(rows, 2 * width)
    torch.testing.assert_close(OPS.silu_and_mul(x), torch_ops.silu_and_mul(x), atol=1e-6, rtol=4e-7)


@pytest.mark.parametrize("rows", [1, 3])
@pytest.mark.parametrize("width", [2048, 3])
def test_gelu_tanh_and_mul_equals_torch(rows, width):
    """Gemma's GeGLU in C (the decode path's call), as g sigmoid(2 z): torch's tanh form within float32
    rounding, over gates from -12 to 12 (both tails, where 1 + tanh(z) cancels) and exact zeros."""
    import torch.nn.functional as F

    gate = torch.linspace(-12, 12, rows * width).view(rows, width)
    gate[:, ::7] = 0.0
    up = torch.randn(rows, width)
    x = torch.cat([gate, up], dim=1).contiguous()
    out = torch.empty(rows, width)
    fused_ops.cpu_ops_library().pagoda_gelu_tanh_and_mul(x.data_ptr(), rows, width, out.data_ptr())
    want = F.gelu(gate, approximate="tanh") * up
    torch.testing.assert_close(out, want, atol=1e-6, rtol=2e-6)
    assert (out[:, ::7] == 0).all()


def test_other_dtypes_take_the_torch_path():
    x = torch.randn(2, 64, dtype=torch.bfloat16)
    weight = torch.ones(64, dtype=torch.bfloat16)
    torch.testing.assert_close(OPS.rms_norm(x, weight, 1e-5), torch_ops.rms_norm(x, weight, 1e-5), atol=0, rtol=0)
    torch.testing.assert_close(OPS.silu_and_mul(x), torch_ops.silu_and_mul(x), atol=0, rtol=0)


@pytest.mark.parametrize("rows", [1, 3, fused_ops.CPU_OPS_MAX_ROWS])
@pytest.mark.parametrize("vocab", [1, 17, 256, 49_152 + 5])
def test_rows_argmax_and_finite_equal_torch(rows, vocab):
    """The sampled rows' argmax (the first largest value, as torch's) and finiteness in one C pass a row;
    NaN and infinities are found wherever they are (first, last, a chunk's tail); rows may be strided."""
    torch.manual_seed(vocab + rows)
    x = torch.randn(rows, vocab + 3)[:, :vocab]
    if vocab > 1:  # ties: the first index wins, within a chunk of 256 and across chunks
        top = x.max() + 1
        x[0, vocab // 2] = x[0, vocab - 1] = top
        x[rows - 1, 0] = x[rows - 1, vocab - 1] = top + 1
    assert fused_ops.rows_argmax(x).tolist() == x.argmax(dim=-1).tolist()
    assert fused_ops.rows_finite(x) == [True] * rows
    for bad in (float("nan"), float("inf"), float("-inf")):
        for at in {0, vocab // 3, vocab - 1}:
            y = x.clone()
            y[rows - 1, at] = bad
            assert fused_ops.rows_finite(y) == [True] * (rows - 1) + [False]
            assert fused_ops.rows_argmax(y) is None  # torch's answer for such a row is the caller's


def test_rows_argmax_and_finite_decline_what_they_do_not_take():
    assert fused_ops.rows_argmax(torch.randn(fused_ops.CPU_OPS_MAX_ROWS + 1, 8)) is None  # many rows: torch's
    assert fused_ops.rows_finite(torch.randn(2, 8, dtype=torch.float64)) is None
    assert fused_ops.rows_argmax(torch.randn(8)) is None
    assert fused_ops.rows_finite(torch.randn(8, 2).t()) is None  # columns, not rows
