"""A chat's images (issue 40): checked before any work, then run through the model's processor.

`ChatMessage.parts` hold text and images in order. Before anything is decoded (`check_parts`,
on the event loop: cheap): `content` and `parts` are not both set, at most `limit_images` images
(`--limit-mm-per-prompt image=N`), each one raw bytes or a URL (not both), at most
MAX_IMAGE_BYTES. A `data:` URL carries its bytes (base64); any other URL must be http(s) of a
domain in `--allowed-media-domains` (off by default: nothing a request names is fetched). Then, on
the prompt worker's threads: an allowed URL is fetched (redirects only to allowed domains too,
within FETCH_TIMEOUT_S in all and MAX_IMAGE_BYTES; a failure is INVALID_ARGUMENT naming the url),
the header is read (PIL's `Image.open` is lazy) and the format (PNG, JPEG, WebP, GIF: its first
frame) and the pixel count (at most MAX_IMAGE_PIXELS) checked before the pixels are decoded;
PIL's own bomb check (`Image.MAX_IMAGE_PIXELS`) stays on beneath. Every bad image is
INVALID_ARGUMENT naming `prompt.chat.messages[i].parts[j].image`.

The chat template sees a message with parts as transformers' processors do: `content` a list of
`{"type": "text", "text": ...}` and `{"type": "image"}` items (`scheduler_svc.chat`). The model's
own processor (transformers', loaded from the model folder with its PIL image processor:
torchvision does not install beside this torch) expands each image's placeholder and gives the
pixels; `pagoda.images.image_inputs` cuts them into one `ImageInput` an image, keyed by the
SHA-256 of its pixels (the prefix cache's extra key and the executor's encoder cache key).
"""

from __future__ import annotations

import base64
import binascii
import http.client
import io
import json
import logging
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlsplit

from scheduler_svc.errors import InvalidArgument

log = logging.getLogger(__name__)

DEFAULT_LIMIT_IMAGES = 16  # --limit-mm-per-prompt image=N
MAX_IMAGE_BYTES = 20 * 1024 * 1024  # one image's encoded bytes (the gRPC message limit usually binds first)
MAX_IMAGE_PIXELS = 25_000_000  # width x height, read from the header before decoding
FETCH_TIMEOUT_S = 10.0  # an image URL of an allowed domain: fetched within this, in all
FORMATS = ("PNG", "JPEG", "WEBP", "GIF")


@dataclass(frozen=True)
class MediaConfig:
    limit_images: int = DEFAULT_LIMIT_IMAGES
    allowed_domains: tuple[str, ...] = ()


def parse_limit_mm(values: list[str] | None) -> int:
    """`--limit-mm-per-prompt image=N` (also as JSON, vLLM's `{"image": N}`): the image limit."""
    limit = DEFAULT_LIMIT_IMAGES
    for value in values or ():
        pairs = json.loads(value).items() if value.lstrip().startswith("{") else [value.split("=", 1)]
        for pair in pairs:
            if len(pair) != 2 or pair[0] != "image":
                raise ValueError(f"{value!r}: expected image=N (only images are taken)")
            limit = int(pair[1])
            if limit < 0:
                raise ValueError(f"{value!r}: N must be >= 0")
    return limit


def image_parts(chat) -> list[tuple[int, int, object]]:
    """(message index, part index, `pb.Image`) of each image of `chat`, in order."""
    return [(i, j, part.image) for i, m in enumerate(chat.messages) for j, part in enumerate(m.parts)
            if part.WhichOneof("kind") == "image"]


def has_images(req) -> bool:
    return req.WhichOneof("prompt") == "chat" and any(
        part.WhichOneof("kind") == "image" for m in req.chat.messages for part in m.parts)


def check_parts(chat, field: str, media: MediaConfig) -> None:
    """The checks that need no decoding; InvalidArgument naming the field."""
    num_images = 0
    for i, m in enumerate(chat.messages):
        if m.parts and m.content:
            raise InvalidArgument(f"{field}.messages[{i}].parts", "content and parts are not both set")
        for j, part in enumerate(m.parts):
            kind = part.WhichOneof("kind")
            if kind is None:
                raise InvalidArgument(f"{field}.messages[{i}].parts[{j}]", "one of text or image is required")
            if kind != "image":
                continue
            num_images += 1
            check_image(part.image, f"{field}.messages[{i}].parts[{j}].image", num_images, media)


def check_image(image, name: str, number: int, media: MediaConfig, url_field: str | None = None) -> None:
    """The checks of the `number`th image of a prompt (a `pb.Image`) that need no decoding; InvalidArgument
    naming `name` (its url: `url_field`, by default `name.url`)."""
    url_field = url_field or f"{name}.url"
    if number > media.limit_images:
        raise InvalidArgument(name, f"more than {media.limit_images} images in one prompt (--limit-mm-per-prompt image=N)")
    if image.data and image.url:
        raise InvalidArgument(name, "one of data or url, not both")
    if not image.data and not image.url:
        raise InvalidArgument(name, "one of data or url is required")
    if image.data:
        if len(image.data) > MAX_IMAGE_BYTES:
            raise InvalidArgument(name, f"{len(image.data)} bytes, more than {MAX_IMAGE_BYTES}")
    elif image.url.startswith("data:"):
        if len(image.url) > MAX_IMAGE_BYTES * 4 // 3 + 256:
            raise InvalidArgument(name, f"a data: URL of {len(image.url)} characters, more than {MAX_IMAGE_BYTES} bytes hold")
    else:
        check_url(image.url, url_field, media.allowed_domains)


def _allowed(host: str, domains) -> bool:
    return bool(host) and any(host == d or host.endswith("." + d) for d in domains)


def check_url(url: str, field: str, domains) -> None:
    """An http(s) URL of an allowed domain (or a subdomain of one); InvalidArgument otherwise."""
    parts = urlsplit(url)
    host = parts.hostname or ""
    if parts.scheme not in ("http", "https") or not _allowed(host, domains):
        raise InvalidArgument(field, f"only data: URLs, or http(s) URLs of --allowed-media-domains (none allowed for "
                                     f"{parts.scheme}://{host}); or send the bytes in data")


class _AllowedRedirects(urllib.request.HTTPRedirectHandler):
    """Redirects followed only to allowed domains."""

    def __init__(self, domains, field: str):
        self.domains, self.field = domains, field

    def redirect_request(self, req, fp, code, msg, headers, newurl):
        check_url(newurl, self.field, self.domains)
        return super().redirect_request(req, fp, code, msg, headers, newurl)


def fetch_image(url: str, field: str, domains, timeout: float = FETCH_TIMEOUT_S) -> bytes:
    """The bytes at `url` (an allowed domain's; redirects too), within `timeout` seconds in all and MAX_IMAGE_BYTES."""
    check_url(url, field, domains)
    deadline = time.monotonic() + timeout
    opener = urllib.request.build_opener(_AllowedRedirects(domains, field))
    chunks, size = [], 0
    try:
        with opener.open(urllib.request.Request(url, headers={"User-Agent": "pagoda"}), timeout=timeout) as response:
            length = response.headers.get("Content-Length")
            if length and length.isdigit() and int(length) > MAX_IMAGE_BYTES:
                raise InvalidArgument(field, f"{length} bytes, more than {MAX_IMAGE_BYTES}")
            while chunk := response.read(64 * 1024):
                size += len(chunk)
                if size > MAX_IMAGE_BYTES:
                    raise InvalidArgument(field, f"more than {MAX_IMAGE_BYTES} bytes")
                if time.monotonic() > deadline:
                    raise InvalidArgument(field, f"not fetched within {timeout:g} s")
                chunks.append(chunk)
    except InvalidArgument:
        raise
    except (OSError, ValueError, http.client.HTTPException) as exc:  # URLError, HTTPError and timeouts are OSErrors
        raise InvalidArgument(field, f"could not be fetched: {exc}") from None
    return b"".join(chunks)


def image_bytes(image, name: str, domains=(), url_field: str | None = None) -> bytes:
    url_field = url_field or f"{name}.url"
    if image.data:
        return image.data
    if not image.url.startswith("data:"):
        return fetch_image(image.url, url_field, domains)
    header, sep, payload = image.url.partition(",")
    if not sep or not header.endswith(";base64"):
        raise InvalidArgument(url_field, "a data: URL must be data:<type>;base64,<payload>")
    try:
        return base64.b64decode(payload, validate=True)
    except (binascii.Error, ValueError) as exc:
        raise InvalidArgument(url_field, f"not base64: {exc}") from None


def decode_image(data: bytes, name: str):
    """The image as an RGB PIL image; the format and pixel count checked from the header first."""
    from PIL import Image, UnidentifiedImageError

    if len(data) > MAX_IMAGE_BYTES:
        raise InvalidArgument(name, f"{len(data)} bytes, more than {MAX_IMAGE_BYTES}")
    try:
        image = Image.open(io.BytesIO(data), formats=FORMATS)  # reads the header only
    except UnidentifiedImageError:
        raise InvalidArgument(name, f"not an image of a supported format ({', '.join(FORMATS)})") from None
    except Image.DecompressionBombError as exc:
        raise InvalidArgument(name, f"too many pixels: {exc}") from None
    width, height = image.size
    if width * height > MAX_IMAGE_PIXELS:
        raise InvalidArgument(name, f"{width}x{height} pixels, more than {MAX_IMAGE_PIXELS}")
    if width == 0 or height == 0:
        raise InvalidArgument(name, f"{width}x{height} pixels: empty")
    try:
        image.seek(0)  # GIF: the first frame
        return image.convert("RGB")
    except (OSError, ValueError, SyntaxError, Image.DecompressionBombError) as exc:
        raise InvalidArgument(name, f"cannot be decoded ({image.format}): {exc}") from None


def is_vision_language(model_dir: Path | str) -> bool:
    try:
        return "vision_config" in json.loads((Path(model_dir) / "config.json").read_text())
    except (OSError, ValueError):
        return False


class ImagePrompts:
    """The model's processor and the image token: a chat with images as token ids and `ImageInput`s."""

    def __init__(self, processor, image_token_id: int):
        self.processor = processor
        self.image_token_id = image_token_id

    @classmethod
    def load(cls, model_dir: Path | str | None) -> ImagePrompts | None:
        """The folder's processor, or None for a text-only model (or a folder without one: logged)."""
        if model_dir is None or not is_vision_language(model_dir):
            return None
        from transformers import AutoProcessor

        config = json.loads((Path(model_dir) / "config.json").read_text())
        try:
            if config.get("model_type") in QwenVLProcessor.MODEL_TYPES:
                processor = QwenVLProcessor.load(model_dir, config)
            else:
                processor = AutoProcessor.from_pretrained(str(model_dir), backend="pil")
                if not hasattr(processor, "image_processor"):  # (a tokenizer: the folder has no processor files)
                    raise ValueError("no image processor in the folder")
        except Exception as exc:  # a folder without processor files, say: images are then refused
            log.warning("the model folder's processor does not load (%s): requests with images are refused", exc)
            return None
        # the model's placeholder (the one its encoder output replaces): Gemma 3's processor names its
        # <start_of_image> image_token_id, while its soft tokens are the config's image_token_index
        token_id = config.get("image_token_id", config.get("image_token_index"))
        if token_id is None:
            token_id = getattr(processor, "image_token_id", None)
        if token_id is None:
            log.warning("no image token in the processor or config.json: requests with images are refused")
            return None
        return cls(processor, int(token_id))

    def prompt(self, text: str, images: list, max_tokens: int | None, field: str = "prompt.chat"):
        """(token ids, ImageInputs) of the rendered chat `text` with its decoded `images`."""
        from pagoda.images import image_inputs

        features = self.processor(text=[text], images=images, add_special_tokens=False, return_tensors="pt")
        ids = features["input_ids"][0].tolist()
        if max_tokens is not None and len(ids) > max_tokens:
            raise InvalidArgument(field, f"{len(ids)} tokens (its images' included) leave no room to generate "
                                                 f"within {max_tokens + 1} tokens (max_model_len)")
        lengths = None
        counts = getattr(self.processor, "_get_num_multimodal_tokens", None)
        if counts is not None and len(images) > 1:  # images side by side: their runs touch
            try:
                lengths = list(counts(image_sizes=[(image.height, image.width) for image in images]).num_image_tokens)
            except Exception:  # (a processor without the counts for images)
                lengths = None
        return ids, image_inputs(ids, features, self.image_token_id, lengths=lengths)

    @property
    def anchor(self) -> str:
        """What a chat template writes for one image and the processor expands (`<image>`, Gemma 3's
        `<start_of_image>`, Qwen's `<|image_pad|>`): the placeholder of a prompt tokenized elsewhere."""
        return self.processor.image_token

    def anchor_id(self) -> int:
        return int(self.processor.tokenizer.convert_tokens_to_ids(self.anchor))

    def expand(self, ids: list[int], images: list, max_tokens: int | None, field: str):
        """(token ids, ImageInputs) of a prompt tokenized elsewhere with one `anchor` an image (a router's
        `media_refs`). When the ids are what their text tokenizes to (a router that rendered and tokenized
        the chat as Pagoda does), the processor runs on that text: the prompt a chat with these images
        gets here (the tokens around an image may merge: Gemma 3's "\n\n" after one). Other ids are
        expanded as vLLM's processor expands a tokenized prompt: each anchor becomes the tokens the
        processor makes of it with its image, the rest of the ids as they are."""
        import torch

        from pagoda.images import image_inputs

        anchor_id = self.anchor_id()
        positions = [k for k, token in enumerate(ids) if token == anchor_id]
        if len(positions) != len(images):
            raise InvalidArgument(field, f"{len(positions)} image placeholders ({self.anchor!r}, id {anchor_id}) for "
                                         f"{len(images)} images: one a media item, unexpanded")
        tokenizer = self.processor.tokenizer
        text = tokenizer.decode(ids, skip_special_tokens=False, clean_up_tokenization_spaces=False)
        if tokenizer(text, add_special_tokens=False)["input_ids"] == list(ids):
            return self.prompt(text, images, max_tokens, field)
        out, tensors, lengths, start = [], {}, [], 0
        for position, image in zip(positions, images):
            features = self.processor(text=[self.anchor], images=[image], add_special_tokens=False, return_tensors="pt")
            fragment = features["input_ids"][0].tolist()
            out += ids[start:position] + fragment
            start = position + 1
            lengths.append(fragment.count(self.image_token_id))
            for key, value in features.items():
                if key not in ("input_ids", "attention_mask", "token_type_ids"):
                    tensors.setdefault(key, []).append(value)
        out += ids[start:]
        if max_tokens is not None and len(out) > max_tokens:
            raise InvalidArgument(field, f"{len(out)} tokens (its images' included) leave no room to generate "
                                         f"within {max_tokens + 1} tokens (max_model_len)")
        merged = {key: torch.cat(values) for key, values in tensors.items()}
        return out, image_inputs(out, merged, self.image_token_id, lengths=lengths)

    def reference(self) -> dict:
        """What the processor gives for one image: each tensor's shape and dtype (pixel_values' shape
        per image, or per patch with a grid), and the image tokens of a fixed-size image."""
        if getattr(self, "_reference", None) is None:
            from PIL import Image

            features = self.processor(text=[self.anchor], images=[Image.new("RGB", (64, 48))], add_special_tokens=False,
                                      return_tensors="pt")
            self._reference = {
                "shapes": {k: tuple(v.shape) for k, v in features.items() if k not in ("input_ids", "attention_mask",
                                                                                        "token_type_ids")},
                "tokens": features["input_ids"][0].tolist().count(self.image_token_id),
            }
        return self._reference

    def preprocessed(self, ids: list[int], tensors: dict, placeholders: list[tuple[int, int]], max_tokens: int | None,
                     field: str, limit_images: int = DEFAULT_LIMIT_IMAGES):
        """(token ids, ImageInputs) of a prompt a router expanded itself, with the pixels it made (vLLM's
        `mm_inputs`): `tensors` by the processor's names (torch tensors), `placeholders` (offset, length) a
        range of ids an image. Every shape is held to what this model's processor gives: the pixels of
        each image (or, with a grid, of its patches), one run of `image_token_id` an image, as long as
        its encoder output, inside its range. InvalidArgument naming `field`.<tensor or placeholder> else."""
        import torch

        from pagoda.images import image_inputs

        reference = self.reference()
        pixels = tensors.get("pixel_values")
        if pixels is None:
            raise InvalidArgument(f"{field}.pixel_values", "is required (pixel-less inputs need a KV transfer, not served)")
        if pixels.dtype not in (torch.float32, torch.float16, torch.bfloat16):
            raise InvalidArgument(f"{field}.pixel_values", f"dtype {str(pixels.dtype).removeprefix('torch.')}: expected "
                                                           f"float32, float16 or bfloat16")
        num = len(placeholders)
        if num == 0:
            raise InvalidArgument(f"{field}.mm_placeholders", "one range an image is required")
        if num > limit_images:
            raise InvalidArgument(f"{field}.mm_placeholders", f"{num} images, more than {limit_images} "
                                                              f"(--limit-mm-per-prompt image=N)")
        per_image = reference["shapes"]["pixel_values"][1:]
        grids = tensors.get("image_grid_thw")
        features = {"pixel_values": pixels.to(torch.float32)}
        if "image_grid_thw" in reference["shapes"]:  # Qwen2.5-VL: patches on dim 0, each image's (t, h, w)
            if grids is None:
                raise InvalidArgument(f"{field}.model_specific_tensors", "image_grid_thw is required for this model")
            if grids.is_floating_point() or tuple(grids.shape) != (num, 3):
                raise InvalidArgument(f"{field}.model_specific_tensors[image_grid_thw]",
                                      f"expected integers of shape [{num}, 3], got {str(grids.dtype).removeprefix('torch.')} "
                                      f"{list(grids.shape)}")
            grids = grids.to(torch.int64)
            merge = self.processor.image_processor.merge_size
            max_rows = getattr(self.processor.image_processor, "max_pixels", None)
            patch = self.processor.image_processor.patch_size
            for i, (t, h, w) in enumerate(grids.tolist()):
                if t != 1 or h <= 0 or w <= 0 or h % merge or w % merge:
                    raise InvalidArgument(f"{field}.model_specific_tensors[image_grid_thw]",
                                          f"image {i}: (t, h, w) = ({t}, {h}, {w}): t must be 1, h and w positive "
                                          f"multiples of {merge}")
                if max_rows is not None and h * w * patch * patch > max_rows:
                    raise InvalidArgument(f"{field}.model_specific_tensors[image_grid_thw]",
                                          f"image {i}: {h * w} patches, more than the processor's max_pixels allow")
            rows = int(grids.prod(-1).sum())
            if tuple(pixels.shape) != (rows, *per_image):
                raise InvalidArgument(f"{field}.pixel_values", f"shape {list(pixels.shape)}: expected {[rows, *per_image]} "
                                                               f"(the grids' patches)")
            expected = (grids.prod(-1) // merge**2).tolist()
            features["image_grid_thw"] = grids
        else:
            if tuple(pixels.shape) != (num, *per_image):
                raise InvalidArgument(f"{field}.pixel_values", f"shape {list(pixels.shape)}: expected {[num, *per_image]} "
                                                               f"(one image a placeholder range, as this model's processor "
                                                               f"makes them)")
            expected = [reference["tokens"]] * num
            if "image_sizes" in reference["shapes"]:
                sizes = tensors.get("image_sizes")
                if sizes is None or sizes.is_floating_point() or tuple(sizes.shape) != (num, 2):
                    raise InvalidArgument(f"{field}.model_specific_tensors[image_sizes]", f"integers of shape [{num}, 2] "
                                                                                         f"are required")
                features["image_sizes"] = sizes.to(torch.int64)
        if not torch.isfinite(features["pixel_values"]).all():
            raise InvalidArgument(f"{field}.pixel_values", "has values that are not finite")
        end = 0
        for i, (offset, length) in enumerate(placeholders):
            name = f"{field}.mm_placeholders[{i}]"
            if offset < end or offset + length > len(ids):
                raise InvalidArgument(name, f"offset {offset}, length {length}: outside the prompt's {len(ids)} tokens "
                                            f"or before the previous range's end")
            run = [k for k in range(offset, offset + length) if ids[k] == self.image_token_id]
            if len(run) != expected[i] or (run and run[-1] - run[0] + 1 != len(run)):
                raise InvalidArgument(name, f"holds {len(run)} image tokens (id {self.image_token_id}), expected one run "
                                            f"of {expected[i]}")
            end = offset + length
        if ids.count(self.image_token_id) != sum(expected):
            raise InvalidArgument(f"{field}.mm_placeholders", f"the prompt has {ids.count(self.image_token_id)} image "
                                                              f"tokens (id {self.image_token_id}), its ranges {sum(expected)}")
        if max_tokens is not None and len(ids) > max_tokens:
            raise InvalidArgument(field, f"{len(ids)} tokens (its images' included) leave no room to generate "
                                         f"within {max_tokens + 1} tokens (max_model_len)")
        return list(ids), image_inputs(ids, features, self.image_token_id, lengths=expected)


class QwenVLProcessor:
    """Qwen2-VL / Qwen2.5-VL's processor for images: transformers' class also builds a video processor,
    which needs torchvision (not installable beside this torch). So, as `Qwen2VLProcessor.__call__`
    does for images: the folder's PIL image processor gives the patches and each image's grid
    (t, h, w), and each `<|image_pad|>` the template wrote becomes t * h * w / merge_size^2 of them."""

    MODEL_TYPES = ("qwen2_vl", "qwen2_5_vl")

    def __init__(self, tokenizer, image_processor, image_token: str):
        self.tokenizer, self.image_processor, self.image_token = tokenizer, image_processor, image_token

    @classmethod
    def load(cls, model_dir: Path | str, config: dict) -> QwenVLProcessor:
        from transformers import AutoImageProcessor, AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
        image_processor = AutoImageProcessor.from_pretrained(str(model_dir), backend="pil")
        return cls(tokenizer, image_processor, tokenizer.convert_ids_to_tokens(int(config["image_token_id"])))

    def __call__(self, text: list[str], images: list, add_special_tokens: bool = False, return_tensors: str = "pt"):
        import torch

        features = dict(self.image_processor(images=images, return_tensors="pt"))
        pieces = text[0].split(self.image_token)
        if len(pieces) - 1 != len(images):
            raise InvalidArgument("prompt.chat", f"the chat template wrote {len(pieces) - 1} image placeholders "
                                                 f"for {len(images)} images")
        counts = (features["image_grid_thw"].prod(-1) // self.image_processor.merge_size**2).tolist()
        expanded = pieces[0] + "".join(self.image_token * count + piece for count, piece in zip(counts, pieces[1:]))
        ids = self.tokenizer(expanded, add_special_tokens=add_special_tokens)["input_ids"]
        return {"input_ids": torch.tensor([ids]), **features}
