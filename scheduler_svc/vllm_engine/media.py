"""A `vllm.grpc.engine.GenerateRequest`'s images (issue 40): `media_refs` or `mm_inputs` beside tokenized input.

The protocol carries images two ways, and SMG's router picks by what the worker advertises
(GetServerInfo's `mm_processor`; its `--mm-processing auto|router|worker`):

    media_refs   the router rendered the chat and tokenized it with one UNEXPANDED placeholder an
                 image (the token the chat template writes: LLaVA's `<image>`, Gemma 3's
                 `<start_of_image>`, Qwen's `<|image_pad|>`), and forwards each image's URL as the
                 client sent it. Pagoda fetches and decodes it exactly as a `pagoda.v1` chat's image
                 (data: URLs; http(s) only of --allowed-media-domains; the byte, pixel, format and
                 --limit-mm-per-prompt checks) and runs the model's own processor on it
                 (`media.ImagePrompts.expand`): the answer is Pagoda's chat path's, transformers'.
                 Pagoda advertises this (`mm_processor` "inprocess"), so SMG's auto mode sends it.
    mm_inputs    the router ran its own image processor: the ids come expanded, with the pixels as
                 raw tensors (`TensorData`, inline bytes), model-specific tensors (Qwen's
                 `image_grid_thw`) and each image's placeholder range. Every shape, dtype and byte
                 count is held to what this model's processor makes (`ImagePrompts.preprocessed`);
                 the prefix cache keys each image by the SHA-256 of its pixels, not the router's hashes.

Refused, naming the field: media with text input, both ways at once, `extra_mm_inputs` and
modalities other than images, pixel-less inputs (a P/D decode side's), tensors in shared memory
or remote (`shm`, `remote`: only `inline` is read).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from smg_grpc_proto import vllm_engine_pb2 as vpb
from smg_grpc_proto.generated import common_pb2

from pagoda.v1 import generation_pb2 as pb
from scheduler_svc.errors import InvalidArgument
from scheduler_svc.media import MAX_IMAGE_BYTES, MediaConfig, check_image, decode_image, image_bytes

# TensorData's dtypes as torch's
TENSOR_DTYPES = ("float32", "bfloat16", "float16", "int64", "uint32", "int32")
# All of one request's tensors: the images' limit times the largest image's bytes would do, but
# the gRPC message limit binds first; this bounds the copies made before the shapes are checked.
MAX_TENSOR_BYTES = 16 * MAX_IMAGE_BYTES


@dataclass(frozen=True)
class MediaRefsInput:
    """`media_refs`: each image's URL; run through the processor like a chat's images."""

    urls: tuple[str, ...]
    field: str = "media_refs"

    def check(self, media: MediaConfig) -> None:
        for k, url in enumerate(self.urls):
            name = f"{self.field}.items[{k}]"
            check_image(pb.Image(url=url), name, k + 1, media, url_field=f"{name}.url")

    def prompt(self, images, ids: list[int], max_tokens: int, media: MediaConfig):
        pictures = []
        for k, url in enumerate(self.urls):
            name = f"{self.field}.items[{k}]"
            pictures.append(decode_image(image_bytes(pb.Image(url=url), name, media.allowed_domains, f"{name}.url"), name))
        return images.expand(ids, pictures, max_tokens, "tokenized.input_ids")


@dataclass(frozen=True)
class PixelInput:
    """`mm_inputs`: the router's pixels and placeholder ranges, checked against the model's processor."""

    mm: vpb.MultimodalInputs
    field: str = "mm_inputs"

    def check(self, media: MediaConfig) -> None:
        mm = self.mm
        if mm.modality not in (common_pb2.Modality.Value("IMAGE"), 0):
            raise InvalidArgument(f"{self.field}.modality", f"{common_pb2.Modality.Name(mm.modality)}: only images are served")
        if mm.HasField("encoder_input_key") and mm.encoder_input_key not in ("", "pixel_values"):
            raise InvalidArgument(f"{self.field}.encoder_input_key", f"{mm.encoder_input_key!r}: this engine's encoders "
                                                                     f"take pixel_values")
        if not mm.HasField("pixel_values"):
            raise InvalidArgument(f"{self.field}.pixel_values", "is required (a pixel-less input needs a KV transfer, "
                                                                "which this engine does not serve)")
        if len(mm.mm_placeholders) > media.limit_images:
            raise InvalidArgument(f"{self.field}.mm_placeholders", f"{len(mm.mm_placeholders)} images, more than "
                                                                   f"{media.limit_images} (--limit-mm-per-prompt image=N)")
        total = 0
        for name, tensor in self._tensors():
            total += _check_tensor(tensor, name)
        if total > MAX_TENSOR_BYTES:
            raise InvalidArgument(self.field, f"{total} bytes of tensors, more than {MAX_TENSOR_BYTES}")

    def _tensors(self):
        yield f"{self.field}.pixel_values", self.mm.pixel_values
        for key, tensor in self.mm.model_specific_tensors.items():
            yield f"{self.field}.model_specific_tensors[{key}]", tensor

    def prompt(self, images, ids: list[int], max_tokens: int, media: MediaConfig):
        mm = self.mm
        if mm.HasField("im_token_id") and mm.im_token_id != images.image_token_id:
            raise InvalidArgument(f"{self.field}.im_token_id", f"{mm.im_token_id}: this model's image token is "
                                                               f"{images.image_token_id}")
        tensors = {"pixel_values": _to_torch(mm.pixel_values)}
        for key, tensor in mm.model_specific_tensors.items():
            tensors[key] = _to_torch(tensor)
        ranges = [(p.offset, p.length) for p in mm.mm_placeholders]
        return images.preprocessed(ids, tensors, ranges, max_tokens, self.field, media.limit_images)


def request_media(req: vpb.GenerateRequest) -> MediaRefsInput | PixelInput | None:
    """The request's images (None: a text request); InvalidArgument naming the field if they cannot be served."""
    has_refs, has_mm = req.HasField("media_refs"), req.HasField("mm_inputs")
    if req.extra_mm_inputs:
        raise InvalidArgument("extra_mm_inputs", "only one batch of images is served (no video or audio)")
    if not has_refs and not has_mm:
        return None
    if has_refs and has_mm:
        raise InvalidArgument("media_refs", "media_refs and mm_inputs are not both set")
    if req.WhichOneof("input") != "tokenized":
        raise InvalidArgument("media_refs" if has_refs else "mm_inputs", "needs tokenized input (send `tokenized`)")
    if has_mm:
        return PixelInput(req.mm_inputs)
    if not req.media_refs.items:
        raise InvalidArgument("media_refs.items", "media_refs is set but carries no items")
    for k, item in enumerate(req.media_refs.items):
        if item.modality != common_pb2.Modality.Value("IMAGE"):
            raise InvalidArgument(f"media_refs.items[{k}].modality",
                                  f"{common_pb2.Modality.Name(item.modality)}: only images are served")
    return MediaRefsInput(tuple(item.url for item in req.media_refs.items))


def media_ref_schemes(media: MediaConfig) -> str:
    """GetServerInfo's `mm_media_ref_schemes`: data, and http(s) where --allowed-media-domains names any."""
    return "http,https,data" if media.allowed_domains else "data"


def _check_tensor(tensor: vpb.TensorData, name: str) -> int:
    """The tensor's byte count; InvalidArgument naming it unless its payload is inline and fits its shape and dtype."""
    kind = tensor.WhichOneof("payload")
    if kind != "inline":
        raise InvalidArgument(name, f"payload {kind or 'none'}: only inline bytes are read (no shared memory or remote "
                                    f"tensors: the router's --multimodal-tensor-transport inline)")
    if tensor.dtype not in TENSOR_DTYPES:
        raise InvalidArgument(name, f"dtype {tensor.dtype!r}: expected one of {', '.join(TENSOR_DTYPES)}")
    if not tensor.shape or any(d == 0 for d in tensor.shape):
        raise InvalidArgument(name, f"shape {list(tensor.shape)}: empty")
    itemsize = 2 if tensor.dtype in ("bfloat16", "float16") else 8 if tensor.dtype == "int64" else 4
    expected = math.prod(tensor.shape) * itemsize
    if expected > MAX_TENSOR_BYTES:
        raise InvalidArgument(name, f"shape {list(tensor.shape)} of {tensor.dtype}: {expected} bytes, more than "
                                    f"{MAX_TENSOR_BYTES}")
    if len(tensor.inline) != expected:
        raise InvalidArgument(name, f"{len(tensor.inline)} bytes, shape {list(tensor.shape)} of {tensor.dtype} needs {expected}")
    return expected


def _to_torch(tensor: vpb.TensorData):
    """The tensor (checked by `_check_tensor`): little-endian bytes in C order; uint32 read as int64."""
    import numpy as np
    import torch

    if tensor.dtype == "uint32":
        return torch.from_numpy(np.frombuffer(tensor.inline, dtype="<u4").astype(np.int64)).reshape(tuple(tensor.shape))
    dtype = getattr(torch, tensor.dtype)
    return torch.frombuffer(bytearray(tensor.inline), dtype=torch.uint8).view(dtype).reshape(tuple(tensor.shape))
