"""A decode step of a GGUF model on the CPU as a row of C calls: no torch op, no module call per layer.

At one token a layer's arithmetic is about 0.2 ms (mostly the four GGUF matmuls), and the
Python around it (module calls, views, splits, the attention backend's checks, KV writes by
`index_copy_`, ten tensor allocations) was another 0.1 ms: a third of the step on the
default model. Here each layer is ten ctypes calls on buffers allocated once per step:

    add+RMSNorm -> q/k/v matmul -> rotary (q into its own buffer, k in place) -> K/V into the
    paged cache -> decode attention -> o_proj -> add+RMSNorm -> gate/up -> SiLU-and-mul -> down

The C functions are the ones the module path calls (`csrc/cpu_ops.c`, the GGUF kernel, the
decode-attention kernel), in the same order on the same values, so the hidden states are the
same to the bit (tests/executor/test_cpu_decode_path.py). It takes a step only when every
token is a decode, at most `max_rows` of them (the GGUF linears' fused-kernel threshold: above
it they dequantize into a GEMM), and every slot is written; any other step
goes through the modules. The attention of a step with many keys is split over the torch
threads, as the module path does (`ONE_THREAD_KEYS`).

It is `executor_svc.backend.Backend`'s decode step, built from public handles: the GGUF
kernel's `matmul_fn`, the decode-attention kernel's `c_function`, the attention backend's
`step_layout` and the C ops' library.
"""

from __future__ import annotations

import ctypes
import logging
from dataclasses import dataclass

import torch

from executor_svc.attention.torch_backend import TorchBackend
from executor_svc.model import DecoderModel
from executor_svc.quant.gguf_linear import GGUFLinear

log = logging.getLogger(__name__)

# Up to this many keys attended in a step (all sequences together) the attention runs on the
# calling thread, one ctypes call; above it, through the kernel's wrapper, which splits the
# sequences over the torch threads (about 15 us more a layer, less than one thread's extra time).
ONE_THREAD_KEYS = 2048
F32 = 4  # bytes


@dataclass(frozen=True)
class _Linear:
    ggml_type: int
    weight: int  # data_ptr of the packed blocks
    row_bytes: int
    out_features: int
    in_features: int


def _linear(module) -> _Linear | None:
    if not isinstance(module, GGUFLinear) or len(module.types) != 1 or module.bias is not None:
        return None
    packed = module.packed0
    return _Linear(module.types[0], packed.data_ptr(), packed.shape[1], module.out_features, module.in_features)


class CpuDecodePath:
    def __init__(
        self, model: DecoderModel, attention: TorchBackend, library: ctypes.CDLL, layers: list[tuple], max_rows: int,
        norms: list[torch.Tensor],
    ) -> None:
        self.model = model
        self._norms = norms  # the float32 norm weights the layers' pointers read (copies, for a bfloat16 model)
        self.attention = attention
        self.max_rows = max_rows
        self._ops = library
        self._layers = layers  # per layer: (qkv, o, gate_up, down, input norm ptr, post-attention norm ptr)
        self._gguf = model.layers[0].qkv_proj.kernel.matmul_fn
        self._kernel = attention.decode_kernel
        # per cache dtype: (the C K/V write, the C decode attention)
        self._cache_calls = {
            torch.float32: (library.pagoda_write_kv, self._kernel.c_function(torch.float32)),
            torch.bfloat16: (library.pagoda_write_kv_bf16, self._kernel.c_function(torch.bfloat16)),
        }
        c = model.config
        # the GGUF kernel's scratch (x's block sums): one call at a time
        self._scratch = torch.empty(max_rows * max(c.hidden_size, c.intermediate_size) // 32, dtype=torch.float32)

    @classmethod
    def build(cls, model, attention, library: ctypes.CDLL, max_rows: int) -> CpuDecodePath | None:
        """The path for `model` through `attention`'s decode kernel and the C ops of `library`
        (`fused_ops.cpu_ops_library()`), or None where some part of it is not what the C calls expect.

        Only Llama-family models (`DecoderModel`) with full attention on every layer: the other
        families (`executor_svc.models.layers.FamilyDecoder`) and sliding windows go through the modules.

        A bfloat16 model (`--dtype bfloat16`) takes it too, computing in float32 as a float32 model
        does (its GGUF linears run the same float32 kernel at these row counts; the norm weights are
        float32 copies of its bfloat16 ones) and writing K/V into its bfloat16 cache rounded as torch
        rounds them: its decode steps are then as fast as float32's, slightly more precise than its
        modules (which round every activation to bfloat16), within the bound `tests/executor/test_bf16.py` checks.
        """
        c = model.config
        if type(model) is not DecoderModel or any(w is not None for w in c.layer_windows):
            return None
        if (
            library is None or model.device.type != "cpu" or model.dtype not in (torch.float32, torch.bfloat16)
            or model.tp.size != 1 or model.rotary_cos.dtype != torch.float32
            or not isinstance(attention, TorchBackend) or attention.decode_kernel is None
            or c.head_dim % 2 or c.num_heads % c.num_kv_heads or max_rows < 1
        ):
            return None
        shapes = (  # (in, out) of q/k/v, o, gate/up, down
            (c.hidden_size, c.q_size + 2 * c.kv_size), (c.q_size, c.hidden_size),
            (c.hidden_size, 2 * c.intermediate_size), (c.intermediate_size, c.hidden_size),
        )
        layers, kept = [], []
        for layer in model.layers:
            linears = [_linear(getattr(layer, name)) for name in ("qkv_proj", "o_proj", "gate_up_proj", "down_proj")]
            if any(x is None or (x.in_features, x.out_features) != shape for x, shape in zip(linears, shapes)):
                return None
            norms = [w.detach().float().contiguous() for w in (layer.input_layernorm.weight, layer.post_attention_layernorm.weight)]
            kept += norms
            layers.append((*linears, norms[0].data_ptr(), norms[1].data_ptr()))
        log.info("CPU decode path: %d layers as C calls (%s model)", len(layers), model.dtype)
        return cls(model, attention, library, layers, max_rows, kept)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_caches, meta) -> tuple | None:
        """(hidden, residual) as `DecoderModel.forward` returns them, or None: this step is not for this path."""
        rows = input_ids.shape[0]
        if rows > self.max_rows or meta.max_query_len != 1:
            return None
        attention = self.attention
        k_cache0 = kv_caches[0][0]
        block_size = k_cache0.shape[1]
        layout = attention.step_layout(meta, block_size)
        if layout.write_rows is not None or len(layout.groups) != 1:
            return None
        group = layout.groups[0]
        calls = self._cache_calls.get(k_cache0.dtype)
        if group.kernel_lens is None or group.token_rows != slice(None) or calls is None:
            return None
        write_kv, attend = calls
        model, c = self.model, self.model.config
        q_size, kv_size, inter, hid = c.q_size, c.kv_size, c.intermediate_size, c.hidden_size
        qkv_width = q_size + 2 * kv_size
        eps = c.rms_norm_eps

        residual = model.embed_tokens(input_ids).float()  # [T, hidden], fresh: it becomes the residual stream
        if not residual.is_contiguous():
            return None
        cos = model.rotary_cos.index_select(0, positions)
        sin = model.rotary_sin.index_select(0, positions)
        hidden = torch.empty(rows, hid)
        normed = torch.empty(rows, hid)
        qkv = torch.empty(rows, qkv_width)
        q = torch.empty(rows, q_size)
        attn = torch.empty(rows, q_size)
        gate_up = torch.empty(rows, 2 * inter)
        act = torch.empty(rows, inter)
        scratch = torch.empty(c.num_heads * (block_size + 2))
        slots = layout.write_slots
        table, lens = group.block_table, group.kernel_lens
        if slots.dtype != torch.int64 or not slots.is_contiguous() or table.stride(1) != 1:
            return None

        ops, gguf = self._ops, self._gguf
        rms_norm, add_rms_norm = ops.pagoda_rms_norm, ops.pagoda_add_rms_norm
        rotary, silu_and_mul = ops.pagoda_rotary_neox, ops.pagoda_silu_and_mul
        R, H, N = residual.data_ptr(), hidden.data_ptr(), normed.data_ptr()
        QKV, Q, A, GU, ACT = qkv.data_ptr(), q.data_ptr(), attn.data_ptr(), gate_up.data_ptr(), act.data_ptr()
        K, V = QKV + q_size * F32, QKV + (q_size + kv_size) * F32
        COS, SIN, SLOTS, S = cos.data_ptr(), sin.data_ptr(), slots.data_ptr(), self._scratch.data_ptr()
        TABLE, TABLE_STRIDE, LENS, SCRATCH = table.data_ptr(), table.stride(0), lens.data_ptr(), scratch.data_ptr()
        heads, kv_heads, head_dim, scale = c.num_heads, c.num_kv_heads, c.head_dim, model.layers[0].scale
        num_seqs = lens.shape[0]
        one_thread = meta.max_seq_len * num_seqs <= ONE_THREAD_KEYS
        kernel, split = self._kernel, group.kernel_split
        q_heads = q.view(rows, heads, head_dim)

        for i, ((qkv_w, o_w, gu_w, down_w, norm1, norm2), (k_cache, v_cache)) in enumerate(
            zip(self._layers, kv_caches, strict=True)
        ):
            KC, VC = k_cache.data_ptr(), v_cache.data_ptr()
            if i == 0:
                rms_norm(R, hid, norm1, N, rows, hid, eps)
            else:
                add_rms_norm(H, hid, R, hid, norm1, N, R, rows, hid, eps)
            gguf(qkv_w.ggml_type, qkv_w.weight, qkv_w.row_bytes, qkv_width, hid, N, rows, S, QKV)
            rotary(QKV, qkv_width, Q, q_size, rows, heads, head_dim, COS, SIN)
            rotary(K, qkv_width, K, qkv_width, rows, kv_heads, head_dim, COS, SIN)
            write_kv(K, V, qkv_width, KC, VC, SLOTS, rows, kv_size)
            if one_thread:
                attend(Q, KC, VC, TABLE, TABLE_STRIDE, LENS, A, SCRATCH, heads, kv_heads, head_dim, block_size, scale, 0, num_seqs)
                out = A
            else:
                # (split_out stays alive until o_proj has read it)
                split_out = kernel(q_heads, k_cache, v_cache, table, lens, scale, split)
                out = split_out.data_ptr()
            gguf(o_w.ggml_type, o_w.weight, o_w.row_bytes, hid, q_size, out, rows, S, H)
            add_rms_norm(H, hid, R, hid, norm2, N, R, rows, hid, eps)
            gguf(gu_w.ggml_type, gu_w.weight, gu_w.row_bytes, 2 * inter, hid, N, rows, S, GU)
            silu_and_mul(GU, rows, inter, ACT)
            gguf(down_w.ggml_type, down_w.weight, down_w.row_bytes, hid, inter, ACT, rows, S, H)
        return hidden, residual
