"""LoRA adapters beside one copy of the base weights: PEFT folders, many in one step.

An adapter is a PEFT folder (`adapter_config.json` + `adapter_model.safetensors`): for some of
the projections q/k/v/o and gate/up/down, two matrices A [r, in] and B [out, r] whose product,
scaled, is added to the projection's output: `y = W x + (B (A x)) * scale`, with
`scale = lora_alpha / r` (rsLoRA: `lora_alpha / sqrt(r)`; `rank_pattern` / `alpha_pattern`
per module, as PEFT reads them). The decoder's projections are merged
(`qkv_proj` rows [q | k | v], `gate_up_proj` rows [gate | up]), so an adapter's A matrices of one
merged projection are stacked into one [sum r, in] (one shrink) and each slice keeps its own B,
scaled and transposed ([r, rows], `LoraDelta.parts`), expanded into its rows of the output only:
a block-diagonal B over the merged width would multiply zeros (3x the work on q/k/v).
Phi-3's stored `qkv_proj` / `gate_up_proj` are adapted as they are.

`LoraLinear` wraps a projection (whatever holds its weights: `nn.Linear`, a packed oneDNN copy,
GGUF blocks, int8 rows; the adapter stays in float32 beside them). A step's rows are grouped
by adapter once (`LoraState.set_step`: an index, or a slice where the adapter's rows are
contiguous), and each wrapped projection adds each group's delta in one batched pass --
x[rows] @ A.T, then each slice's part @ B.T -- a loop over the step's adapters (at most
`max_loras`), never over requests: vLLM's CPU punica path does the same. Rows of the base
model take no extra work, and a step with no adapter row costs one attribute test a projection.
A GGUF model's decode steps apply the same deltas inside its C decode step
(`executor_svc.cpu_decode_path`, csrc/cpu_ops.c's `lora_deltas`), from the same matrices.

On CUDA (`kernels`): every adapter's A and B of a projection stacked by slot ([slots, R, in],
[slots, out, R], ranks zero-padded, in the model's dtype) and the step's rows grouped once
(`kernels.lora.lora_metadata`); a projection is then one shrink and one expand launch
(`kernels.lora`, SGMV) for all adapters of the step.

Refused at load, with nothing loaded and a message naming the field: DoRA (`use_dora`), an
adapter of the embedding or the LM head (`target_modules`, `modules_to_save`), a module the
model lacks or cannot adapt (experts, routers), a rank above `max_lora_rank` (`r`), shapes of
another base (`lora_A` / `lora_B` of a module), biases (`bias`), a layer the model lacks.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from torch import nn

from executor_svc.model import DecoderModel
from executor_svc.models import family
from pagoda.lora_files import LoraError, parse_adapter_config, read_adapter_files

# the modules an adapter may target, by their checkpoint names (Phi-3 stores qkv_proj / gate_up_proj merged)
ADAPTABLE = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj", "qkv_proj", "gate_up_proj")
_PREFIX = "base_model.model."  # PEFT's name of the wrapped model's root


@dataclass
class _Slice:
    """One checkpoint module's A [r, in] and B [out, r] and where its rows go in the merged projection."""

    a: torch.Tensor
    b: torch.Tensor
    first_row: int
    scale: float


@dataclass(frozen=True)
class LoraPart:
    """One slice of a `LoraDelta`: its ranks [first_rank, first_rank + rank) of the shrink's output
    expand into the output's columns [first_col, first_col + cols) through `bt` [rank, cols]
    (B.T, scaled by the slice's alpha / r), float32, contiguous."""

    first_rank: int
    rank: int
    first_col: int
    cols: int
    bt: torch.Tensor


@dataclass(frozen=True)
class LoraDelta:
    """One adapter's delta on one (merged) projection: y[:, part's columns] += (x @ a.T)[:, part's ranks] @ part.bt."""

    a: torch.Tensor  # [R, in] float32, contiguous: the slices' A stacked
    parts: tuple[LoraPart, ...]
    whole: bool  # one part over every output column (no column slicing needed)

    @property
    def nbytes(self) -> int:
        return self.a.nbytes + sum(p.bt.nbytes for p in self.parts)

    def to(self, device: torch.device) -> LoraDelta:
        parts = tuple(LoraPart(p.first_rank, p.rank, p.first_col, p.cols, p.bt.to(device)) for p in self.parts)
        return LoraDelta(self.a.to(device), parts, self.whole)

    def block_b(self, out_features: int) -> torch.Tensor:
        """B [out, R] with each slice's B at its rows and zeros elsewhere (the kernels' layout)."""
        b = torch.zeros(out_features, self.a.shape[0], dtype=torch.float32, device=self.a.device)
        for p in self.parts:
            b[p.first_col : p.first_col + p.cols, p.first_rank : p.first_rank + p.rank] = p.bt.T
        return b


class LoraLinear(nn.Module):
    """A projection plus the deltas of the adapters the step's rows use (see the module docstring)."""

    def __init__(self, base: nn.Module, state: LoraState) -> None:
        super().__init__()
        self.base = base
        self.state = state
        self.in_features = base.in_features
        self.out_features = base.out_features
        self.adapters: dict[int, LoraDelta] = {}  # adapter id -> its delta on this projection
        self.a_stacked: torch.Tensor | None = None  # (kernels) [slots, R, in], [slots, out, R]: `stack`
        self.b_stacked: torch.Tensor | None = None

    def stack(self, slots: list[int], dtype: torch.dtype, device: torch.device) -> None:
        """The adapters' A and B by slot (`slots[i]`: the adapter id of slot i), for the kernels."""
        rank = max((d.a.shape[0] for d in self.adapters.values()), default=1)
        a_stacked = torch.zeros(len(slots), rank, self.in_features, dtype=dtype, device=device)
        b_stacked = torch.zeros(len(slots), self.out_features, rank, dtype=dtype, device=device)
        for slot, adapter in enumerate(slots):
            if adapter in self.adapters:
                delta = self.adapters[adapter]
                a_stacked[slot, : delta.a.shape[0]] = delta.a
                b_stacked[slot, :, : delta.a.shape[0]] = delta.block_b(self.out_features)
        self.a_stacked, self.b_stacked = a_stacked, b_stacked

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.base(x)
        meta = self.state.meta
        if meta is not None:  # the kernels: every adapter of the step in one shrink and one expand
            from kernels.lora import lora_expand, lora_shrink

            lora_expand(lora_shrink(x, self.a_stacked, meta), self.b_stacked, meta, out)
            return out
        f32 = out.dtype == torch.float32
        for adapter, rows in self.state.groups:
            delta = self.adapters.get(adapter)
            if delta is None:
                continue
            t = x[rows].float() @ delta.a.T  # [n, R]: every slice's shrink at once
            if not f32:
                part_out = out[rows].float()
            for p in delta.parts:
                ts = t if delta.whole or len(delta.parts) == 1 else t[:, p.first_rank : p.first_rank + p.rank]
                cols = slice(None) if delta.whole else slice(p.first_col, p.first_col + p.cols)
                if not f32:
                    part_out[:, cols].addmm_(ts, p.bt)
                elif isinstance(rows, slice):
                    out[rows, cols].addmm_(ts, p.bt)
                else:
                    out[:, cols].index_add_(0, rows, ts @ p.bt)
            if not f32:
                out[rows] = part_out.to(out.dtype)
        return out


class LoraState:
    """The step's rows grouped by adapter, shared by every `LoraLinear` of a model."""

    def __init__(self) -> None:
        self.groups: list[tuple[int, slice | torch.Tensor]] = []  # (adapter id, its rows)
        self.kernels = False  # rows grouped for kernels.lora (`meta`) rather than `groups`
        self.slot_of: np.ndarray = np.zeros(0, dtype=np.int64)  # (kernels) adapter id -> its slot
        self.meta = None  # (kernels) kernels.lora.LoraMeta of the step
        self.token_adapters: np.ndarray | None = None  # the step's adapter id per token (-1: base), where any
        self.version = 0  # counts loads and unloads (the C decode path's tables of the adapters follow it)

    @property
    def active(self) -> bool:
        return bool(self.groups) or self.meta is not None

    def set_step(self, token_adapters: np.ndarray | None, device: torch.device) -> None:
        """`token_adapters[i]`: the adapter id of the step's i-th token, -1 for the base model."""
        self.groups, self.meta, self.token_adapters = [], None, None
        if token_adapters is None or not (token_adapters >= 0).any():
            return
        self.token_adapters = token_adapters
        if self.kernels:
            from kernels.lora import lora_metadata

            slots = np.where(token_adapters >= 0, self.slot_of[np.maximum(token_adapters, 0)], -1)
            self.meta = lora_metadata(torch.from_numpy(slots).to(device))
            return
        for adapter in np.unique(token_adapters[token_adapters >= 0]).tolist():
            rows = np.flatnonzero(token_adapters == adapter)
            if rows[-1] - rows[0] + 1 == len(rows):
                self.groups.append((adapter, slice(int(rows[0]), int(rows[-1]) + 1)))
            else:
                self.groups.append((adapter, torch.from_numpy(rows).to(device)))


@dataclass
class Adapter:
    name: str
    path: Path | None  # (sent over the link: no path)
    id: int
    rank: int
    weights: dict[str, LoraDelta]  # projection's module name -> its delta

    @property
    def nbytes(self) -> int:
        return sum(d.nbytes for d in self.weights.values())


def _pattern_value(patterns: dict, key: str, default):
    """PEFT's `rank_pattern` / `alpha_pattern` lookup: the first pattern that matches the module name's end."""
    for pattern, value in patterns.items():
        if re.match(rf"(.*\.)?({pattern})$", key):
            return value
    return default


def adapter_slices(config_json: bytes, weights: bytes, model: DecoderModel, max_rank: int) -> dict[str, list[_Slice]]:
    """An adapter's files (adapter_config.json, adapter_model.safetensors) as slices per projection of
    `model` (its module name), checked against the model's shapes; raises `LoraError` naming the
    field, having loaded nothing."""
    from safetensors import SafetensorError
    from safetensors.torch import load

    config = parse_adapter_config(config_json, max_rank)
    try:
        tensors = load(weights)
    except (SafetensorError, ValueError, RuntimeError) as exc:
        raise LoraError("adapter_model.safetensors", f"not a safetensors file: {exc}") from None
    c = model.config
    target_of = family(c.architecture).weight_target
    use_rslora = bool(config.get("use_rslora", False))
    rank_pattern, alpha_pattern = config.get("rank_pattern") or {}, config.get("alpha_pattern") or {}
    slices: dict[str, list[_Slice]] = {}
    pairs = {}
    for key in tensors:
        match = re.fullmatch(r"(.+)\.lora_([AB])(?:\.[^.]+)?\.weight", key)
        if match is None:
            if key.endswith((".lora_embedding_A", ".lora_embedding_B")) or "lora_embedding" in key:
                raise LoraError("target_modules", f"{key}: adapters on the embedding are not supported")
            raise LoraError("adapter_model.safetensors", f"tensor {key} is not a LoRA matrix")
        pairs.setdefault(match.group(1), {})[match.group(2)] = key
    if not pairs:
        raise LoraError("adapter_model.safetensors", "no LoRA matrix in the file")
    for module, ab in sorted(pairs.items()):
        if set(ab) != {"A", "B"}:
            raise LoraError(module, "lora_A and lora_B must both be present")
        hf_name = module.removeprefix(_PREFIX)
        leaf = hf_name.rsplit(".", 1)[-1]
        if leaf in ("embed_tokens", "lm_head"):
            raise LoraError("target_modules", f"{leaf}: adapters on the embedding or the LM head are not supported")
        if leaf not in ADAPTABLE:
            raise LoraError("target_modules", f"{module}: not a projection the decoder can adapt ({', '.join(ADAPTABLE)})")
        target = target_of(hf_name + ".weight", c)
        if target is None or isinstance(target[1], tuple):
            raise LoraError("target_modules", f"{module}: the model has no such projection")
        param, first_row = target
        owner_name = param.removesuffix(".weight")
        try:
            owner = model.get_submodule(owner_name)
        except AttributeError:
            raise LoraError("target_modules", f"{module}: the model has no such module ({owner_name})") from None
        if not isinstance(owner, LoraLinear):
            raise LoraError("target_modules", f"{module}: not a projection the decoder can adapt")
        a, b = tensors[ab["A"]].float(), tensors[ab["B"]].float()
        rank = a.shape[0]
        if a.dim() != 2 or b.dim() != 2 or b.shape[1] != rank:
            raise LoraError(f"{module}.lora_B", f"shapes {tuple(a.shape)} and {tuple(b.shape)} do not make a rank-{rank} pair")
        if rank > max_rank:
            raise LoraError("r", f"{module}: rank {rank} is above --max-lora-rank {max_rank}")
        if a.shape[1] != owner.in_features:
            raise LoraError(f"{module}.lora_A", f"shape {tuple(a.shape)}: the model's {leaf} takes {owner.in_features} inputs (an adapter of another base?)")
        first_row = first_row or 0
        expected = _slice_rows(c, leaf, owner.out_features)
        if b.shape[0] != expected:
            raise LoraError(f"{module}.lora_B", f"shape {tuple(b.shape)}: the model's {leaf} has {expected} outputs (an adapter of another base?)")
        # PEFT's scaling: the module's alpha over its rank (its square root with rsLoRA)
        alpha = _pattern_value(alpha_pattern, hf_name, config.get("lora_alpha", 8))
        rank = _pattern_value(rank_pattern, hf_name, rank)
        scale = alpha / math.sqrt(rank) if use_rslora else alpha / rank
        slices.setdefault(owner_name, []).append(_Slice(a, b, first_row, scale))
    for owner_name, parts in slices.items():
        rows = [p.first_row for p in parts]
        if len(set(rows)) != len(rows):
            raise LoraError("target_modules", f"{owner_name}: two matrices for the same rows")
    return slices


def _slice_rows(c, leaf: str, merged_out: int) -> int:
    """The rows of checkpoint module `leaf` in the decoder's (merged) projection."""
    return {"q_proj": c.q_size, "k_proj": c.kv_size, "v_proj": c.kv_size,
            "gate_proj": c.intermediate_size, "up_proj": c.intermediate_size}.get(leaf, merged_out)


def merge_slices(parts: list[_Slice], out_features: int) -> LoraDelta:
    """The slices' A stacked [sum r, in] and each slice's B, scaled and transposed, for its rows."""
    parts = sorted(parts, key=lambda p: p.first_row)
    a = torch.cat([p.a for p in parts]).contiguous()
    out, start = [], 0
    for p in parts:
        rank = p.a.shape[0]
        out.append(LoraPart(start, rank, p.first_row, p.b.shape[0], (p.b * p.scale).T.contiguous()))
        start += rank
    whole = len(out) == 1 and out[0].first_col == 0 and out[0].cols == out_features
    return LoraDelta(a, tuple(out), whole)


class LoraManager:
    """The adapters loaded on one model replica, by name; each one's matrices in its model's `LoraLinear`s."""

    def __init__(self, model: DecoderModel, max_lora_rank: int = 64, kernels: bool | None = None) -> None:
        """`kernels`: the Triton kernels (`kernels.lora`) apply the deltas; None: on CUDA."""
        if model.tp.size > 1:
            raise ValueError("LoRA adapters with tensor parallelism are not supported")
        self.model = model
        self.max_lora_rank = max_lora_rank
        self.state = LoraState()
        self.state.kernels = model.device.type == "cuda" if kernels is None else kernels
        self.adapters: dict[str, Adapter] = {}
        self._next_id = 0
        self.modules: dict[str, LoraLinear] = {}
        for owner, name in model.projections():
            wrapped = LoraLinear(getattr(owner, name), self.state)
            setattr(owner, name, wrapped)
        self.modules = {n: m for n, m in model.named_modules() if isinstance(m, LoraLinear)}
        model.lora = self.state

    def load(self, name: str, path: str | Path) -> Adapter:
        """Read, check and install the adapter of folder `path` as `name` (replacing one of that name)."""
        files = read_adapter_files(name, path, self.max_lora_rank)
        return self.load_files(name, files.config_json, files.weights, Path(path))

    def load_files(self, name: str, config_json: bytes, weights: bytes, path: Path | None = None) -> Adapter:
        """Check and install the adapter of these files as `name` (replacing one of that name)."""
        if not name:
            raise LoraError("lora_name", "empty")
        slices = adapter_slices(config_json, weights, self.model, self.max_lora_rank)
        device = self.model.device
        weights = {}
        for owner_name, parts in slices.items():
            weights[owner_name] = merge_slices(parts, self.modules[owner_name].out_features).to(device)
        if name in self.adapters:
            self.unload(name)
        adapter = Adapter(name, path, self._next_id, max(p.a.shape[0] for s in slices.values() for p in s), weights)
        self._next_id += 1
        for owner_name, delta in weights.items():
            self.modules[owner_name].adapters[adapter.id] = delta
        self.adapters[name] = adapter
        self.state.version += 1
        self._restack()
        return adapter

    def unload(self, name: str) -> None:
        adapter = self.adapters.pop(name, None)
        if adapter is None:
            raise LoraError("lora_name", f"{name!r} is not loaded")
        for module in self.modules.values():
            module.adapters.pop(adapter.id, None)
        self.state.version += 1
        self._restack()

    def _restack(self) -> None:
        """(kernels) each projection's adapters stacked by slot, the slots numbered in the adapters' order."""
        if not self.state.kernels:
            return
        slots = sorted(a.id for a in self.adapters.values())
        slot_of = np.full(self._next_id, -1, dtype=np.int64)
        slot_of[slots] = np.arange(len(slots))
        self.state.slot_of = slot_of
        for module in self.modules.values():
            module.stack(slots, self.model.dtype, self.model.device)

    def clear(self) -> None:
        """Unload every adapter (a new scheduler sends its own)."""
        for name in list(self.adapters):
            self.unload(name)

    def id_of(self, name: str) -> int:
        """The adapter id of `name` ("" is the base model: -1); KeyError when it is not loaded."""
        return -1 if not name else self.adapters[name].id
