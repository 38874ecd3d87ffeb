"""Triton kernels of the executor: one op per module, each a kernel beside its launcher.

Launchers validate shapes, strides, dtypes and devices, then launch; torch references
live in `tests/kernels`. On a machine without CUDA they run under the Triton interpreter
(set `TRITON_INTERPRET=1` before this package is first imported) on CPU tensors.
"""

import triton

from kernels.activation import silu_and_mul
from kernels.copy_blocks import copy_blocks
from kernels.paged_attention import paged_attention
from kernels.reshape_and_cache import reshape_and_cache
from kernels.rms_norm import fused_add_rms_norm, rms_norm
from kernels.rotary import rotary_embedding

__all__ = [
    "copy_blocks",
    "fused_add_rms_norm",
    "paged_attention",
    "reshape_and_cache",
    "rms_norm",
    "rotary_embedding",
    "silu_and_mul",
]


def _fix_interpreter_scalar_index() -> None:
    """Triton 3.6's interpreter turns a runtime loop bound into an int with `int(array of shape (1,))`,
    which NumPy >= 2.4 refuses (triton-lang/triton#9171): take the single element instead.
    Harmless once triton carries the fix; drop it then (or pin numpy < 2.4).
    """
    from triton.runtime import interpreter

    patch_tensor = interpreter._patch_lang_tensor

    def patched(tensor, scope):
        patch_tensor(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.item()))

    interpreter._patch_lang_tensor = patched


if triton.knobs.runtime.interpret:
    _fix_interpreter_scalar_index()
