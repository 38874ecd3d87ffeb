"""The executor's model runner: per-request state, the paged KV cache, one `execute` per step.

`execute(plan)` keeps the contract of `pagoda.step` (its module docstring): drop finished
requests, add new ones, extend block tables, copy blocks, then run every scheduled token
in one flat batch and sample one token for each request whose computed count reaches
its end. Requests are laid out decodes first (query length 1), then prefill chunks:

    input_ids   [ d0 d1 d2 | p0 p0 p0 p0 p0 | p1 p1 p1 ]      T tokens, no padding
    positions   [ 41 17 63 |  0  1  2  3  4 | 32 33 34 ]
    query_start_loc [0, 1, 2, 3, 8, 11]     seq_lens = num_computed + num_scheduled
    slot        = block_table[i, pos // B] * B + pos % B

Nothing here loops over tokens in Python; per-request work is a list slice and a row of
the block table.

KV cache groups (`executor_svc.kv_cache_spec`): layers of one attention type share a
block table; each group's layers get the step's metadata of their group (its slot mapping
and block table), and the i-th layer of every group shares the i-th K and V tensors.

Speculative decoding: a request with k draft tokens is a query of k + 1 positions (its
last token, then the drafts) whose k + 1 last rows all get logits; `spec_decode.verify`
keeps the drafts the model agrees with and adds its own token, and the request's
computed count rolls back by the rejected drafts (their slots are written again later).
"""

from __future__ import annotations

import logging
import math
from collections import Counter
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np
import torch

from executor_svc.attention import AttentionBackend, AttentionMetadata
from executor_svc.backend import Backend, BackendOptions
from executor_svc.fused_ops import rows_finite
from executor_svc.input_batch import BatchError, InputBatch
from executor_svc.kv_cache_spec import KVCacheLayout, kv_cache_groups as group_layers, layer_sliding_windows
from executor_svc.loader import load_model, weight_bytes
from executor_svc.lora import LoraError, LoraManager
from executor_svc.model import DecoderModel, can_pack_for_cpu
from executor_svc.quant.gguf_linear import GGUFLinear
from executor_svc.sampler import Sampler, SamplingRow
from executor_svc.spec_decode import verify
from executor_svc.structured_output import StructuredOutput
from executor_svc.vision import EncoderCache, ImageError
from pagoda.model_files import fingerprint, gguf_source
from pagoda.step import (
    GRAMMAR_FAILED,
    GRAMMAR_PENDING,
    ImageInput,
    KVCacheGroupSpec,
    NewRequestData,
    RequestError,
    SampledToken,
    SamplingParams,
    StepPlan,
    StepResult,
)

logger = logging.getLogger(__name__)

DEFAULT_CPU_KV_MEMORY_BYTES = 1 << 30
_DTYPES = {
    "float32": torch.float32,
    "fp32": torch.float32,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
    "float16": torch.float16,
    "fp16": torch.float16,
    "half": torch.float16,
}


class PlanError(ValueError):
    """A step plan that contradicts the executor's state (a scheduler bug)."""


class CachedRequestState:
    """What the executor keeps of a request between steps; it appends its own sampled tokens, so a
    plan never carries decode token ids (and a plan sent ahead of the last result needs none).

    Its tokens, blocks and computed count live in its row of the persistent batch
    (`InputBatch`); `token_ids` is also kept as a list, which the sampler's penalties read."""

    __slots__ = ("req_id", "token_ids", "num_prompt_tokens", "sampling", "row", "adapter", "images", "held", "rope", "_batch")

    def __init__(self, new: NewRequestData, batch: InputBatch, adapter: int = -1) -> None:
        self.req_id = new.req_id
        self.adapter = adapter  # its LoRA adapter's id (executor_svc.lora), -1 for the base model
        self.token_ids = list(new.token_ids)  # prompt + generated so far
        self.num_prompt_tokens = new.num_prompt_tokens
        self.sampling: SamplingParams = new.sampling
        # its images not yet wholly computed, each with its checked tensors (executor_svc.vision)
        self.images: list[tuple[ImageInput, dict[str, torch.Tensor]]] = []
        self.held: set[str] = set()  # the hashes of its images the encoder cache holds for it
        self.rope: tuple[torch.Tensor, int] | None = None  # Qwen2.5-VL: its prompt's [3, P] positions, later tokens' offset
        self._batch = batch
        self.row = batch.add(self.token_ids, new.block_ids, new.num_computed_tokens)

    @property
    def num_computed_tokens(self) -> int:
        return int(self._batch.num_computed[self.row])

    @num_computed_tokens.setter
    def num_computed_tokens(self, value: int) -> None:
        self._batch.num_computed[self.row] = value

    @property
    def block_ids(self) -> tuple[list[int], ...]:
        """One list per KV cache group (a block freed outside a sliding window keeps its old id)."""
        end = self._batch.num_blocks[self.row]
        return tuple(table[self.row, :end].tolist() for table in self._batch.block_tables)

    def append_token(self, token_id: int) -> None:
        self.token_ids.append(token_id)
        self._batch.append_token(self.row, token_id)


@dataclass
class StepInputs:
    """One step's flat batch, on the model's device."""

    req_ids: list[str]  # in batch order
    input_ids: torch.Tensor  # [T] int64
    positions: torch.Tensor  # [T] int64
    meta: AttentionMetadata  # KV cache group 0's (the only group's, for a model with only full attention)
    logits_indices: torch.Tensor  # [num_sampled + drafts] rows whose logits are sampled
    sampled_req_ids: list[str]  # the requests of those rows, in order (k + 1 rows with k drafts)
    layer_metas: tuple[AttentionMetadata, ...] | None = None  # several groups: each layer's group's
    every_row_sampled: bool = False  # logits_indices is every row in order (a step of decodes): no gather needed

    @property
    def model_meta(self) -> AttentionMetadata | tuple[AttentionMetadata, ...]:
        """What the model's forward takes: one metadata for every layer, or one per layer."""
        return self.meta if self.layer_metas is None else self.layer_metas


def resolve_device(device: str | torch.device) -> torch.device:
    if str(device) == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    return device


def resolve_dtype(dtype: str | torch.dtype, device: torch.device) -> torch.dtype:
    """"auto": bfloat16 on a GPU, float32 on every CPU (AMX or not; `bench/bench_bf16.py` and the
    README's "--dtype on the CPU" give the measurements behind it)."""
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    if dtype not in _DTYPES:
        raise ValueError(f"dtype {dtype!r}: expected auto or one of {sorted(_DTYPES)}")
    return _DTYPES[dtype]


def resolve_quantization(quantization: str, model_dir: Path, device: torch.device, dtype: torch.dtype) -> str:
    """"auto": a GGUF file's blocks are kept on a float32 or bfloat16 CPU replica, anything else is loaded as it is."""
    if quantization != "auto":
        return quantization
    keeps = gguf_source(model_dir) is not None and device.type == "cpu" and dtype in (torch.float32, torch.bfloat16)
    return "gguf" if keeps else "none"


def finite_rows(logits: torch.Tensor) -> list[bool]:
    """Whether each row of `logits` is all finite. A row whose float sum is finite is (a NaN or an
    infinity in it makes the sum NaN or infinite), so one pass decides the usual case; the rows
    whose sum is not finite (an overflow of finite values, in principle) are checked element by
    element. `isfinite(logits).all(-1)` alone took ~2.7 ms a step at 48 rows of a 49,152-token
    vocabulary, the sum 0.06 ms."""
    fast = rows_finite(logits)  # a few CPU rows: one C pass each
    if fast is not None:
        return fast
    ok = torch.isfinite(logits.sum(dim=-1))
    if not bool(ok.all()):
        ok = torch.isfinite(logits).all(dim=-1)
    return ok.tolist()


class ModelRunner:
    """A model replica, its KV cache and the state of the requests it holds."""

    def __init__(
        self,
        model_dir: str | Path,
        device: str | torch.device = "cpu",
        dtype: str | torch.dtype = "auto",
        block_size: int = 16,
        num_kv_blocks: int | None = None,
        kv_memory_bytes: int | None = None,
        attention_backend: str = "auto",
        num_threads: int | None = None,
        gpu_memory_utilization: float = 0.9,
        max_num_batched_tokens: int = 8192,
        kv_cache_dtype: str = "auto",
        pack_weights: bool | None = None,
        quantization: str = "auto",
        tp=None,
        kv_cache_groups: tuple[KVCacheGroupSpec, ...] | None = None,
        backend: BackendOptions | None = None,
        enable_lora: bool = False,
        max_lora_rank: int = 64,
        lora_kernels: bool | None = None,
        encoder_cache_rows: int = 8192,
    ) -> None:
        """`tp`: this runner's rank of a tensor-parallel group (`executor_svc.parallel`), or None.

        `kv_cache_groups`: the layers that share a block table; None derives them from the
        model (`kv_cache_spec.kv_cache_groups` of its layers' windows).

        `backend`: the execution choices (`BackendOptions.from_env()` when None);
        `attention_backend` and `kv_cache_dtype` are its `attention` and `kv_cache_dtype`.

        `enable_lora`: the projections take LoRA adapters (`add_lora`), of rank up to `max_lora_rank`;
        `lora_kernels`: their deltas through Triton's kernels (None: on CUDA).

        `encoder_cache_rows`: a vision-language model's encoder cache holds at most this many
        image feature rows at once (`executor_svc.vision.EncoderCache`).
        """
        self._device = resolve_device(device)
        if num_threads:  # else torch's default: one thread per physical core
            torch.set_num_threads(num_threads)
        self.model_dir = Path(model_dir)
        self.dtype = resolve_dtype(dtype, self._device)
        self._block_size = block_size
        options = replace(
            backend or BackendOptions.from_env(), attention=attention_backend, kv_cache_dtype=kv_cache_dtype
        )
        self.backend = Backend(options, self._device, self.dtype)
        self.quantization = resolve_quantization(quantization, self.model_dir, self._device, self.dtype)
        if self.quantization == "int8" and not self.backend.keeps_gguf_blocks:
            from executor_svc.loader import UnsupportedModelError

            raise UnsupportedModelError("quantization 'int8' needs the C kernel (no compiler here, or the backend's gguf_kernel off)")
        if self.quantization == "gguf" and not self.backend.keeps_gguf_blocks:
            self.quantization = "none"  # no kernel here (no compiler, or options.gguf_kernel off): dequantized at load
        self.model: DecoderModel = load_model(self.model_dir, self._device, self.dtype, self.quantization, tp=tp)
        if self.quantization == "gguf" and not any(isinstance(m, GGUFLinear) for m in self.model.modules()):
            self.quantization = "none"  # every tensor of a type the kernel does not keep: dequantized at load
        self.weight_bytes = weight_bytes(self.model)
        if pack_weights is None:
            pack_weights = can_pack_for_cpu(self._device, self.dtype) and self.quantization == "none"
        if pack_weights:
            self.model.pack_for_cpu()
        self.loras: LoraManager | None = None
        if enable_lora:
            self.enable_lora(max_lora_rank, lora_kernels)
        self.config = self.model.config
        self.kv_cache_groups = self._kv_cache_groups(kv_cache_groups)
        self.kv_cache_layout = KVCacheLayout(self.kv_cache_groups, self.config.num_layers)
        self._group_of_layer = self.kv_cache_layout.group_of
        self.backend.prepare(self.model)
        self.weight_bytes += sum(  # bfloat16 copies of GGUF weights (BackendOptions.gguf_bf16_weights)
            m.bf16_weight.nbytes for m in self.model.modules() if isinstance(m, GGUFLinear) and m.bf16_weight is not None
        )
        cache_dtype = getattr(self.attention, "cache_dtype", None)
        self.kv_cache_dtype = cache_dtype(self.dtype) if cache_dtype else self.dtype
        self._fingerprint = fingerprint(self.model_dir)
        self.sampler = Sampler()
        self.structured = StructuredOutput(self.model_dir)  # grammar matchers of constrained requests
        self.requests: dict[str, CachedRequestState] = {}
        windows = tuple(g.sliding_window for g in self.kv_cache_groups)
        self.batch = InputBatch(self.max_model_len, block_size, self._device, sliding_windows=windows)
        self.failed: dict[str, str] = {}  # req id -> why it failed alone; not computed again (see sample)
        self.encoder_cache = EncoderCache(encoder_cache_rows) if self.model.vision is not None else None
        if num_kv_blocks is None:
            if kv_memory_bytes is None:
                kv_memory_bytes = (
                    self._profile_kv_memory_bytes(gpu_memory_utilization, max_num_batched_tokens)
                    if self._device.type == "cuda"
                    else DEFAULT_CPU_KV_MEMORY_BYTES
                )
            num_kv_blocks = kv_memory_bytes // self.kv_block_bytes
        if tp is not None:  # one block table for the group: the smallest rank decides
            num_kv_blocks = tp.min(num_kv_blocks)
        if num_kv_blocks < 2:
            raise ValueError(f"num_kv_blocks {num_kv_blocks}: need at least 2 (block 0 is the null block)")
        self.kv_caches = self._allocate_kv_caches(num_kv_blocks)
        logger.info(
            "model %s on %s (%s, weights %s: %.1f MiB, attention %s): %d KV blocks of %d tokens, %s",
            self.model_dir,
            self._device,
            self.dtype,
            self.quantization,
            self.weight_bytes / 2**20,
            self.attention.name,
            num_kv_blocks,
            block_size,
            _describe_groups(self.kv_cache_groups),
        )

    @property
    def attention(self) -> AttentionBackend:
        """The backend's attention (a test may swap it: the C decode step then stands aside)."""
        return self.backend.attention

    @attention.setter
    def attention(self, attention: AttentionBackend) -> None:
        self.backend.attention = attention

    # -- what the worker registers -------------------------------------------------------

    @property
    def num_kv_blocks(self) -> int:
        return self.kv_caches[0][0].shape[0]

    @property
    def block_size(self) -> int:
        return self._block_size

    @property
    def device(self) -> str:
        return str(self._device)

    @property
    def fingerprint(self) -> str:
        return self._fingerprint

    @property
    def max_model_len(self) -> int:
        return self.config.max_position_embeddings

    @property
    def vocab_size(self) -> int:
        return self.config.vocab_size

    @property
    def eos_token_ids(self) -> tuple[int, ...]:
        return self.config.eos_token_ids

    @property
    def kv_block_bytes(self) -> int:
        """K and V of one block in every layer of a KV cache group (all layers with full attention only)."""
        c = self.config
        return 2 * self.kv_cache_layout.num_tensors * self._block_size * c.kv_size * self.kv_cache_dtype.itemsize

    @property
    def honours_sliding_windows(self) -> bool:
        """Whether the model's attention keeps each sliding-window layer to its window.

        Only then do its sliding-window layers get groups of their own, whose blocks
        outside the window the scheduler frees. Every family of `executor_svc.models` exports
        its layers' types (`ModelConfig.layer_types`) and passes each layer's window to the
        attention backend; a config without them is treated as full attention throughout.
        """
        return getattr(self.config, "layer_types", None) is not None

    def _kv_cache_groups(self, groups: tuple[KVCacheGroupSpec, ...] | None) -> tuple[KVCacheGroupSpec, ...]:
        if groups is not None:
            return tuple(groups)
        num_layers = self.config.num_layers
        windows = layer_sliding_windows(self.config) if self.honours_sliding_windows else (None,) * num_layers
        return group_layers(windows)

    # -- one step -------------------------------------------------------------------------

    def reset(self) -> None:
        """Forget every request (the scheduler re-sends them in full); the cache contents are simply stale."""
        self.requests.clear()
        self.batch.clear()
        self.failed.clear()
        self.structured.clear()
        if self.encoder_cache is not None:
            self.encoder_cache.clear()

    def execute(self, plan: StepPlan) -> StepResult:
        return self._execute(plan, all_logits=False)[0]

    def execute_with_logits(self, plan: StepPlan) -> tuple[StepResult, dict[str, torch.Tensor]]:
        """`execute`, also returning each scheduled request's logits for every scheduled token.

        For tests and prompt logprobs: runs the LM head on every row, not only the sampled ones.
        """
        return self._execute(plan, all_logits=True)

    @torch.inference_mode()
    def _execute(self, plan: StepPlan, all_logits: bool) -> tuple[StepResult, dict[str, torch.Tensor]]:
        self.update_states(plan)
        if plan.block_copies:
            src_dst = torch.tensor([(c.src, c.dst) for c in plan.block_copies], dtype=torch.int64)
            self.attention.copy_blocks(self.kv_cache_tensors, src_dst)
        if self.encoder_cache is not None:
            self._encode_images(plan)  # (an image that fails fails its request alone, skipped below)
        plan, earlier_errors = self._skip_failed(plan)
        if plan.total_num_scheduled_tokens == 0:
            return StepResult(step_id=plan.step_id, errors=earlier_errors), {}
        inputs = self.prepare_inputs(plan)
        mm_embeds = self._image_rows(plan, inputs) if self.encoder_cache is not None else None
        if mm_embeds is not None and self.config.image_bidirectional:
            inputs = self._with_image_spans(plan, inputs)
        if self.config.mrope_section is not None:  # (the modules: [3, T] positions)
            hidden, residual = self.model(
                inputs.input_ids, self._rope_positions(plan, inputs), self.kv_caches, inputs.model_meta, self.attention, mm_embeds=mm_embeds
            )
        elif mm_embeds is None:
            hidden, residual = self.backend.forward(
                self.model, inputs.input_ids, inputs.positions, self.kv_caches, inputs.model_meta
            )
        else:  # (the modules: the C decode step takes token ids only)
            hidden, residual = self.model(
                inputs.input_ids, inputs.positions, self.kv_caches, inputs.model_meta, self.attention, mm_embeds=mm_embeds
            )
        per_request: dict[str, torch.Tensor] = {}
        if all_logits:
            logits_all = self.model.compute_logits(hidden, residual)
            bounds = inputs.meta.query_start_loc.tolist()
            per_request = {r: logits_all[bounds[i] : bounds[i + 1]] for i, r in enumerate(inputs.req_ids)}
            logits = logits_all[inputs.logits_indices]
        else:
            rows = None if inputs.every_row_sampled else inputs.logits_indices
            logits = self.model.compute_logits(hidden, residual, rows)
        if plan.scheduled_spec_decode_tokens:
            sampled, errors = self.sample_with_drafts(logits, inputs.sampled_req_ids, plan.scheduled_spec_decode_tokens)
        else:
            sampled, errors = self.sample(logits, inputs.sampled_req_ids)
        self.finish_step(plan, sampled)
        return StepResult(step_id=plan.step_id, sampled=sampled, errors=earlier_errors + errors), per_request

    def _skip_failed(self, plan: StepPlan) -> tuple[StepPlan, list[RequestError]]:
        """Requests that failed alone in an earlier step are not computed again.

        With a step planned ahead, the scheduler may schedule one once more before it learns
        of the failure: it gets the same error again, until it is among `finished_req_ids`.
        """
        skipped = [r for r in plan.num_scheduled_tokens if r in self.failed]
        if not skipped:
            return plan, []
        kept = {r: n for r, n in plan.num_scheduled_tokens.items() if r not in self.failed}
        return replace(plan, num_scheduled_tokens=kept), [RequestError(r, self.failed[r]) for r in skipped]

    def update_states(self, plan: StepPlan) -> None:
        for req_id in plan.finished_req_ids:
            self._drop(req_id)
            self.failed.pop(req_id, None)
        try:
            for new in plan.new_requests:
                self._drop(new.req_id)  # sent again in full (after a preemption)
                if new.sampling.constraint is not None:  # its matcher replays the output so far
                    self.structured.add(
                        new.req_id, new.sampling.constraint, new.token_ids[new.num_prompt_tokens :], new.sampling.compiled_grammar,
                        new.tenant,
                    )
                if new.sampling.compiled_grammar:  # handed over (megabytes): not kept with the request
                    new.sampling = replace(new.sampling, compiled_grammar=b"")
                self.requests[new.req_id] = state = CachedRequestState(new, self.batch, self._adapter_of(new))
                if new.images:
                    self._add_images(state, new.images)
            for cached in plan.cached_requests:
                self.batch.append_blocks(self._state(cached.req_id).row, cached.new_block_ids)
        except BatchError as exc:
            raise PlanError(str(exc)) from None

    def _adapter_of(self, new: NewRequestData) -> int:
        """The id of the request's adapter; one this replica does not hold fails the request, alone
        (never a base-model answer in its place)."""
        if not new.lora:
            return -1
        if self.loras is not None and new.lora in self.loras.adapters:
            return self.loras.id_of(new.lora)
        why = "LoRA adapters are off on this executor" if self.loras is None else "it is not loaded on this executor"
        self.failed[new.req_id] = f"adapter {new.lora!r}: {why}"
        return -1

    # -- LoRA adapters --------------------------------------------------------------------

    def enable_lora(self, max_lora_rank: int, kernels: bool | None = None) -> None:
        """Wrap the projections for LoRA adapters (once; a later call only changes the rank allowed)."""
        if self.loras is None:
            self.loras = LoraManager(self.model, max_lora_rank, kernels)
        self.loras.max_lora_rank = max_lora_rank

    def add_lora(self, name: str, path: str | Path) -> int:
        """Load the PEFT folder `path` as adapter `name` (`executor_svc.lora.LoraManager.load`); its bytes."""
        return self._added(self._loras().load(name, path))

    def add_lora_files(self, name: str, config_json: bytes, weights: bytes) -> int:
        """The same from the folder's two files (as the scheduler sends them)."""
        return self._added(self._loras().load_files(name, config_json, weights))

    def _loras(self) -> LoraManager:
        if self.loras is None:
            raise LoraError("enable_lora", "LoRA adapters are off on this executor")
        return self.loras

    def _added(self, adapter) -> int:
        logger.info("LoRA adapter %r loaded: rank %d, %.1f MiB", adapter.name, adapter.rank, adapter.nbytes / 2**20)
        return adapter.nbytes

    def remove_lora(self, name: str) -> None:
        self._loras().unload(name)

    def _drop(self, req_id: str) -> None:
        state = self.requests.pop(req_id, None)
        if state is not None:
            self.batch.remove(state.row)
            self.structured.remove(req_id)
            if state.held:
                self.encoder_cache.release_all(req_id, state.held)

    # -- images (a vision-language model's; executor_svc.vision) ----------------------------

    def _add_images(self, state: CachedRequestState, images: tuple[ImageInput, ...]) -> None:
        """Check a new request's images (each fails the request alone, before any work) and keep
        those it has still to compute."""
        vision = self.model.vision
        if vision is None:
            self.failed[state.req_id] = f"images: {self.config.architecture} takes no images"
            return
        if self.config.image_bidirectional and self.kv_cache_dtype != self.dtype:  # (model.image_attention reads it unscaled)
            self.failed[state.req_id] = f"images: {self.config.architecture}'s images need a KV cache in the model's dtype, not {self.kv_cache_dtype}"
            return
        try:
            end, grids = 0, []
            for i, image in enumerate(images):
                if image.offset < end:
                    raise ImageError(f"image {i}: its placeholder span starts at {image.offset}, inside the previous one (ending at {end})")
                end = image.end
                tensors = vision.check(image, state.token_ids[: state.num_prompt_tokens])
                grids.append(tensors.get("image_grid_thw"))
                if image.end > state.num_computed_tokens:
                    state.images.append((image, tensors))
            prompt = state.token_ids[: state.num_prompt_tokens]
            placeholders = sum(t == vision.image_token_id for t in prompt)
            if placeholders != sum(image.length for image in images):
                raise ImageError(f"the prompt holds {placeholders} image tokens, its images' spans {sum(image.length for image in images)}")
            if self.config.mrope_section is not None:
                state.rope = vision.rope_positions(prompt, grids)
        except (ImageError, ValueError) as exc:
            state.images = []
            self.failed[state.req_id] = f"images: {exc}"

    def _encode_images(self, plan: StepPlan) -> None:
        """Run the vision encoder on every image a scheduled chunk reaches that the encoder cache
        does not hold (one batch per tensor shape), and hold each such image for its request."""
        cache, wanted = self.encoder_cache, {}
        for req_id, n in plan.num_scheduled_tokens.items():
            state = self.requests.get(req_id)
            if state is None or not state.images or req_id in self.failed:
                continue
            start = state.num_computed_tokens
            for image, tensors in state.images:
                if image.offset < start + n < image.end and self.config.image_bidirectional:
                    self.failed[req_id] = (
                        f"images: {self.config.architecture} attends both ways among an image's tokens, so a step "
                        f"computes up to the end of an image's placeholder tokens ({image.end}), not to {start + n} "
                        f"(the scheduler must not end a chunk inside it)"
                    )
                elif image.offset < start + n and image.end > start:
                    wanted.setdefault(image.hash, (image, tensors, []))[2].append(req_id)
        for image_hash in list(wanted):
            if holders := [r for r in wanted[image_hash][2] if r not in self.failed]:
                wanted[image_hash][2][:] = holders
            else:
                del wanted[image_hash]
        missing = [(h, image, tensors) for h, (image, tensors, _) in wanted.items() if h not in cache]
        rows_needed = sum(image.length for _, image, _ in missing)
        if missing and not cache.room_for(rows_needed):
            for h, image, _ in missing:
                for req_id in wanted.pop(h)[2]:
                    self.failed[req_id] = (
                        f"images: the encoder cache holds {cache.num_rows} of {cache.capacity_rows} rows, "
                        f"no room for this step's {rows_needed} (the scheduler's encoder budget)"
                    )
            missing = []
        by_shape: dict[tuple, list] = {}
        for h, image, tensors in missing:
            by_shape.setdefault(tuple((k, tuple(t.shape), t.dtype) for k, t in sorted(tensors.items())), []).append((h, image, tensors))
        for group in by_shape.values():
            names = group[0][2].keys()
            batch = {name: torch.cat([tensors[name] for _, _, tensors in group]) for name in names}
            try:
                features = self.model.vision.encode(batch)
            except Exception as exc:  # (tensors the tower cannot take: a size it has no positions for, say)
                logger.warning("encoding %d images failed: %r", len(group), exc)
                for h, _, _ in group:
                    for req_id in wanted.pop(h)[2]:
                        self.failed[req_id] = f"images: the vision encoder failed on image {h[:16]}: {exc!r}"[:500]
                continue
            for (h, image, _), rows in zip(group, features, strict=True):
                if rows.shape[0] != image.length:
                    for req_id in wanted.pop(h)[2]:
                        self.failed[req_id] = f"images: image {h[:16]} encodes to {rows.shape[0]} rows, its placeholder span has {image.length}"
                    continue
                cache.put(h, rows)
        for h, (_, _, req_ids) in wanted.items():
            for req_id in req_ids:
                if req_id not in self.failed:
                    cache.hold(h, req_id)
                    self.requests[req_id].held.add(h)

    def _image_rows(self, plan: StepPlan, inputs: StepInputs) -> tuple[torch.Tensor, torch.Tensor] | None:
        """(flat rows, features) of the step's placeholder tokens, from the encoder cache; None when none."""
        rows, features, bounds = [], [], None
        for i, req_id in enumerate(inputs.req_ids):
            state = self.requests[req_id]
            if not state.images:
                continue
            start, n = state.num_computed_tokens, plan.num_scheduled_tokens[req_id]
            for image, _ in state.images:
                lo, hi = max(start, image.offset), min(start + n, image.end)
                if lo >= hi:
                    continue
                if bounds is None:
                    bounds = inputs.meta.query_start_loc.tolist()
                rows.append(torch.arange(bounds[i] + lo - start, bounds[i] + hi - start))
                features.append(self.encoder_cache.get(image.hash)[lo - image.offset : hi - image.offset])
        if not rows:
            return None
        return torch.cat(rows).to(self._device), torch.cat(features)

    def _rope_positions(self, plan: StepPlan, inputs: StepInputs) -> torch.Tensor:
        """[3, T] multimodal rotary positions: a request with images reads its prompt's (then index +
        offset), any other token has its index three times."""
        positions = inputs.positions.expand(3, -1).clone()
        bounds = None
        for i, req_id in enumerate(inputs.req_ids):
            state = self.requests[req_id]
            if state.rope is None:
                continue
            if bounds is None:
                bounds = inputs.meta.query_start_loc.tolist()
            table, delta = state.rope
            index = torch.arange(state.num_computed_tokens, state.num_computed_tokens + bounds[i + 1] - bounds[i])
            rows = torch.where(index < table.shape[1], table[:, index.clamp(max=table.shape[1] - 1)], index + delta)
            positions[:, bounds[i] : bounds[i + 1]] = rows.to(positions.device)
        return positions

    def _with_image_spans(self, plan: StepPlan, inputs: StepInputs) -> StepInputs:
        """The step's metadata with the query rows inside each image (`AttentionMetadata.image_spans`)."""
        spans, bounds = [], inputs.meta.query_start_loc.tolist()
        for i, req_id in enumerate(inputs.req_ids):
            state = self.requests[req_id]
            start, n = state.num_computed_tokens, plan.num_scheduled_tokens[req_id]
            for image, _ in state.images:
                lo = max(start, image.offset)
                if lo < min(start + n, image.end):
                    spans.append((i, bounds[i] + lo - start, image.end - lo, lo, image.end))
        spans = tuple(spans)
        metas = {id(m): replace(m, image_spans=spans) for m in (inputs.meta, *(inputs.layer_metas or ()))}
        layer_metas = None if inputs.layer_metas is None else tuple(metas[id(m)] for m in inputs.layer_metas)
        return replace(inputs, meta=metas[id(inputs.meta)], layer_metas=layer_metas)

    def _release_computed_images(self, state: CachedRequestState) -> None:
        """Free the encoder cache's hold of every image of `state` whose tokens are all computed."""
        left = [(image, t) for image, t in state.images if image.end > state.num_computed_tokens]
        if len(left) < len(state.images):  # (an image twice in a prompt: held until its last copy is computed)
            done = {image.hash for image, _ in state.images} - {image.hash for image, _ in left}
            self.encoder_cache.release_all(state.req_id, done)
            state.held -= done
            state.images = left

    def check_encoder_cache(self) -> None:
        """The encoder cache holds each image for exactly the requests that say they hold it; a request
        holds every image it is part-way through, and none whose every copy it has computed."""
        if self.encoder_cache is None:
            return
        live: dict[str, set[str]] = {}
        for req_id, state in self.requests.items():
            pending = {image.hash for image, _ in state.images}
            started = {image.hash for image, _ in state.images if image.offset < state.num_computed_tokens}
            if not started <= state.held <= pending:
                raise AssertionError(f"request {req_id} holds images {state.held}: part-way through {started}, still to compute {pending}")
            for image_hash in state.held:
                live.setdefault(image_hash, set()).add(req_id)
        self.encoder_cache.check_integrity(live)

    def prepare_inputs(self, plan: StepPlan) -> StepInputs:
        """Gather the step's flat batch from the persistent batch's rows (`InputBatch.gather`)."""
        # Decodes first: the attention backend batches them apart from longer queries.
        scheduled = sorted(
            ((req_id, n) for req_id, n in plan.num_scheduled_tokens.items() if n > 0), key=lambda item: item[1] != 1
        )
        req_ids = [req_id for req_id, _ in scheduled]
        states = [self._state(req_id) for req_id in req_ids]
        drafts = plan.scheduled_spec_decode_tokens
        draft_lens = [0] * len(states)
        if drafts:
            for i, state in enumerate(states):
                draft = drafts.get(state.req_id)
                if draft:
                    self.batch.write_drafts(state.row, draft)
                    draft_lens[i] = len(draft)
        try:
            g = self.batch.gather([s.row for s in states], [n for _, n in scheduled], draft_lens)
        except BatchError as exc:
            raise PlanError(f"{exc} (requests {req_ids})") from None
        to_device = self.batch.to_device
        query_start_loc, seq_lens = to_device(g.query_start_loc), to_device(g.seq_lens)  # (both int32)
        max_query_len, max_seq_len = int(g.query_lens.max()), int(g.seq_lens.max())
        metas = [
            AttentionMetadata(
                slot_mapping=to_device(slot_mapping),
                query_start_loc=query_start_loc,
                seq_lens=seq_lens,
                block_table=to_device(block_table),
                max_query_len=max_query_len,
                max_seq_len=max_seq_len,
            )
            for slot_mapping, block_table in zip(g.slot_mappings, g.block_tables)
        ]
        sampled = g.sampled.tolist()
        if self.loras is not None:  # each token's adapter, grouped once for every projection of the step
            adapters = np.fromiter((s.adapter for s in states), dtype=np.int64, count=len(states))
            self.loras.state.set_step(np.repeat(adapters, g.query_lens) if adapters.max() >= 0 else None, self._device)
        return StepInputs(
            req_ids=req_ids,
            input_ids=to_device(g.input_ids),
            positions=to_device(g.positions),
            meta=metas[0],
            logits_indices=to_device(g.logits_indices),
            sampled_req_ids=[req_ids[i] for i in sampled for _ in range(draft_lens[i] + 1)],
            layer_metas=tuple(metas[group] for group in self._group_of_layer) if len(metas) > 1 else None,
            every_row_sampled=max_query_len == 1 and len(sampled) == len(req_ids),
        )

    def sample(self, logits: torch.Tensor, req_ids: list[str]) -> tuple[list[SampledToken], list[RequestError]]:
        """One token per row, or a RequestError for a row that cannot be sampled.

        One bad request fails alone: a row of non-finite logits (NaN or Inf: they would
        become token 0) is not sampled, and when the sampler fails on the batch each row is
        sampled alone, so only the rows whose parameters it fails on are lost.
        """
        if not req_ids:
            return [], []
        errors: list[RequestError] = []
        finite = finite_rows(logits)
        if not all(finite):
            keep = [i for i, ok in enumerate(finite) if ok]
            errors += [RequestError(r, "the model produced non-finite logits (NaN or Inf)") for r, ok in zip(req_ids, finite) if not ok]
            logits, req_ids = logits[keep], [req_ids[i] for i in keep]
        logits, req_ids = self._without_grammar_failures(logits, req_ids, errors)
        rows = [SamplingRow(self.requests[r].sampling, self.requests[r].token_ids, self.requests[r].num_prompt_tokens) for r in req_ids]
        bitmask = self.structured.bitmask(req_ids) if self.structured else None
        try:
            sampled = self._sample_rows(logits, rows, req_ids, bitmask)
        except Exception:
            logger.exception("sampling a batch of %d rows failed: sampling them one by one", len(rows))
            sampled = []
            for i, req_id in enumerate(req_ids):
                try:
                    row_mask = bitmask[i : i + 1] if bitmask is not None else None
                    sampled += self._sample_rows(logits[i : i + 1], rows[i : i + 1], [req_id], row_mask)
                except Exception as exc:
                    logger.error("sampling request %s failed: %r", req_id, exc)
                    errors.append(RequestError(req_id, f"sampling failed: {exc!r}"[:500]))
        sampled = self._without_unsampleable(sampled, errors)
        self.failed.update((e.req_id, e.message) for e in errors)
        return sampled, errors

    def _without_unsampleable(self, sampled: list[SampledToken], errors: list[RequestError]) -> list[SampledToken]:
        """Fail alone each request whose token came with a log-probability that is not finite, rather than
        send it: its row allowed no token (a grammar mask of all zeros leaves every logit -inf, so the
        log-softmax is NaN and the argmax an arbitrary id). A constrained one fails as GRAMMAR_FAILED
        (INVALID_ARGUMENT naming its constraint), any other as a sampling failure."""
        bad = {t.req_id for t in sampled if not math.isfinite(t.logprob) or any(math.isnan(v) for _, v in t.top_logprobs)}
        if not bad:
            return sampled
        for req_id in dict.fromkeys(t.req_id for t in sampled if t.req_id in bad):
            if self.structured and req_id in self.structured:
                message = f"{GRAMMAR_FAILED}{self.structured.field_of(req_id)}: no token of the vocabulary continues it here"
            else:
                message = "sampling failed: no token had a finite log-probability"
            logger.warning("request %s: %s", req_id, message)
            errors.append(RequestError(req_id, message))
        return [t for t in sampled if t.req_id not in bad]

    def _without_grammar_failures(
        self, logits: torch.Tensor, row_req_ids: list[str], errors: list[RequestError]
    ) -> tuple[torch.Tensor, list[str]]:
        """Drop the rows of requests whose grammar cannot go on (it failed to compile here, say):
        each fails alone, with a RequestError appended to `errors`. A request whose grammar is
        still compiling (off the step's path) gets GRAMMAR_PENDING: the step goes on without it,
        and the scheduler binds it again later (`StructuredOutput`'s docstring)."""
        if not self.structured:
            return logits, row_req_ids
        structured, failed = self.structured, {}
        for r in dict.fromkeys(row_req_ids):
            if r not in structured:
                continue
            if structured.defer and structured.pending(r):
                failed[r] = f"{GRAMMAR_PENDING}its grammar ({structured.field_of(r)}) is still compiling"
            elif (m := structured.error_of(r)) is not None:
                failed[r] = f"{GRAMMAR_FAILED}{structured.field_of(r)}: {m}" if "failed to compile" in m else m
        if not failed:
            return logits, row_req_ids
        errors += [RequestError(r, m) for r, m in failed.items()]
        keep = [i for i, r in enumerate(row_req_ids) if r not in failed]
        return logits[keep], [row_req_ids[i] for i in keep]

    def _sample_rows(
        self, logits: torch.Tensor, rows: list[SamplingRow], req_ids: list[str], bitmask: torch.Tensor | None = None
    ) -> list[SampledToken]:
        if not rows:
            return []
        out = self.sampler(logits, rows, bitmask)
        return [
            SampledToken(
                req_id=req_id,
                token_id=out.token_ids[i],
                logprob=out.logprobs[i] or 0.0,
                top_logprobs=out.top_logprobs[i],
            )
            for i, req_id in enumerate(req_ids)
        ]

    def sample_with_drafts(
        self, logits: torch.Tensor, row_req_ids: list[str], drafts: dict[str, list[int]]
    ) -> tuple[list[SampledToken], list[RequestError]]:
        """Verify the drafts of each request (none: k = 0); 1..k+1 tokens per request, in order.

        One bad request fails alone, as in `sample`: a request with a non-finite row among its
        k + 1 is not verified, and when verification fails on the batch each request is
        verified alone. Its rows are contiguous (`row_req_ids` lists each request k + 1 times).
        """
        errors: list[RequestError] = []
        finite = finite_rows(logits)
        if not all(finite):
            bad = {r for r, ok in zip(row_req_ids, finite) if not ok}
            errors += [RequestError(r, "the model produced non-finite logits (NaN or Inf)") for r in dict.fromkeys(row_req_ids) if r in bad]
            keep = [i for i, r in enumerate(row_req_ids) if r not in bad]
            logits, row_req_ids = logits[keep], [row_req_ids[i] for i in keep]
        logits, row_req_ids = self._without_grammar_failures(logits, row_req_ids, errors)
        try:
            sampled = self._verify(logits, row_req_ids, drafts)
        except Exception:
            logger.exception("verifying the drafts of %d rows failed: verifying each request alone", len(row_req_ids))
            sampled, start = [], 0
            for req_id in dict.fromkeys(row_req_ids):
                end = start + len(drafts.get(req_id, ())) + 1
                try:
                    sampled += self._verify(logits[start:end], row_req_ids[start:end], drafts)
                except Exception as exc:
                    logger.error("verifying request %s failed: %r", req_id, exc)
                    errors.append(RequestError(req_id, f"sampling failed: {exc!r}"[:500]))
                start = end
        sampled = self._without_unsampleable(sampled, errors)
        self.failed.update((e.req_id, e.message) for e in errors)
        return sampled, errors

    def _verify(self, logits: torch.Tensor, row_req_ids: list[str], drafts: dict[str, list[int]]) -> list[SampledToken]:
        req_ids = list(dict.fromkeys(row_req_ids))
        if not req_ids:
            return []
        rows, request_drafts = [], []
        for req_id in req_ids:
            state, draft = self.requests[req_id], drafts.get(req_id, [])
            request_drafts.append(draft)
            rows += [SamplingRow(state.sampling, state.token_ids + draft[:j], state.num_prompt_tokens) for j in range(len(draft) + 1)]
        bitmask = self.structured.bitmask(row_req_ids, drafts) if self.structured else None
        verified = verify(self.sampler, logits, rows, request_drafts, bitmask)  # masks logits in place
        chosen = [(req_id, token, row) for req_id, (tokens, row_ids) in zip(req_ids, verified) for token, row in zip(tokens, row_ids)]
        row_ids = [row for _, _, row in chosen]
        out = self.sampler.output(logits[row_ids], torch.tensor([t for _, t, _ in chosen], device=logits.device), [rows[r] for r in row_ids])
        return [
            SampledToken(req_id=req_id, token_id=token, logprob=out.logprobs[i] or 0.0, top_logprobs=out.top_logprobs[i])
            for i, (req_id, token, _) in enumerate(chosen)
        ]

    def finish_step(self, plan: StepPlan, sampled: list[SampledToken]) -> None:
        for req_id, n in plan.num_scheduled_tokens.items():
            state = self.requests[req_id]
            state.num_computed_tokens += n
            if state.images:
                self._release_computed_images(state)
        for token in sampled:
            self.requests[token.req_id].append_token(token.token_id)
            self.structured.accept(token.req_id, token.token_id)
        if plan.scheduled_spec_decode_tokens:  # roll back the rejected drafts
            num_sampled = Counter(token.req_id for token in sampled)
            for req_id, draft in plan.scheduled_spec_decode_tokens.items():
                self.requests[req_id].num_computed_tokens -= len(draft) + 1 - num_sampled[req_id]

    # -- set-up ---------------------------------------------------------------------------

    def _state(self, req_id: str) -> CachedRequestState:
        state = self.requests.get(req_id)
        if state is None:
            raise PlanError(f"request {req_id} is scheduled but the executor holds no state for it")
        return state

    def _allocate_kv_caches(self, num_blocks: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Each layer's (K, V): `kv_cache_layout.num_tensors` pairs, the i-th layer of every group on the i-th."""
        c = self.config
        shape = (num_blocks, self._block_size, c.num_kv_heads, c.head_dim)
        pairs = [
            (
                torch.zeros(shape, dtype=self.kv_cache_dtype, device=self._device),
                torch.zeros(shape, dtype=self.kv_cache_dtype, device=self._device),
            )
            for _ in range(self.kv_cache_layout.num_tensors)
        ]
        return [pairs[slot] for slot in self.kv_cache_layout.slot_of]

    @property
    def kv_cache_tensors(self) -> list[torch.Tensor]:
        """Every K and V tensor once (layers of different groups share them)."""
        unique = {id(cache): cache for pair in self.kv_caches for cache in pair}
        return list(unique.values())

    @torch.inference_mode()
    def run_dummy_prefill(self, num_tokens: int, num_logits_rows: int = 256) -> torch.Tensor:
        """One prompt of `num_tokens` through the model on a scratch cache; returns the logits' softmax.

        Sizes the activation peak for `_profile_kv_memory_bytes`; the real cache is untouched.
        """
        device = self._device
        num_blocks = math.ceil(num_tokens / self._block_size) + 1
        caches = self._allocate_kv_caches(num_blocks)
        meta = AttentionMetadata(
            slot_mapping=torch.arange(self._block_size, self._block_size + num_tokens, device=device),
            query_start_loc=torch.tensor([0, num_tokens], dtype=torch.int32, device=device),
            seq_lens=torch.tensor([num_tokens], dtype=torch.int32, device=device),
            block_table=torch.arange(1, num_blocks, dtype=torch.int32, device=device)[None, :],
            max_query_len=num_tokens,
            max_seq_len=num_tokens,
        )
        input_ids = torch.zeros(num_tokens, dtype=torch.int64, device=device)
        positions = torch.arange(num_tokens, device=device)
        hidden, residual = self.model(input_ids, positions, caches, meta, self.attention)
        logits = self.model.compute_logits(hidden, residual, positions[-min(num_tokens, num_logits_rows) :])
        return torch.softmax(logits, dim=-1)

    def _profile_kv_memory_bytes(self, gpu_memory_utilization: float, max_num_batched_tokens: int) -> int:
        """GPU memory left for the KV cache after a forward of the largest batch (one long prefill)."""
        device = self._device
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
        self.run_dummy_prefill(min(max_num_batched_tokens, self.max_model_len))
        torch.cuda.synchronize(device)
        peak = torch.cuda.max_memory_allocated(device)
        torch.cuda.empty_cache()
        free, total = torch.cuda.mem_get_info(device)
        non_torch = total - free - torch.cuda.memory_reserved(device)
        kv_bytes = int(total * gpu_memory_utilization) - peak - non_torch
        if kv_bytes <= 0:
            raise RuntimeError(
                f"no GPU memory left for the KV cache: total {total}, utilization {gpu_memory_utilization}, "
                f"peak {peak}, other processes {non_torch}"
            )
        return kv_bytes


def _describe_groups(groups: tuple[KVCacheGroupSpec, ...]) -> str:
    if len(groups) == 1 and groups[0].sliding_window is None:
        return "one KV cache group (full attention)"
    kinds = Counter("full" if g.sliding_window is None else f"window {g.sliding_window}" for g in groups)
    return f"{len(groups)} KV cache groups of {max(len(g.layer_ids) for g in groups)} layers (" + ", ".join(
        f"{n} {kind}" for kind, n in kinds.items()
    ) + ")"
