"""A decode step of a GGUF model on the CPU as a row of C calls: no torch op, no module call per layer.

At one token a layer's arithmetic is about 0.2 ms (mostly the four GGUF matmuls), and the
Python around it (module calls, views, splits, the attention backend's checks, KV writes by
`index_copy_`, ten tensor allocations) was another 0.1 ms: a third of the step on the
default model. Here each layer is ten ctypes calls on buffers allocated once per step:

    add+RMSNorm -> q/k/v matmul -> rotary (q into its own buffer, k in place) -> K/V into the
    paged cache -> decode attention -> o_proj -> add+RMSNorm -> gate/up -> SiLU-and-mul -> down

and where the attention kernel has one entry for a whole step's sequences (its OpenMP team's, or
one thread's) all the layers' calls are made from C, in one ctypes call a step
(`pagoda_decode_layers` in csrc/cpu_ops.c, the same calls in the same order): each ctypes call
cost a microsecond or more of argument conversion, about 0.4 ms a step on Gemma 3's 18 layers.

The C functions are the ones the module path calls (`csrc/cpu_ops.c`, the GGUF kernel, the
decode-attention kernel), in the same order on the same values, so the hidden states are the
same to the bit (tests/executor/test_cpu_decode_path.py). It takes a step only when every
token is a decode, at most `max_rows` of them (the GGUF linears' fused-kernel threshold: above
it they dequantize into a GEMM), and every slot is written; any other step
goes through the modules. Rows of LoRA adapters (`executor_svc.lora`) take it too, in the one-call
form: after each projection, each adapter group's delta from the same float32 A and per-slice B
(csrc/cpu_ops.c's `lora_deltas`: x A.T for all the group's rows, then each slice's B.T into its
columns, split over the OpenMP team where cpu_ops shares torch's), the modules' numbers but for
float32 summation order. The attention runs on torch's OpenMP team where the kernel shares it
(`parts_function`: whole sequences, and a long one split into parts, over every thread, as
the module path's kernel call does); else on the calling thread, or split over the torch
threads above `ONE_THREAD_KEYS`.

It is `executor_svc.backend.Backend`'s decode step, built from public handles: the GGUF
kernel's `matmul_fn`, the decode-attention kernel's `parts_function` / `c_function`, the attention backend's
`step_layout` and the C ops' library.
"""

from __future__ import annotations

import ctypes
import logging
from dataclasses import dataclass

import numpy as np
import torch

from executor_svc.attention.torch_backend import TorchBackend
from executor_svc.model import DecoderModel
from executor_svc.quant.gguf_linear import GGUFLinear

log = logging.getLogger(__name__)

# Without the kernel's OpenMP entry: up to this many keys attended in a step (all sequences together) the
# attention runs on the calling thread, one ctypes call; above it, through the kernel's wrapper, which splits the
# sequences over the torch threads (about 15 us more a layer, less than one thread's extra time).
ONE_THREAD_KEYS = 2048
F32 = 4  # bytes
MAX_SEGMENTS = 4  # of a merged projection, in the one-call step (csrc/cpu_ops.c's PAGODA_MAX_SEGMENTS)

_i64 = ctypes.c_int64


class _CLinear(ctypes.Structure):  # csrc/cpu_ops.c: pagoda_linear_t
    _fields_ = [("segments", _i64), ("out", _i64), ("in_", _i64), ("type", _i64 * MAX_SEGMENTS),
                ("weight", _i64 * MAX_SEGMENTS), ("row_bytes", _i64 * MAX_SEGMENTS), ("rows", _i64 * MAX_SEGMENTS)]


class _CLayer(ctypes.Structure):  # pagoda_layer_t
    _fields_ = [("qkv", _CLinear), ("o", _CLinear), ("gate_up", _CLinear), ("down", _CLinear), ("norms", _i64 * 4),
                ("q_norm", _i64), ("k_norm", _i64), ("gelu", _i64), ("local_rope", _i64), ("window", _i64),
                ("k_cache", _i64), ("v_cache", _i64), ("scale", ctypes.c_float)]


class _CStep(ctypes.Structure):  # pagoda_step_t
    _fields_ = [(name, _i64) for name in (
        "rows", "hidden", "q_size", "kv_size", "inter", "heads", "kv_heads", "head_dim", "block_size", "kv_bf16",
        "threads", "sandwich", "matmul", "attend", "residual", "hidden_out", "normed", "qkv", "q", "attn", "gate_up",
        "act", "side", "xs", "scratch", "scratch_stride", "cos", "sin", "local_cos", "local_sin",
        "lora_groups", "lora_tables", "lora_start", "lora_rows", "lora_t", "lora_rank", "lora_threads",
    )] + [("eps", ctypes.c_float)]


LORA_PARTS = 4  # csrc/cpu_ops.c's PAGODA_LORA_PARTS


class _CLora(ctypes.Structure):  # pagoda_lora_t: one adapter's delta on one projection (lora.LoraDelta)
    _fields_ = [("rank", _i64), ("a", _i64), ("parts", _i64)] + [
        (name, _i64 * LORA_PARTS) for name in ("first_rank", "part_rank", "first_col", "cols", "bt")]


class _CLoraLayer(ctypes.Structure):  # pagoda_lora_layer_t
    _fields_ = [("qkv", _CLora), ("o", _CLora), ("gate_up", _CLora), ("down", _CLora)]


def _c_lora(delta) -> _CLora:
    """A `lora.LoraDelta` (or None: no delta) as the C structure (pointers into its tensors)."""
    c = _CLora()
    if delta is None:
        return c
    c.rank, c.a, c.parts = delta.a.shape[0], delta.a.data_ptr(), len(delta.parts)
    for i, p in enumerate(delta.parts):
        c.first_rank[i], c.part_rank[i], c.first_col[i], c.cols[i], c.bt[i] = (
            p.first_rank, p.rank, p.first_col, p.cols, p.bt.data_ptr())
    return c


def _c_linear(linear: _Linear) -> _CLinear:
    c = _CLinear(segments=len(linear.segments), out=linear.out_features, in_=linear.in_features)
    for i, (ggml_type, weight, row_bytes, rows) in enumerate(linear.segments):
        c.type[i], c.weight[i], c.row_bytes[i], c.rows[i] = ggml_type, weight, row_bytes, rows
    return c


def _rows(table: torch.Tensor, positions: torch.Tensor, at: int | None) -> torch.Tensor:
    """The rotary table's rows of the step's positions: at one token (`at`), a view of its row rather than
    an index_select (a dispatched op, one of several a step)."""
    if at is not None and 0 <= at < table.shape[0]:
        return table[at : at + 1]
    return table.index_select(0, positions)


@dataclass(frozen=True)
class _Linear:
    segments: tuple[tuple[int, int, int, int], ...]  # (ggml_type, data_ptr of the packed blocks, row_bytes, rows)
    out_features: int
    in_features: int
    module: GGUFLinear  # above `max_rows` rows: its own forward (the GEMM the modules run)


def _linear(module) -> _Linear | None:
    module = getattr(module, "base", module)  # a LoRA-wrapped projection's own weights (its deltas: `_set_lora`)
    if not isinstance(module, GGUFLinear) or module.bias is not None:
        return None
    segments = tuple((t, p.data_ptr(), p.shape[1], p.shape[0]) for t, p in module.segments)
    return _Linear(segments, module.out_features, module.in_features, module)


@dataclass(frozen=True)
class _Layer:
    qkv: _Linear
    o: _Linear
    gate_up: _Linear
    down: _Linear
    norms: tuple[int, ...]  # float32 weights: input, post-attention (+ pre- and post-feedforward: sandwich)
    qk_norms: tuple[int, int] | None  # q_norm, k_norm over head_dim (Qwen3, Gemma 3)
    gelu: bool  # GeGLU (tanh approximation), else SwiGLU
    local_rope: bool  # Gemma 3's sliding layers: their own rotary tables
    window: int  # a sliding layer's window (the attention reads its keys only), 0 for a global layer
    scale: float


class CpuDecodePath:
    def __init__(
        self, model, attention: TorchBackend, library: ctypes.CDLL, layers: list[_Layer], max_rows: int,
        norms: list[torch.Tensor], sandwich: bool,
    ) -> None:
        self.model = model
        self._norms = norms  # the float32 norm weights the layers' pointers read (copies where not float32 already)
        self.attention = attention
        self.max_rows = max_rows
        self.sandwich = sandwich
        self._ops = library
        self._layers = layers
        kernel = next(m for m in model.modules() if isinstance(m, GGUFLinear)).kernel
        self._gguf, self._gguf_strided = kernel.matmul_fn, kernel.matmul_strided_fn
        self._kernel = attention.decode_kernel
        # on torch's OpenMP team: every step's attention over all threads (a long sequence split into parts)
        self._parts = self._kernel.parts_function
        # per cache dtype: (the C K/V write, the C decode attention)
        self._cache_calls = {
            torch.float32: (library.pagoda_write_kv, self._kernel.c_function(torch.float32)),
            torch.bfloat16: (library.pagoda_write_kv_bf16, self._kernel.c_function(torch.bfloat16)),
        }
        c = model.config
        # the whole step's layers in one C call (pagoda_decode_layers), where the attention takes one entry
        self._one_call = None
        step_attend = self._kernel.step_function
        if step_attend is not None and all(len(x.segments) <= MAX_SEGMENTS for layer in layers
                                           for x in (layer.qkv, layer.o, layer.gate_up, layer.down)):
            self._one_call = library.pagoda_decode_layers
            self._one_call.argtypes = [ctypes.c_void_p, _i64, ctypes.c_void_p, ctypes.c_void_p]
            self._one_call.restype = None
            self._c_layers = (_CLayer * len(layers))(*[
                _CLayer(qkv=_c_linear(x.qkv), o=_c_linear(x.o), gate_up=_c_linear(x.gate_up), down=_c_linear(x.down),
                        norms=(_i64 * 4)(*x.norms, *[0] * (4 - len(x.norms))),
                        q_norm=x.qk_norms[0] if x.qk_norms else 0, k_norm=x.qk_norms[1] if x.qk_norms else 0,
                        gelu=int(x.gelu), local_rope=int(x.local_rope), window=x.window, scale=x.scale)
                for x in layers
            ])
            self._c_step = _CStep(
                hidden=c.hidden_size, q_size=c.q_size, kv_size=c.kv_size, inter=c.intermediate_size, heads=c.num_heads,
                kv_heads=c.num_kv_heads, head_dim=c.head_dim, threads=self._kernel.num_threads, sandwich=int(sandwich),
                matmul=ctypes.cast(self._gguf_strided, ctypes.c_void_p).value,
                attend=ctypes.cast(step_attend, ctypes.c_void_p).value, eps=c.rms_norm_eps,
            )
            self._cache_list, self._cache_ptrs = None, None  # the K/V caches the layers' structures hold
            from executor_svc.fused_ops import cpu_ops_library, cpu_ops_openmp

            # the LoRA deltas over the OpenMP team where this library shares torch's (as the GGUF kernel and the attention do)
            self._c_step.lora_threads = self._kernel.num_threads if library is cpu_ops_library() and cpu_ops_openmp() else 1
        # LoRA adapters (executor_svc.lora): per adapter id, its deltas as one pagoda_lora_layer_t a layer, and
        # the largest rank of a projection; rebuilt where adapters were loaded or unloaded since (LoraState.version)
        self._lora_tables: dict[int, tuple[ctypes.Array, int]] = {}
        self._lora_version = -1
        self._lora_t = torch.empty(0)  # the shrink's scratch (rows * rank floats), grown as needed
        self._lora_step = None  # the step's arrays the C call reads (kept alive until the next step)
        scale = c.embed_scale  # Gemma's, in the model's dtype as the modules scale it
        self._embed_scale = None if scale is None else torch.tensor(scale, dtype=model.dtype)
        self._dtype = model.dtype
        self._buffers: dict[int, tuple] = {}  # per row count: the step's working buffers, reused step after step
        self._local_rope = any(layer.local_rope for layer in layers)
        # the GGUF kernel's scratch (x's block sums): one call at a time
        self._scratch = torch.empty(max_rows * max(c.hidden_size, c.intermediate_size, c.q_size) // 32, dtype=torch.float32)

    @classmethod
    def build(cls, model, attention, library: ctypes.CDLL, max_rows: int) -> CpuDecodePath | None:
        """The path for `model` through `attention`'s decode kernel and the C ops of `library`
        (`fused_ops.cpu_ops_library()`), or None where some part of it is not what the C calls expect.

        Every dense family whose layers the C ops cover: Llama, Mistral, Qwen2, Qwen3 (q/k norms),
        Phi-3 (merged projections as stored), Gemma 3 (Gemma's 1 + w norms as float32 weights,
        sandwich norms, GeGLU, the embedding scale, its sliding layers' own rotary tables).
        Declined at build: mixture-of-experts layers, attention soft caps (Gemma 2), partial
        rotary, biases. A sliding layer's attention reads its window's keys only (the decode
        kernel's `window`), as the modules' do.

        A bfloat16 model (`--dtype bfloat16`) takes it too, computing in float32 as a float32 model
        does (its GGUF linears run the same float32 kernel at these row counts; the norm weights are
        float32 copies of its bfloat16 ones) and writing K/V into its bfloat16 cache rounded as torch
        rounds them: its decode steps are then as fast as float32's, slightly more precise than its
        modules (which round every activation to bfloat16), within the bound `tests/executor/test_bf16.py` checks.
        """
        from executor_svc.model import GatedMLP

        c = model.config
        if type(model) is not DecoderModel:
            return None
        if (
            library is None or model.device.type != "cpu" or model.dtype not in (torch.float32, torch.bfloat16)
            or model.tp.size != 1 or model.rotary_cos.dtype != torch.float32
            or not isinstance(attention, TorchBackend) or attention.decode_kernel is None
            or c.head_dim % 2 or c.num_heads % c.num_kv_heads or max_rows < 1
            or c.attn_logit_softcap is not None or c.rotary_dim not in (None, c.head_dim)
            or c.hidden_act not in ("silu", "gelu_pytorch_tanh", "gelu_tanh")
        ):
            return None
        shapes = (  # (in, out) of q/k/v, o, gate/up, down
            (c.hidden_size, c.q_size + 2 * c.kv_size), (c.q_size, c.hidden_size),
            (c.hidden_size, 2 * c.intermediate_size), (c.intermediate_size, c.hidden_size),
        )
        kept: list[torch.Tensor] = []

        def norm_ptr(norm) -> int:
            w = norm.weight.detach().float()
            w = (1.0 + w) if c.gemma_norm else w.contiguous()  # Gemma's scale 1 + w, added in float32 as its norm does
            kept.append(w)
            return w.data_ptr()

        layers = []
        for layer in model.layers:
            attn, mlp = layer.self_attn, layer.mlp
            if type(mlp) is not GatedMLP:
                return None
            linears = [_linear(getattr(owner, name)) for owner, name in
                       ((attn, "qkv_proj"), (attn, "o_proj"), (mlp, "gate_up_proj"), (mlp, "down_proj"))]
            if any(x is None or (x.in_features, x.out_features) != shape for x, shape in zip(linears, shapes)):
                return None
            names = ["input_layernorm", "post_attention_layernorm"]
            if c.sandwich_norms:
                names += ["pre_feedforward_layernorm", "post_feedforward_layernorm"]
            norms = tuple(norm_ptr(getattr(layer, name)) for name in names)
            qk = (norm_ptr(attn.q_norm), norm_ptr(attn.k_norm)) if c.qk_norm else None
            layers.append(_Layer(
                *linears, norms=norms, qk_norms=qk, gelu=c.hidden_act != "silu",
                local_rope=layer.local_rope, window=layer.sliding_window or 0,
                scale=attn.scale,
            ))
        log.info("CPU decode path: %d layers as C calls (%s, %s)", len(layers), c.architecture, model.dtype)
        return cls(model, attention, library, layers, max_rows, kept, c.sandwich_norms)

    def _matmul(self, linear: _Linear, x: torch.Tensor, rows: int, y: torch.Tensor) -> None:
        """y [rows, out] = x [rows, in] @ W.T (float32 buffers). Up to `max_rows` rows: the fused
        kernel, one C call a segment (a merged projection's parts of other types write their
        columns); above: the linear's own forward on x in the model's dtype (the GEMM its module
        runs at that many rows: dequantized tiles, or a bfloat16 copy of the weights), copied into y."""
        if rows > self.max_rows:
            y.copy_(linear.module(x if self._dtype == torch.float32 else x.to(self._dtype)))
            return
        x, y = x.data_ptr(), y.data_ptr()
        if len(linear.segments) == 1:
            ggml_type, weight, row_bytes, _ = linear.segments[0]
            self._gguf(ggml_type, weight, row_bytes, linear.out_features, linear.in_features, x, rows, self._scratch_ptr, y)
            return
        start = 0
        for ggml_type, weight, row_bytes, n in linear.segments:
            self._gguf_strided(ggml_type, weight, row_bytes, n, linear.in_features, x, rows, self._scratch_ptr,
                               y + start * F32, linear.out_features)
            start += n

    def _layout(self, meta, block_size: int):
        """(slots, table, lens, group) of a decode-only step the C calls take, or None (group: None
        where the attention runs on the kernel's OpenMP entry, which splits the work itself)."""
        if self._one_call is not None and self._parts is not None:
            fast = self.attention.decode_arguments(meta, block_size)
            if fast is not None:
                return (*fast, None)
        layout = self.attention.step_layout(meta, block_size)
        if layout.write_rows is not None or len(layout.groups) != 1:
            return None
        group = layout.groups[0]
        if group.kernel_lens is None or group.token_rows != slice(None):
            return None
        slots, table = layout.write_slots, group.block_table
        if slots.dtype != torch.int64 or not slots.is_contiguous() or table.stride(1) != 1:
            return None
        return slots, table, group.kernel_lens, group

    def _one_step(self, rows, block_size, kv_bf16, kv_caches, metas, layouts, buffers, tables) -> None:
        """Every layer in one C call (`pagoda_decode_layers`: forward's loop below, call for call)."""
        step = self._c_step
        # the layers' structures hold the caches' addresses: set again where the caches are not the last step's
        # (the runner's list, allocated once; its tensors' addresses checked at both ends)
        ends = (kv_caches[0][0].data_ptr(), kv_caches[-1][1].data_ptr())
        if kv_caches is not self._cache_list or ends != self._cache_ptrs:
            ptrs = [t.data_ptr() for kv in kv_caches for t in kv]
            for layer, k_cache, v_cache in zip(self._c_layers, ptrs[::2], ptrs[1::2], strict=True):
                layer.k_cache, layer.v_cache = k_cache, v_cache
            self._cache_list, self._cache_ptrs = kv_caches, ends
        step.rows, step.block_size, step.kv_bf16 = rows, block_size, kv_bf16
        (step.residual, step.hidden_out, step.normed, step.qkv, step.q, step.attn, step.gate_up, step.act, step.side,
         step.xs, step.scratch) = (0 if b is None else b.data_ptr() for b in buffers)
        step.scratch_stride = buffers[-1].stride(0)
        step.cos, step.sin = (t.data_ptr() for t in tables[False])
        if True in tables:
            step.local_cos, step.local_sin = (t.data_ptr() for t in tables[True])
        # each layer's group's (slots, table, table stride, lens, sequences), one row per distinct meta
        index = {key: i for i, key in enumerate(layouts)}
        rows_of = np.array([(slots.data_ptr(), table.data_ptr(), table.stride(0), lens.data_ptr(), lens.shape[0])
                            for slots, table, lens, _ in layouts.values()], dtype=np.int64)
        per_layer = rows_of[[index[id(m)] for m in metas]]  # [layers, 5], contiguous
        self._one_call(self._c_layers, len(self._c_layers), ctypes.byref(step), per_layer.ctypes.data)

    def _lora_table(self, adapter: int) -> tuple[ctypes.Array, int]:
        """The C deltas of adapter id `adapter` on every layer (its `LoraLinear`s' `LoraDelta`s), and its largest rank."""
        table = self._lora_tables.get(adapter)
        if table is None:
            layers, rank = [], 0
            for layer in self.model.layers:
                attn, mlp = layer.self_attn, layer.mlp
                deltas = [getattr(m, "adapters", {}).get(adapter) for m in
                          (attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj)]
                rank = max([rank] + [d.a.shape[0] for d in deltas if d is not None])
                layers.append(_CLoraLayer(*[_c_lora(d) for d in deltas]))
            table = self._lora_tables[adapter] = ((_CLoraLayer * len(layers))(*layers), rank)
        return table

    def _set_lora(self, lora, rows: int) -> bool:
        """The step's adapter groups into the step structure (lora: the model's LoraState, or None); False:
        rows of an adapter this path cannot take (the modules add their deltas)."""
        step = self._c_step
        step.lora_groups = 0
        self._lora_step = None
        if lora is None or not lora.active:
            return True
        token_adapters = lora.token_adapters
        if lora.meta is not None or token_adapters is None or token_adapters.shape[0] != rows:
            return False
        if lora.version != self._lora_version:  # adapters loaded or unloaded: their tables anew
            self._lora_tables.clear()
            self._lora_version = lora.version
        taken = np.flatnonzero(token_adapters >= 0)
        ids = token_adapters[taken]
        order = np.argsort(ids, kind="stable")
        adapters, counts = np.unique(ids, return_counts=True)
        tables = [self._lora_table(int(a)) for a in adapters.tolist()]
        rank = max(t[1] for t in tables)
        if self._lora_t.numel() < rows * rank:
            self._lora_t = torch.empty(rows * rank)
        pointers = np.array([ctypes.addressof(t[0]) for t in tables], dtype=np.int64)
        start = np.zeros(len(tables) + 1, dtype=np.int64)
        np.cumsum(counts, out=start[1:])
        grouped_rows = np.ascontiguousarray(taken[order], dtype=np.int64)
        self._lora_step = (pointers, start, grouped_rows, tables)
        step.lora_groups = len(tables)
        step.lora_tables, step.lora_start, step.lora_rows = (a.ctypes.data for a in (pointers, start, grouped_rows))
        step.lora_t, step.lora_rank = self._lora_t.data_ptr(), rank
        return True

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_caches, meta) -> tuple | None:
        """(hidden, residual) as the model's forward returns them, or None: this step is not for this path.

        `meta`: one for every layer, or one per layer (each layer's KV cache group's). Rows of LoRA
        adapters take their deltas inside the one-call step (`lora_deltas` after each projection);
        the per-layer loop of C calls (no one-call step, or more than `max_rows` rows) leaves such a
        step to the modules."""
        rows = input_ids.shape[0]
        lora = self.model.lora
        if lora is not None and lora.active and (self._one_call is None or rows > self.max_rows):
            return None
        metas = meta if isinstance(meta, tuple) else (meta,) * len(self._layers)
        first = metas[0]
        if first.max_query_len != 1:
            return None
        k_cache0 = kv_caches[0][0]
        block_size = k_cache0.shape[1]
        calls = self._cache_calls.get(k_cache0.dtype)
        if calls is None:
            return None
        write_kv, attend = calls
        kv_bf16 = int(k_cache0.dtype == torch.bfloat16)
        layouts = {}
        for m in metas:
            if id(m) not in layouts:
                layouts[id(m)] = self._layout(m, block_size)
                if layouts[id(m)] is None or m.max_query_len != 1:
                    return None
        model, c = self.model, self.model.config
        q_size, kv_size, inter, hid = c.q_size, c.kv_size, c.intermediate_size, c.hidden_size
        qkv_width = q_size + 2 * kv_size
        eps = c.rms_norm_eps

        embedded = model.embed_tokens(input_ids)
        if self._embed_scale is not None:  # in the model's dtype, as the modules scale it
            embedded = embedded * self._embed_scale
        residual = embedded.float()  # [T, hidden], fresh: it becomes the residual stream
        if not residual.is_contiguous():
            return None
        at = int(positions[0]) if rows == 1 else None
        tables = {False: (_rows(model.rotary_cos, positions, at), _rows(model.rotary_sin, positions, at))}
        if self._local_rope:
            tables[True] = (_rows(model.local_cos, positions, at), _rows(model.local_sin, positions, at))
        hidden = torch.empty(rows, hid)  # (fresh, as the residual: both are returned)
        kernel_threads = self._kernel.num_threads
        buffers = self._buffers.get(rows)
        if buffers is None or buffers[-1].shape[1] < self._kernel.scratch_floats(c.num_heads, block_size):
            if len(self._buffers) > 8:  # (row counts come and go: keep a few)
                self._buffers.clear()
            buffers = self._buffers[rows] = (
                torch.empty(rows, hid),  # normed
                torch.empty(rows, qkv_width),
                torch.empty(rows, q_size),  # q
                torch.empty(rows, q_size),  # attn
                torch.empty(rows, 2 * inter),  # gate_up
                torch.empty(rows, inter),  # act
                torch.empty(rows, hid) if self.sandwich else None,  # side: a sandwich norm's output
                torch.empty(kernel_threads, self._kernel.scratch_floats(c.num_heads, block_size)),  # scratch
            )
        normed, qkv, q, attn, gate_up, act, side, scratch = buffers
        if self._one_call is not None and rows <= self.max_rows:
            if not self._set_lora(lora, rows):
                return None
            self._one_step(rows, block_size, kv_bf16, kv_caches, metas, layouts, (
                residual, hidden, normed, qkv, q, attn, gate_up, act, side, self._scratch, scratch), tables)
            return hidden, residual
        self._scratch_ptr = self._scratch.data_ptr()

        ops, matmul = self._ops, self._matmul
        rms_norm, add_rms_norm = ops.pagoda_rms_norm, ops.pagoda_add_rms_norm
        rotary, silu_and_mul, gelu_and_mul = ops.pagoda_rotary_neox, ops.pagoda_silu_and_mul, ops.pagoda_gelu_tanh_and_mul
        rms_norm_heads = ops.pagoda_rms_norm_heads
        R, H, N = residual.data_ptr(), hidden.data_ptr(), normed.data_ptr()
        QKV, Q, A, GU, ACT = qkv.data_ptr(), q.data_ptr(), attn.data_ptr(), gate_up.data_ptr(), act.data_ptr()
        SIDE = side.data_ptr() if side is not None else 0
        K, V = QKV + q_size * F32, QKV + (q_size + kv_size) * F32
        ROPE = {local: (cos.data_ptr(), sin.data_ptr()) for local, (cos, sin) in tables.items()}
        SCRATCH = scratch.data_ptr()
        heads, kv_heads, head_dim = c.num_heads, c.num_kv_heads, c.head_dim
        kernel = self._kernel
        q_heads = q.view(rows, heads, head_dim)
        sandwich = self.sandwich

        for i, (layer, (k_cache, v_cache), m) in enumerate(zip(self._layers, kv_caches, metas, strict=True)):
            slots, table, lens, group = layouts[id(m)]
            num_seqs = lens.shape[0]
            KC, VC = k_cache.data_ptr(), v_cache.data_ptr()
            norms = layer.norms
            if i == 0:
                rms_norm(R, hid, norms[0], N, rows, hid, eps)
            else:
                add_rms_norm(H, hid, R, hid, norms[0], N, R, rows, hid, eps)
            matmul(layer.qkv, normed, rows, qkv)
            if layer.qk_norms is not None:
                rms_norm_heads(QKV, qkv_width, heads, head_dim, layer.qk_norms[0], rows, eps)
                rms_norm_heads(K, qkv_width, kv_heads, head_dim, layer.qk_norms[1], rows, eps)
            COS, SIN = ROPE[layer.local_rope]
            rotary(QKV, qkv_width, Q, q_size, rows, heads, head_dim, COS, SIN)
            rotary(K, qkv_width, K, qkv_width, rows, kv_heads, head_dim, COS, SIN)
            write_kv(K, V, qkv_width, KC, VC, slots.data_ptr(), rows, kv_size)
            if self._parts is not None:
                self._parts(Q, KC, VC, table.data_ptr(), table.stride(0), lens.data_ptr(), A, SCRATCH,
                            scratch.stride(0), heads, kv_heads, head_dim, block_size, layer.scale, num_seqs,
                            kernel_threads, kv_bf16, layer.window)
                out = attn
            elif m.max_seq_len * num_seqs <= ONE_THREAD_KEYS:
                attend(Q, KC, VC, table.data_ptr(), table.stride(0), lens.data_ptr(), A, SCRATCH, heads, kv_heads,
                       head_dim, block_size, layer.scale, 0, num_seqs, layer.window)
                out = attn
            else:
                # (split_out stays alive until o_proj has read it)
                split_out = kernel(q_heads, k_cache, v_cache, table, lens, layer.scale, group.kernel_split,
                                   window=layer.window or None)
                out = split_out.view(rows, q_size)
            matmul(layer.o, out, rows, hidden)
            if sandwich:  # x = x + post_attention_norm(h); the MLP reads pre_feedforward_norm(x)
                rms_norm(H, hid, norms[1], SIDE, rows, hid, eps)
                add_rms_norm(SIDE, hid, R, hid, norms[2], N, R, rows, hid, eps)
            else:
                add_rms_norm(H, hid, R, hid, norms[1], N, R, rows, hid, eps)
            matmul(layer.gate_up, normed, rows, gate_up)
            (gelu_and_mul if layer.gelu else silu_and_mul)(GU, rows, inter, ACT)
            if sandwich:  # the layer's hidden output: post_feedforward_norm(mlp)
                matmul(layer.down, act, rows, side)
                rms_norm(SIDE, hid, norms[3], H, rows, hid, eps)
            else:
                matmul(layer.down, act, rows, hidden)
        if rows > self.max_rows and self._dtype != torch.float32:
            # the final norm and the LM head at this many rows: a GEMM in the model's dtype, as the modules run them
            return hidden.to(self._dtype), residual.to(self._dtype)
        return hidden, residual
