"""Triton kernels of the executor: one op per module, each a kernel beside its launcher.

    from kernels.paged_attention import paged_attention
    from kernels.reshape_and_cache import reshape_and_cache
    from kernels.copy_blocks import copy_blocks
    from kernels.rms_norm import rms_norm, fused_add_rms_norm
    from kernels.rotary import rotary_embedding
    from kernels.activation import silu_and_mul
    from kernels.fused_moe import fused_moe

Launchers validate shapes, strides, dtypes and devices, then launch; torch references
live in `tests/kernels`. On a machine without CUDA they run under the Triton interpreter
(set `TRITON_INTERPRET=1` before a kernel module is first imported) on CPU tensors.

This package imports nothing itself: transformers probes for a top-level `kernels`
module (Hugging Face's kernel hub) and must not pull in triton by doing so.
"""
