"""The model's elementwise ops as fused kernels: Triton (kernels/) for the triton backend, C for the CPU."""

from __future__ import annotations

import ctypes
from pathlib import Path

import torch

from executor_svc import cbuild, model
from executor_svc.model import ModelOps


def triton_model_ops() -> ModelOps:
    """RMSNorm (+ residual add), rotary and SiLU-and-multiply from kernels/; same contracts as the torch ops."""
    from kernels.activation import silu_and_mul
    from kernels.rms_norm import fused_add_rms_norm, rms_norm
    from kernels.rotary import rotary_embedding

    def apply_rotary(q, k, cos, sin):
        # cos, sin are the step's rows [T, D/2] already: row i rotates token i.
        cos_sin = torch.cat((cos, sin), dim=-1).contiguous()
        positions = torch.arange(q.shape[0], device=q.device)
        q, k = q.contiguous(), k.contiguous()
        rotary_embedding(positions, q, k, cos_sin)
        return q, k

    return ModelOps(
        rms_norm=rms_norm,
        add_rms_norm=fused_add_rms_norm,
        apply_rotary=apply_rotary,
        silu_and_mul=silu_and_mul,
    )


# ---- CPU: the same ops as one C call each (csrc/cpu_ops.c) -----------------------------------
CPU_OPS_SOURCE = Path(__file__).with_name("csrc") / "cpu_ops.c"
# Up to this many rows the C loops run; above it, torch's ops (multi-threaded, vectorised), whose
# dispatch cost no longer matters next to the arithmetic.
CPU_OPS_MAX_ROWS = 64


_cpu_library: ctypes.CDLL | None | bool = False  # False: not loaded yet
_cpu_openmp = False  # whether its OpenMP regions run on torch's team (cbuild.load_openmp)


def cpu_ops_library() -> ctypes.CDLL | None:
    """csrc/cpu_ops.c built and loaded once per process (its argument types set), or None (no compiler)."""
    global _cpu_library, _cpu_openmp
    if _cpu_library is False:
        # with OpenMP where its team is torch's (the decode step's LoRA deltas split over it; the other ops
        # are one thread's loops either way)
        library, _cpu_openmp = cbuild.load_openmp(CPU_OPS_SOURCE, cbuild.BASE_CFLAGS,
                                                  "CPU elementwise ops (torch ops instead)")
        if library is not None:
            i64, f32, ptr = ctypes.c_int64, ctypes.c_float, ctypes.c_void_p
            signatures = {
                "pagoda_rms_norm": [ptr, i64, ptr, ptr, i64, i64, f32],
                "pagoda_add_rms_norm": [ptr, i64, ptr, i64, ptr, ptr, ptr, i64, i64, f32],
                "pagoda_rotary_neox": [ptr, i64, ptr, i64, i64, i64, i64, ptr, ptr],
                "pagoda_silu_and_mul": [ptr, i64, i64, ptr],
                "pagoda_gelu_tanh_and_mul": [ptr, i64, i64, ptr],
                "pagoda_rms_norm_heads": [ptr, i64, i64, i64, ptr, i64, f32],
                "pagoda_write_kv": [ptr, ptr, i64, ptr, ptr, ptr, i64, i64],
                "pagoda_write_kv_bf16": [ptr, ptr, i64, ptr, ptr, ptr, i64, i64],
                "pagoda_rows_finite": [ptr, i64, i64, i64, ptr],
                "pagoda_rows_argmax": [ptr, i64, i64, i64, ptr],
            }
            for name, argtypes in signatures.items():
                fn = getattr(library, name)
                fn.argtypes, fn.restype = argtypes, None
        _cpu_library = library
    return _cpu_library


def cpu_ops_openmp() -> bool:
    """Whether `cpu_ops_library()`'s OpenMP regions run on torch's team (else they are not to be used)."""
    return cpu_ops_library() is not None and _cpu_openmp


def cpu_model_ops(library: ctypes.CDLL | None = None) -> ModelOps | None:
    """RMSNorm (+ residual add), rotary and SiLU-and-mul for float32 CPU models, as calls into
    `library` (`cpu_ops_library()` when None), or None where it does not build.

    At a few tokens a step each torch version is several dispatched ops of about a microsecond
    of arithmetic each; over 30 layers those dispatches were a third of a one-token step on
    the default model (`bench/bench_one_stream.py --only forward`).
    """
    library = library or cpu_ops_library()
    if library is None:
        return None
    c_rms_norm, c_add_rms_norm = library.pagoda_rms_norm, library.pagoda_add_rms_norm
    c_rotary, c_silu_and_mul = library.pagoda_rotary_neox, library.pagoda_silu_and_mul

    def rows_ok(x: torch.Tensor) -> bool:  # a [T, n] float32 CPU tensor whose rows are contiguous
        return x.dim() == 2 and x.shape[0] <= CPU_OPS_MAX_ROWS and x.dtype == torch.float32 and x.stride(1) == 1

    def rms_norm(x, weight, eps):
        if not (rows_ok(x) and weight.dtype == torch.float32):
            return model.rms_norm(x, weight, eps)
        out = torch.empty(x.shape, dtype=torch.float32)
        c_rms_norm(x.data_ptr(), x.stride(0), weight.data_ptr(), out.data_ptr(), x.shape[0], x.shape[1], eps)
        return out

    def add_rms_norm(x, residual, weight, eps):
        if not (rows_ok(x) and rows_ok(residual) and weight.dtype == torch.float32):
            return model.add_rms_norm(x, residual, weight, eps)
        out = torch.empty(x.shape, dtype=torch.float32)
        total = torch.empty(x.shape, dtype=torch.float32)
        c_add_rms_norm(
            x.data_ptr(), x.stride(0), residual.data_ptr(), residual.stride(0), weight.data_ptr(),
            out.data_ptr(), total.data_ptr(), x.shape[0], x.shape[1], eps,
        )
        return out, total

    def apply_rotary(q, k, cos, sin):
        # in place on q and k (views of the step's fresh q/k/v projection): heads contiguous in each row
        t, heads, head_dim = q.shape
        if not (
            t <= CPU_OPS_MAX_ROWS and q.dtype == k.dtype == cos.dtype == sin.dtype == torch.float32
            and q.stride(2) == k.stride(2) == 1 and q.stride(1) == k.stride(1) == head_dim
            and cos.is_contiguous() and sin.is_contiguous()
        ):
            return model.apply_rotary(q, k, cos, sin)
        c_rotary(q.data_ptr(), q.stride(0), q.data_ptr(), q.stride(0), t, heads, head_dim, cos.data_ptr(), sin.data_ptr())
        c_rotary(k.data_ptr(), k.stride(0), k.data_ptr(), k.stride(0), t, k.shape[1], head_dim, cos.data_ptr(), sin.data_ptr())
        return q, k

    def silu_and_mul(x):
        if not (rows_ok(x) and x.is_contiguous()):
            return model.silu_and_mul(x)
        n = x.shape[1] // 2
        out = torch.empty((x.shape[0], n), dtype=torch.float32)
        c_silu_and_mul(x.data_ptr(), x.shape[0], n, out.data_ptr())
        return out

    return ModelOps(rms_norm=rms_norm, add_rms_norm=add_rms_norm, apply_rotary=apply_rotary, silu_and_mul=silu_and_mul)


# ---- the sampled rows of a step's logits: one C pass a row ------------------------------------------------
def _few_cpu_rows(x: torch.Tensor) -> ctypes.CDLL | None:
    """The C library where `x` is a few [rows, vocab] float32 CPU rows (contiguous within a row), else None."""
    if x.device.type != "cpu" or x.dtype != torch.float32 or x.dim() != 2 or x.stride(1) != 1:
        return None
    if not 0 < x.shape[0] <= CPU_OPS_MAX_ROWS or x.shape[1] < 1:
        return None
    return cpu_ops_library()


def rows_finite(x: torch.Tensor) -> list[bool] | None:
    """Whether each row of `x` holds no NaN or infinity, or None where the C pass does not apply.

    torch's `isfinite(x.sum(-1))` on one row of a 49,152-token vocabulary measured 80-100 us as the
    first reduction after a decode step's C calls (~20 us when repeated at once, ~14 us alone); the C
    pass ~8 us alone, ctypes call included."""
    library = _few_cpu_rows(x)
    if library is None:
        return None
    out = (ctypes.c_uint8 * x.shape[0])()
    library.pagoda_rows_finite(x.data_ptr(), x.stride(0), x.shape[0], x.shape[1], out)
    return [bool(v) for v in out]


def rows_argmax(x: torch.Tensor) -> torch.Tensor | None:
    """`x.argmax(dim=-1)` (the first largest value's index) as one C pass a row, or None where it does
    not apply, including a row that holds a NaN or an infinity (torch's answer is then the caller's)."""
    library = _few_cpu_rows(x)
    if library is None:
        return None
    out = torch.empty(x.shape[0], dtype=torch.int64)
    library.pagoda_rows_argmax(x.data_ptr(), x.stride(0), x.shape[0], x.shape[1], out.data_ptr())
    return None if min(out.tolist()) < 0 else out
