"""A processor's output as the step protocol's `ImageInput`s (the scheduler's side of issue 40).

transformers' processor (its PIL image processor: `use_fast=False` or the `...ImageProcessorPil`
classes, torchvision not being installed) expands each image's placeholder into its run of image
tokens and returns the pixels of every image on dim 0; `image_inputs` cuts that into one
`ImageInput` an image: its tensors, the span of its image tokens in the prompt and a content hash.
"""

from __future__ import annotations

import hashlib

from pagoda.step import ImageInput, ImageTensor


def placeholder_spans(token_ids: list[int], image_token_id: int) -> list[tuple[int, int]]:
    """(offset, length) of each run of `image_token_id` in `token_ids`, in order."""
    spans, start = [], None
    for i, token in enumerate([*token_ids, -1]):
        if token == image_token_id and start is None:
            start = i
        elif token != image_token_id and start is not None:
            spans.append((start, i - start))
            start = None
    return spans


def split_spans(spans: list[tuple[int, int]], lengths: list[int]) -> list[tuple[int, int]]:
    """`spans` cut into runs of `lengths` tokens in order (images side by side: LLaVA's runs touch)."""
    out, queue = [], list(lengths)
    for offset, length in spans:
        while length > 0 and queue and queue[0] <= length:
            out.append((offset, queue[0]))
            offset, length = offset + queue[0], length - queue.pop(0)
        if length:
            raise ValueError(f"a run of {length} image tokens left at {offset} does not fit the images' lengths {lengths}")
    return out


def image_inputs(
    token_ids: list[int], features, image_token_id: int, hashes: list[str] | None = None, lengths: list[int] | None = None
) -> tuple[ImageInput, ...]:
    """One `ImageInput` a run of image tokens of `token_ids` (one prompt's processor output
    `features`: "pixel_values" [images, C, H, W], and "image_sizes" where the processor gives it;
    or Qwen2.5-VL's flattened patches [patches, D] with "image_grid_thw" [images, 3]).

    `hashes`: each image's content hash (hex); by default the SHA-256 of its pixel values' bytes.
    `lengths`: each image's token count, to tell apart images whose runs touch (fewer runs than images)."""
    spans = placeholder_spans(token_ids, image_token_id)
    pixels = features["pixel_values"]
    grids = features.get("image_grid_thw")
    if grids is not None:  # Qwen2.5-VL: every image's patches on dim 0, t * h * w rows each
        ends = grids.prod(-1).cumsum(0).tolist()
        pixel_rows = [(0 if i == 0 else ends[i - 1], end) for i, end in enumerate(ends)]
    else:
        pixel_rows = [(i, i + 1) for i in range(pixels.shape[0])]
    if len(spans) < len(pixel_rows) and lengths is not None and len(lengths) == len(pixel_rows):
        spans = split_spans(spans, lengths)
    if len(spans) != len(pixel_rows):
        raise ValueError(f"{len(spans)} runs of the image token {image_token_id}, {len(pixel_rows)} images of pixel values")
    per_image = [name for name in ("image_sizes", "image_grid_thw") if name in features]
    inputs = []
    for i, (offset, length) in enumerate(spans):
        start, end = pixel_rows[i]
        tensors = (
            ImageTensor.from_torch("pixel_values", pixels[start:end]),
            *(ImageTensor.from_torch(name, features[name][i : i + 1]) for name in per_image),
        )
        digest = hashes[i] if hashes is not None else hashlib.sha256(tensors[0].data).hexdigest()
        inputs.append(ImageInput(digest, offset, length, tensors))
    return tuple(inputs)
