"""How the executor runs a model: every execution choice in one typed record, made once per replica.

`BackendOptions` holds them (the attention backend, the C elementwise ops, the CPU decode
attention kernel, the whole-step C decode path, the GGUF kernel and its row thresholds);
`Backend` is built from it for one device and dtype, loads what it names (each C library is
built once per process: `executor_svc.cbuild`) and puts it to use on a model:

- `attention`: the attention backend every layer calls (`torch` on a CPU, `triton` on CUDA);
- `prepare(model)`: the model's elementwise ops (Triton's, or C for a float32 CPU model), the
  GGUF linears' row thresholds, and the decode step below where it applies;
- `forward(model, ...)`: a step, through the whole-step C decode path
  (`executor_svc.cpu_decode_path`) when the step is one it takes, else the model's modules.

The modules only take what they are given: none of them reads the environment. The
`PAGODA_*` switches that side-by-side runs set (bench/README.md) are read in one place,
`BackendOptions.from_env`, which the executor's CLI and `ModelRunner` use for their defaults.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping
from dataclasses import dataclass, fields

import torch

from executor_svc.attention import AttentionBackend, get_backend
from executor_svc.quant.gguf_linear import BF16_COPY_FUSED_MAX_ROWS, BF16_FUSED_MAX_ROWS, FUSED_MAX_ROWS

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class BackendOptions:
    """The executor's execution choices; the defaults are what measured fastest where it builds."""

    attention: str = "auto"  # "auto" (triton on CUDA, torch elsewhere), "torch" or "triton"
    kv_cache_dtype: str = "auto"  # "auto" (the model's dtype), "fp8", "fp8_e4m3" or "fp8_e5m2" (triton only)
    cpu_ops: bool = True  # RMSNorm, rotary, SiLU-and-mul as C calls on a CPU (csrc/cpu_ops.c; float32 modules, the decode path)
    cpu_decode_kernel: bool = True  # decode attention on a CPU through attention/csrc/paged_decode.c (else SDPA)
    cpu_decode_path: bool = True  # a GGUF model's decode steps as a row of C calls (cpu_decode_path.py)
    gguf_kernel: bool = True  # GGUF weights kept in their blocks on a CPU (else dequantized at load)
    gguf_fused_max_rows: int = FUSED_MAX_ROWS  # float32 x: above this many rows a GGUF linear dequantizes into a GEMM
    # bfloat16 x: the same, for weights of one dequantization tile; None: BF16_FUSED_MAX_ROWS, or
    # BF16_COPY_FUSED_MAX_ROWS with gguf_bf16_weights (a GEMM on the copy costs no dequantization)
    gguf_bf16_fused_max_rows: int | None = None
    # bfloat16 models: a bfloat16 copy of each GGUF weight beside its blocks, for the GEMM rows (batches,
    # prefill; 2 bytes a weight more), instead of dequantizing a tile per call
    gguf_bf16_weights: bool = False
    # opt-in, changes the numbers: Q5_0, Q4_K, Q6_K weights against x (decode steps and prompts) with each row of x
    # rounded to int8 per block of 32, multiplied as bytes (AVX2, or AVX-512 VNNI), as llama.cpp computes every GGUF type
    gguf_int8_activations: bool = False

    def __post_init__(self) -> None:
        for name in ("gguf_fused_max_rows", "gguf_bf16_fused_max_rows"):
            value = getattr(self, name)
            if value is None and name == "gguf_bf16_fused_max_rows":
                continue
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ValueError(f"{name}: expected an integer >= 0, got {value!r}")

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None, **overrides) -> BackendOptions:
        """The defaults, with the `PAGODA_*` switches of `environ` (os.environ) applied, then `overrides`.

        A switch that is not "0"/"1" (or not an integer, for the row thresholds) is refused by name.
        """
        environ = os.environ if environ is None else environ
        values: dict = {}
        for field, variable in ENV_SWITCHES.items():
            raw = environ.get(variable)
            if raw is None or raw == "":
                continue
            if field.endswith("_rows"):
                try:
                    values[field] = int(raw)
                except ValueError:
                    raise ValueError(f"{variable}={raw!r}: expected an integer") from None
            elif raw in ("0", "1"):
                values[field] = raw == "1"
            else:
                raise ValueError(f"{variable}={raw!r}: expected 0 or 1")
        values.update(overrides)
        return cls(**values)

    @property
    def bf16_fused_rows(self) -> int:
        """`gguf_bf16_fused_max_rows` as it applies (its default resolved)."""
        if self.gguf_bf16_fused_max_rows is not None:
            return self.gguf_bf16_fused_max_rows
        return BF16_COPY_FUSED_MAX_ROWS if self.gguf_bf16_weights else BF16_FUSED_MAX_ROWS

    def describe(self) -> str:
        """The fields that differ from the defaults, for the executor's start-up line."""
        default = BackendOptions()
        changed = [f"{f.name}={getattr(self, f.name)}" for f in fields(self) if getattr(self, f.name) != getattr(default, f.name)]
        return ", ".join(changed) or "defaults"


# field -> the environment switch of it ("0" turns a C path off; the row thresholds take integers)
ENV_SWITCHES = {
    "cpu_ops": "PAGODA_CPU_OPS",
    "cpu_decode_kernel": "PAGODA_CPU_DECODE_KERNEL",
    "cpu_decode_path": "PAGODA_CPU_DECODE_PATH",
    "gguf_kernel": "PAGODA_GGUF_KERNEL",
    "gguf_fused_max_rows": "PAGODA_GGUF_FUSED_MAX_ROWS",
    "gguf_bf16_fused_max_rows": "PAGODA_GGUF_BF16_FUSED_MAX_ROWS",
    "gguf_bf16_weights": "PAGODA_GGUF_BF16_WEIGHTS",  # (the executor's --gguf-bf16-weights)
    "gguf_int8_activations": "PAGODA_GGUF_INT8_ACTIVATIONS",  # (the executor's --gguf-int8-activations)
}


class Backend:
    """The execution choices of `options` for one model replica on `device` in `dtype`."""

    def __init__(self, options: BackendOptions, device: torch.device, dtype: torch.dtype) -> None:
        if options.gguf_bf16_weights and dtype != torch.bfloat16:
            raise ValueError(f"gguf_bf16_weights (--gguf-bf16-weights) needs --dtype bfloat16, not {dtype}")
        self.options = options
        self.device = device
        self.dtype = dtype
        on_cpu = device.type == "cpu"
        self.attention: AttentionBackend = get_backend(
            options.attention, device, options.kv_cache_dtype, decode_kernel=options.cpu_decode_kernel
        )
        self.cpu_ops = None  # csrc/cpu_ops.c's library, where this replica uses it
        if on_cpu and dtype in (torch.float32, torch.bfloat16) and options.cpu_ops and self.attention.name == "torch":
            from executor_svc.fused_ops import cpu_ops_library

            self.cpu_ops = cpu_ops_library()
        self.decode_step = None  # executor_svc.cpu_decode_path.CpuDecodePath, set by `prepare`

    @property
    def keeps_gguf_blocks(self) -> bool:
        """Whether GGUF weights may stay in their blocks here (the kernel is on and builds)."""
        if not (self.options.gguf_kernel and self.device.type == "cpu"):
            return False
        from executor_svc.quant.gguf_kernel import get_kernel

        return get_kernel() is not None

    def prepare(self, model) -> None:
        """Give `model` this backend's elementwise ops and GGUF thresholds, and build the decode step."""
        from executor_svc.quant.gguf_linear import GGUFLinear

        lookups_only = getattr(model.embed_tokens, "linear", None)  # a GGUFEmbedding's blocks: rows looked up
        if lookups_only is model.lm_head:
            lookups_only = None  # (tied: the LM head multiplies by them)
        if self.keeps_gguf_blocks:  # (process-wide in the kernel: this replica's choice)
            from executor_svc.quant.gguf_kernel import get_kernel

            kernel = get_kernel()
            if kernel.set_int8_activations(self.options.gguf_int8_activations) != self.options.gguf_int8_activations:
                raise ValueError("gguf_int8_activations (--gguf-int8-activations) needs a CPU with AVX2")
        for module in model.modules():
            if isinstance(module, GGUFLinear):
                if self.options.gguf_bf16_weights and module is not lookups_only:
                    module.keep_bf16_weight()
                module.set_row_thresholds(self.options.gguf_fused_max_rows, self.options.bf16_fused_rows)
        if self.attention.name == "triton":
            from executor_svc.fused_ops import triton_model_ops

            model.ops = triton_model_ops()
        elif self.cpu_ops is not None and self.dtype == torch.float32:  # (the C ops are float32 only)
            from executor_svc.fused_ops import cpu_model_ops

            model.ops = cpu_model_ops(self.cpu_ops)
        self.decode_step = None
        if self.cpu_ops is not None and self.options.cpu_decode_path:
            from executor_svc.cpu_decode_path import CpuDecodePath

            # up to the rows where the GGUF linears leave the fused kernel for a GEMM in the model's dtype
            bf16 = self.dtype == torch.bfloat16
            max_rows = self.options.bf16_fused_rows if bf16 else self.options.gguf_fused_max_rows
            self.decode_step = CpuDecodePath.build(model, self.attention, self.cpu_ops, max_rows)
        elif not self.options.cpu_decode_path:
            log.info("CPU decode path off (options: cpu_decode_path=False)")

    def forward(self, model, input_ids, positions, kv_caches, meta) -> tuple[torch.Tensor, torch.Tensor]:
        """(hidden, residual) of one step: the C decode step where it takes the step, else the modules."""
        step = self.decode_step
        if step is not None and step.model is model and step.attention is self.attention:
            out = step.forward(input_ids, positions, kv_caches, meta)
            if out is not None:
                return out
        return model(input_ids, positions, kv_caches, meta, self.attention)
