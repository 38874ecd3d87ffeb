"""Images in: a vision-language model's vision tower and projector, and the encoder cache.

The tower and projector are transformers' own modules, built from the checkpoint's config
and filled from its weights; `VisionEncoder.encode` calls the model class's own
`get_image_features` on them (LLaVA's feature layer and select strategy, Gemma 3's average
pool to 256 soft tokens, Qwen2.5-VL's windowed transformer and patch merger; its `get_rope_index`
gives a prompt's 3-D rotary positions), so the features are transformers' to the bit. The decoder
(`executor_svc.model.DecoderModel`) then takes each image's rows in place of the embeddings
of its placeholder tokens (`ImageInput.offset`, `length`)::

    token_ids   [ t t t <img> <img> <img> <img> t t ]       an image of 4 rows at offset 3
    embeddings  [ e e e  v0    v1    v2    v3   e e ]

Encoder cache (`EncoderCache`): an image is encoded once, when a step first schedules one of
its placeholder tokens, keyed by its content hash (two requests with the same image share
one entry); its rows stay until every request holding it has computed all of its
placeholder tokens (or is dropped), so a prefill chunk may end inside an image and the next
chunk reads the rest. The cache is bounded (`capacity_rows`) and counts its rows and bytes.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from torch import nn

from pagoda.step import ImageInput

logger = logging.getLogger(__name__)


class ImageError(ValueError):
    """An image of a request that the executor cannot encode or place (its request fails alone)."""


def _holder_class(base_model_class, parts: dict[str, Any], methods: tuple[str, ...] = ()):
    """A transformers `PreTrainedModel` of the multimodal config holding only the vision parts
    (`parts`: attribute -> factory of the config), with the base model's `get_image_features`
    (and its `methods`)."""

    pretrained = base_model_class.__mro__[1]  # e.g. LlavaPreTrainedModel

    class VisionParts(pretrained):
        def __init__(self, config) -> None:
            super().__init__(config)
            for name, build in parts.items():
                setattr(self, name, build(config))
            self.post_init()

        get_image_features = base_model_class.get_image_features

    for name in methods:
        setattr(VisionParts, name, getattr(base_model_class, name))
    VisionParts.__name__ = f"{base_model_class.__name__}VisionParts"
    return VisionParts


def _llava_parts():
    from transformers import AutoModel
    from transformers.models.llava.modeling_llava import LlavaModel, LlavaMultiModalProjector

    return _holder_class(
        LlavaModel,
        {"vision_tower": lambda c: AutoModel.from_config(c.vision_config), "multi_modal_projector": LlavaMultiModalProjector},
    )


def _gemma3_parts():
    from transformers import AutoModel
    from transformers.models.gemma3.modeling_gemma3 import Gemma3Model, Gemma3MultiModalProjector

    return _holder_class(
        Gemma3Model,
        {"vision_tower": lambda c: AutoModel.from_config(c.vision_config), "multi_modal_projector": Gemma3MultiModalProjector},
    )


def _qwen2_5_vl_parts():
    from transformers.models.qwen2_5_vl.modeling_qwen2_5_vl import Qwen2_5_VisionTransformerPretrainedModel, Qwen2_5_VLModel

    return _holder_class(
        Qwen2_5_VLModel,
        {"visual": lambda c: Qwen2_5_VisionTransformerPretrainedModel._from_config(c.vision_config)},
        ("get_rope_index", "get_vision_position_ids"),
    )


# architecture -> (the holder class's factory, the processor tensors its get_image_features takes)
_FAMILIES = {
    "LlavaForConditionalGeneration": (_llava_parts, ("pixel_values", "image_sizes")),
    "Gemma3ForConditionalGeneration": (_gemma3_parts, ("pixel_values",)),
    "Qwen2_5_VLForConditionalGeneration": (_qwen2_5_vl_parts, ("pixel_values", "image_grid_thw")),
}
# where a checkpoint keeps the vision parts (the layout depends on the transformers version that saved it)
_PREFIXES = ("model.vision_tower.", "model.multi_modal_projector.", "vision_tower.", "multi_modal_projector.", "model.visual.", "visual.")


def vision_architectures() -> tuple[str, ...]:
    return tuple(_FAMILIES)


def is_vision_weight(name: str) -> bool:
    return name.startswith(_PREFIXES)


# where a checkpoint keeps the language model (the layout depends on the transformers version too)
_TEXT_PREFIXES = {"model.language_model.": "model.", "language_model.model.": "model.", "language_model.lm_head.": "lm_head."}


def text_weight_name(name: str) -> str | None:
    """A multimodal checkpoint's tensor under the text model's name; None for the vision tower's
    and projector's (they are `VisionEncoder.load`'s)."""
    if is_vision_weight(name):
        return None
    for prefix, text in _TEXT_PREFIXES.items():
        if name.startswith(prefix):
            return text + name.removeprefix(prefix)
    return name


def top_level_overrides(hf) -> dict:
    """What a multimodal config sets for the whole model over its text config: tied embeddings, eos ids."""
    changes = {}
    if hasattr(hf, "tie_word_embeddings"):
        changes["tie_word_embeddings"] = bool(hf.tie_word_embeddings)
    eos = getattr(hf, "eos_token_id", None)
    if eos is not None:
        changes["eos_token_ids"] = tuple(eos) if isinstance(eos, (list, tuple)) else (eos,)
    return changes


class VisionEncoder(nn.Module):
    """transformers' vision tower and projector of a multimodal checkpoint; one image at a time or a batch."""

    def __init__(self, hf_config, architecture: str, device: torch.device, dtype: torch.dtype) -> None:
        super().__init__()
        from transformers.initialization import no_init_weights

        factory, self.tensor_names = _FAMILIES[architecture]
        self.architecture = architecture
        self.image_token_id = int(hf_config.image_token_id)
        self.hidden_size = hf_config.get_text_config().hidden_size
        with no_init_weights(), torch.device(device):
            self.parts = factory()(hf_config).to(dtype)
        self.parts.eval()

    @property
    def dtype(self) -> torch.dtype:
        return next(self.parts.parameters()).dtype

    @property
    def device(self) -> torch.device:
        return next(self.parts.parameters()).device

    def load(self, files: list[Path]) -> None:
        """Fill the tower and projector from the checkpoint's safetensors files; every tensor once."""
        state = {}
        for path in files:
            with safe_open(str(path), framework="pt") as f:
                for name in f.keys():  # noqa: SIM118 (safe_open is not iterable)
                    if is_vision_weight(name):
                        state[name.removeprefix("model.")] = f.get_tensor(name)
        missing, unexpected = self.parts.load_state_dict(state, strict=False)
        missing = [m for m in missing if m in dict(self.parts.named_parameters())]  # (buffers are the config's)
        if missing or unexpected:
            from executor_svc.loader import UnsupportedModelError

            raise UnsupportedModelError(
                f"the checkpoint's vision weights do not fit {self.architecture}'s tower and projector: "
                f"missing {missing[:3]}, unexpected {unexpected[:3]}"
            )

    @torch.inference_mode()
    def encode(self, tensors: dict[str, torch.Tensor]) -> list[torch.Tensor]:
        """The projected features of a batch of images (the processor's tensors, images on dim 0):
        one [rows, text hidden] tensor an image, in the model's dtype."""
        kwargs = {name: t.to(self.device) for name, t in tensors.items() if name != "pixel_values"}
        pixel_values = tensors["pixel_values"].to(self.device, self.dtype)
        out = self.parts.get_image_features(pixel_values=pixel_values, return_dict=True, **kwargs).pooler_output
        return [rows.reshape(-1, self.hidden_size) for rows in out]

    def check(self, image: ImageInput, token_ids: list[int]) -> dict[str, torch.Tensor]:
        """The image's tensors, checked against what this model takes and its placeholder span."""
        names = [t.name for t in image.tensors]
        if "pixel_values" not in names:
            raise ImageError(f"image {image.hash[:16]}: no pixel_values tensor")
        unknown = [n for n in names if n not in self.tensor_names]
        if unknown or len(set(names)) != len(names):
            raise ImageError(f"image {image.hash[:16]}: tensors {names} (this model takes {list(self.tensor_names)}, each once)")
        tensors = {t.name: t.to_torch() for t in image.tensors}
        pixels = tensors["pixel_values"]
        if "image_grid_thw" in self.tensor_names:  # patches flattened: [t * h * w, C * T * P * P]
            grid = tensors.get("image_grid_thw")
            if grid is None or grid.shape != (1, 3) or grid.is_floating_point():
                raise ImageError(f"image {image.hash[:16]}: image_grid_thw must be one integer row (t, h, w)")
            if pixels.ndim != 2 or pixels.shape[0] != int(grid.prod()) or not pixels.is_floating_point():
                raise ImageError(f"image {image.hash[:16]}: pixel_values shape {list(pixels.shape)} {pixels.dtype} (expected [{int(grid.prod())}, D], floating point)")
        elif pixels.ndim != 4 or pixels.shape[0] != 1 or not pixels.is_floating_point():
            raise ImageError(f"image {image.hash[:16]}: pixel_values shape {list(pixels.shape)} {pixels.dtype} (expected [1, C, H, W], floating point)")
        if image.length == 0 or image.end > len(token_ids):
            raise ImageError(f"image {image.hash[:16]}: placeholder span [{image.offset}, {image.end}) outside the prompt of {len(token_ids)} tokens")
        if any(t != self.image_token_id for t in token_ids[image.offset : image.end]):
            raise ImageError(f"image {image.hash[:16]}: tokens [{image.offset}, {image.end}) are not all the image token {self.image_token_id}")
        return tensors

    def rope_positions(self, token_ids: list[int], grids: list[torch.Tensor]) -> tuple[torch.Tensor, int]:
        """Qwen2.5-VL's 3-D rotary positions of a prompt ([3, len], transformers' `get_rope_index`) and
        the offset of every later token's position from its index."""
        ids = torch.tensor([token_ids])
        types = (ids == self.image_token_id).int()
        grid = torch.cat(grids) if grids else None
        positions, delta = self.parts.get_rope_index(ids, types, image_grid_thw=grid)
        return positions[:, 0], int(delta)


@dataclass
class _Entry:
    rows: torch.Tensor  # [length, hidden]
    holders: set[str] = field(default_factory=set)  # request ids that still need it


class EncoderCache:
    """Encoder outputs by image hash, held while a request still has placeholder tokens to compute.

    `capacity_rows` bounds the rows held at once (an image that would pass it fails its request);
    `num_rows`, `num_bytes` and `num_encoded` (images encoded since start) count it.
    """

    def __init__(self, capacity_rows: int) -> None:
        self.capacity_rows = capacity_rows
        self.entries: dict[str, _Entry] = {}
        self.num_encoded = 0

    def __contains__(self, image_hash: str) -> bool:
        return image_hash in self.entries

    @property
    def num_rows(self) -> int:
        return sum(e.rows.shape[0] for e in self.entries.values())

    @property
    def num_bytes(self) -> int:
        return sum(e.rows.nbytes for e in self.entries.values())

    def room_for(self, rows: int) -> bool:
        return self.num_rows + rows <= self.capacity_rows

    def put(self, image_hash: str, rows: torch.Tensor) -> None:
        self.entries[image_hash] = _Entry(rows)
        self.num_encoded += 1

    def hold(self, image_hash: str, req_id: str) -> torch.Tensor:
        entry = self.entries[image_hash]
        entry.holders.add(req_id)
        return entry.rows

    def get(self, image_hash: str) -> torch.Tensor:
        return self.entries[image_hash].rows

    def release(self, image_hash: str, req_id: str) -> None:
        """`req_id` no longer needs the image; the entry is freed once nobody does."""
        entry = self.entries.get(image_hash)
        if entry is None:
            return
        entry.holders.discard(req_id)
        if not entry.holders:
            del self.entries[image_hash]

    def release_all(self, req_id: str, hashes) -> None:
        for image_hash in hashes:
            self.release(image_hash, req_id)

    def clear(self) -> None:
        self.entries.clear()

    def check_integrity(self, live: dict[str, set[str]]) -> None:
        """Every entry is held, by exactly the requests `live` says hold it (hash -> request ids)."""
        held = {h: e.holders for h, e in self.entries.items()}
        if held != live:
            raise AssertionError(f"encoder cache holders {held} != the requests' {live}")
        if self.num_rows > self.capacity_rows:
            raise AssertionError(f"encoder cache holds {self.num_rows} rows, over its capacity {self.capacity_rows}")
