"""Images in (issue 40): Pagoda against transformers on a Gemma-3-4B-shaped and a Qwen2.5-VL-3B-shaped
vision tower (random weights, a small text decoder), same weights, same threads.

    .venv/bin/python bench/bench_images.py [--families gemma3,qwen2_5_vl] [--vision-layers gemma3=1,qwen2_5_vl=2]
        [--threads 1] [--encode-batch 2] [--batch 16] [--max-tokens 32] [--json out.json]

For each family it builds a checkpoint in a temporary folder from transformers' configs: the vision
tower at the real model's width, heads, patch size and image size (Gemma 3 4B: SigLIP so400m, 896 px,
4096 patches pooled to 256 soft tokens; Qwen2.5-VL 3B: 1280 wide, 14 px patches merged 2x2, windows
of 112 px, here 448 x 448 images = 256 tokens), `--vision-layers` of its 27 / 32 layers (the CPU
here cannot run the whole tower in a bench's time; the rates scale with depth on both sides), and a
small text decoder (512 wide, 4 layers). Then:

  encode     images per second of the vision tower + projector on a batch of processed images:
             transformers' `get_image_features` against the executor's `VisionEncoder.encode` (which
             calls the same transformers modules: level by construction, measured to show it)
  ttft       one image (PNG bytes) and a short question, to the first token: transformers
             (PNG decode + processor + `generate(max_new_tokens=1)`) against Pagoda through the
             service (gRPC; the scheduler decodes and processes the image, the executor encodes and
             prefills); a new image each time (no prefix-cache hit), median of 3
  batch      `--batch` requests, half with an image, half text only, `--max-tokens` greedy tokens each
             (ignore_eos): transformers one request after another (its `generate`, as it serves alone)
             against Pagoda with all of them sent at once; output tokens per second

Both sides run float32 with `--threads` torch threads (transformers: torch.set_num_threads in this
process; Pagoda: the executor's --num-threads). Pagoda's first answer is checked against
transformers' token for token.
"""

from __future__ import annotations

import argparse
import io
import json
import statistics
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
from PIL import Image, ImageDraw  # noqa: E402

from bench.common import machine_info, machine_line  # noqa: E402
from pagoda import model_files  # noqa: E402
from pagoda.v1 import generation_pb2 as pb  # noqa: E402
from tests.service.harness import Service  # noqa: E402
from tests.vision_models import qwen_inputs  # noqa: E402

TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{% if m['content'] is string %}{{ m['content'] }}"
    "{% else %}{% for c in m['content'] %}{% if c['type'] == 'image' %}IMAGE{% else %}{{ c['text'] }}{% endif %}"
    "{% endfor %}{% endif %}<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
QWEN_VISION = "<|vision_start|><|image_pad|><|vision_end|>"
QUESTION = "What is in this picture?"
TEXT_QUESTIONS = ["Explain how a refrigerator works.", "Describe the water cycle.", "What is a black hole?",
                  "How do vaccines work?", "Why is the sky blue?", "How do plants grow?", "What is machine learning?",
                  "Describe a healthy breakfast."]
TEXT = dict(hidden_size=512, intermediate_size=2048, num_hidden_layers=4, num_attention_heads=8, num_key_value_heads=4,
            head_dim=64, max_position_embeddings=4096, tie_word_embeddings=False, bos_token_id=1, eos_token_id=2)


def picture(seed: int, width: int, height: int) -> bytes:
    """A PNG of random shapes (a new one per seed: no two requests share an image)."""
    g = torch.Generator().manual_seed(seed)
    r = lambda n: int(torch.randint(0, n, (1,), generator=g))  # noqa: E731
    image = Image.new("RGB", (width, height), (r(256), r(256), r(256)))
    pen = ImageDraw.Draw(image)
    for _ in range(12):
        x, y = r(width), r(height)
        pen.ellipse((x, y, x + r(width // 2) + 4, y + r(height // 2) + 4), fill=(r(256), r(256), r(256)))
        pen.line((r(width), r(height), r(width), r(height)), fill=(r(256), r(256), r(256)), width=4)
    out = io.BytesIO()
    image.save(out, format="PNG")
    return out.getvalue()


def randomize(model) -> None:
    """Random weights the forward pass does not flatten: norms and biases moved from their init,
    Gemma 3's projector (zeros at init) drawn."""
    torch.manual_seed(0)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if param.ndim == 1:
                param.add_(torch.randn_like(param) * 0.1)
            elif "mm_input_projection" in name:
                param.normal_(std=0.02)


def build_gemma3(folder: Path, tokenizer_dir: Path, layers: int):
    import transformers as T
    from transformers.models.gemma3.image_processing_pil_gemma3 import Gemma3ImageProcessorPil

    tokenizer = T.AutoTokenizer.from_pretrained(
        str(tokenizer_dir),
        extra_special_tokens={"boi_token": "<start_of_image>", "eoi_token": "<end_of_image>", "image_token": "<image_soft_token>"},
    )
    template = TEMPLATE.replace("IMAGE", "<start_of_image>")
    tokenizer.chat_template = template
    processor = T.Gemma3Processor(image_processor=Gemma3ImageProcessorPil(size={"height": 896, "width": 896}, do_pan_and_scan=False),
                                  tokenizer=tokenizer, image_seq_length=256, chat_template=template)
    text = T.Gemma3TextConfig(vocab_size=len(tokenizer), sliding_window=512, **TEXT)
    vision = T.SiglipVisionConfig(hidden_size=1152, intermediate_size=4304, num_hidden_layers=layers, num_attention_heads=16,
                                  image_size=896, patch_size=14, vision_use_head=False)
    config = T.Gemma3Config(text_config=text.to_dict(), vision_config=vision.to_dict(), mm_tokens_per_image=256,
                            boi_token_index=tokenizer.boi_token_id, eoi_token_index=tokenizer.eoi_token_id,
                            image_token_index=tokenizer.image_token_id, eos_token_id=2)
    torch.manual_seed(0)
    model = T.Gemma3ForConditionalGeneration(config).eval()
    randomize(model)
    model.save_pretrained(folder)
    processor.save_pretrained(folder)

    def inputs(png: bytes | None, question: str) -> dict:
        content = ([{"type": "image"}] if png else []) + [{"type": "text", "text": question}]
        prompt = tokenizer.apply_chat_template([{"role": "user", "content": content}], tokenize=False, add_generation_prompt=True)
        images = [Image.open(io.BytesIO(png)).convert("RGB")] if png else None
        out = processor(text=[prompt], images=images, add_special_tokens=False, return_tensors="pt")
        return {k: v for k, v in out.items() if k != "attention_mask"}

    return model, inputs, (896, 896)


def build_qwen2_5_vl(folder: Path, tokenizer_dir: Path, layers: int):
    import transformers as T
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    tokenizer = T.AutoTokenizer.from_pretrained(str(tokenizer_dir))
    tokenizer.add_special_tokens({"additional_special_tokens": ["<|image_pad|>", "<|vision_start|>", "<|vision_end|>", "<|video_pad|>"]})
    tokenizer.chat_template = TEMPLATE.replace("IMAGE", QWEN_VISION)
    ids = tokenizer.convert_tokens_to_ids
    images = Qwen2VLImageProcessorPil(min_pixels=56 * 56, max_pixels=448 * 448, patch_size=14, merge_size=2, temporal_patch_size=2)
    text = T.Qwen2_5_VLTextConfig(vocab_size=len(tokenizer), rope_parameters={"rope_type": "default", "rope_theta": 1e6, "mrope_section": [8, 12, 12]},
                                  **{k: v for k, v in TEXT.items() if k not in ("head_dim", "bos_token_id", "eos_token_id")})
    full = [i for i in (7, 15, 23, 31) if i < layers] or [layers - 1]
    vision = T.Qwen2_5_VLVisionConfig(depth=layers, hidden_size=1280, intermediate_size=3420, num_heads=16, out_hidden_size=512,
                                      patch_size=14, spatial_merge_size=2, temporal_patch_size=2, window_size=112, fullatt_block_indexes=full)
    config = T.Qwen2_5_VLConfig(text_config=text.to_dict(), vision_config=vision.to_dict(), image_token_id=ids("<|image_pad|>"),
                                vision_start_token_id=ids("<|vision_start|>"), vision_end_token_id=ids("<|vision_end|>"),
                                video_token_id=ids("<|video_pad|>"), bos_token_id=1, eos_token_id=2)
    torch.manual_seed(0)
    model = T.Qwen2_5_VLForConditionalGeneration(config).eval()
    randomize(model)
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    images.save_pretrained(folder)

    def inputs(png: bytes | None, question: str) -> dict:
        content = ([{"type": "image"}] if png else []) + [{"type": "text", "text": question}]
        prompt = tokenizer.apply_chat_template([{"role": "user", "content": content}], tokenize=False, add_generation_prompt=True)
        if not png:
            return qwen_inputs(tokenizer, images, config, prompt, None, "")
        before, after = prompt.split(QWEN_VISION)
        return qwen_inputs(tokenizer, images, config, before, Image.open(io.BytesIO(png)).convert("RGB"), after)

    return model, inputs, (448, 448)


FAMILIES = {"gemma3": ("Gemma-3-4B-shaped tower (SigLIP 1152 wide, 896 px)", build_gemma3),
            "qwen2_5_vl": ("Qwen2.5-VL-3B-shaped tower (1280 wide, 448 x 448 px)", build_qwen2_5_vl)}


def request(png: bytes | None, question: str, max_tokens: int) -> pb.GenerateRequest:
    req = pb.GenerateRequest()
    message = req.chat.messages.add(role="user")
    if png:
        message.parts.add(image=pb.Image(data=png))
    message.parts.add(text=question)
    req.sampling.temperature = 0.0
    req.stopping.max_tokens = max_tokens
    req.stopping.ignore_eos = True
    return req


def stream(stub, req) -> tuple[float, list[int], float]:
    """(seconds to the first token, the tokens, seconds to the end) of one Generate call."""
    t0, first, tokens = time.perf_counter(), None, []
    for response in stub.Generate(req, timeout=3600):
        for out in response.outputs:
            if out.token_ids and first is None:
                first = time.perf_counter() - t0
            tokens += out.token_ids
    return first, tokens, time.perf_counter() - t0


def hf_generate(model, inputs_of, png, question, max_tokens) -> list[int]:
    kwargs = inputs_of(png, question)
    with torch.no_grad():
        out = model.generate(**kwargs, max_new_tokens=max_tokens, min_new_tokens=max_tokens, do_sample=False)
    return out[0, kwargs["input_ids"].shape[1]:].tolist()


def run_family(name: str, layers: int, args, tokenizer_dir: Path, seed0: int) -> dict:
    label, build = FAMILIES[name]
    with tempfile.TemporaryDirectory(prefix=f"bench-images-{name}-") as tmp:
        folder = Path(tmp)
        model, inputs_of, (width, height) = build(folder, tokenizer_dir, layers)
        seeds = iter(range(seed0, seed0 + 1000))
        row = {"family": label, "vision_layers": layers}

        # encode: the vision tower + projector on a batch of processed images
        batch = [inputs_of(picture(next(seeds), width, height), QUESTION) for _ in range(args.encode_batch)]
        names = ("pixel_values", "image_grid_thw") if name == "qwen2_5_vl" else ("pixel_values",)
        tensors = {n: torch.cat([b[n] for b in batch]) for n in names}
        from executor_svc.vision import VisionEncoder

        encoder = VisionEncoder(model.config, model.config.architectures[0], torch.device("cpu"), torch.float32)
        encoder.load(sorted(folder.glob("*.safetensors")))
        with torch.no_grad():
            hf_features = model.model.get_image_features(**tensors, return_dict=True).pooler_output
            ours = encoder.encode({n: t.clone() for n, t in tensors.items()})
        assert torch.equal(torch.cat([f.reshape(-1, f.shape[-1]) for f in hf_features]), torch.cat(ours)), "encoder differs"
        for side, fn in (("transformers", lambda: model.model.get_image_features(**tensors, return_dict=True)),
                         ("pagoda", lambda: encoder.encode(tensors))):
            times = []
            for _ in range(2):
                t0 = time.perf_counter()
                with torch.no_grad():
                    fn()
                times.append(time.perf_counter() - t0)
            row[f"encode_images_per_s_{side}"] = round(args.encode_batch / min(times), 3)
        del encoder

        # ttft, transformers: PNG decode + processor + one token
        hf_ttft, first_png = [], None
        for _ in range(3):
            png = picture(next(seeds), 640, 480)
            first_png = first_png or png
            t0 = time.perf_counter()
            hf_generate(model, inputs_of, png, QUESTION, 1)
            hf_ttft.append(time.perf_counter() - t0)
        row["ttft_s_transformers"] = round(statistics.median(hf_ttft), 3)

        # batch, transformers: one request after another
        work = [(picture(next(seeds), 640, 480), QUESTION) if i % 2 == 0 else (None, TEXT_QUESTIONS[i // 2 % len(TEXT_QUESTIONS)])
                for i in range(args.batch)]
        t0 = time.perf_counter()
        hf_out = [hf_generate(model, inputs_of, png, q, args.max_tokens) for png, q in work]
        hf_wall = time.perf_counter() - t0
        row["batch_tok_per_s_transformers"] = round(sum(map(len, hf_out)) / hf_wall, 2)
        row["batch_wall_s_transformers"] = round(hf_wall, 2)
        reference = hf_generate(model, inputs_of, first_png, QUESTION, 8)
        del model

        svc = Service(model=str(folder), executor_args=["--num-threads", str(args.threads)])
        svc.start()
        try:
            stream(svc.stub, request(picture(next(seeds), 640, 480), QUESTION, 2))  # warm-up (a new image)
            _, tokens, _ = stream(svc.stub, request(first_png, QUESTION, 8))
            row["pagoda_equals_transformers"] = tokens == reference
            ttft = [stream(svc.stub, request(picture(next(seeds), 640, 480), QUESTION, 1))[0] for _ in range(3)]
            row["ttft_s_pagoda"] = round(statistics.median(ttft), 3)
            fresh = [(picture(next(seeds), 640, 480) if png else None, q) for png, q in work]  # new images: no cache hit
            t0 = time.perf_counter()
            with ThreadPoolExecutor(len(fresh)) as pool:
                results = list(pool.map(lambda w: stream(svc.stub, request(w[0], w[1], args.max_tokens)), fresh))
            wall = time.perf_counter() - t0
            row["batch_tok_per_s_pagoda"] = round(sum(len(r[1]) for r in results) / wall, 2)
            row["batch_wall_s_pagoda"] = round(wall, 2)
        finally:
            svc.stop()
        row["ttft_ratio"] = round(row["ttft_s_pagoda"] / row["ttft_s_transformers"], 2)
        row["batch_speedup"] = round(row["batch_tok_per_s_pagoda"] / row["batch_tok_per_s_transformers"], 2)
        return row


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--families", default="gemma3,qwen2_5_vl")
    parser.add_argument("--vision-layers", default="gemma3=1,qwen2_5_vl=2",
                        help="the tower's depth: N for every family, or FAMILY=N,... (the real ones: 27 and 32)")
    parser.add_argument("--encode-batch", type=int, default=2)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    info = machine_info()
    info["torch_threads"] = torch.get_num_threads()
    print(machine_line(info), flush=True)
    tokenizer_dir = model_files.resolve_model(None)
    depth = ({k: int(v) for k, v in (part.split("=") for part in args.vision_layers.split(","))}
             if "=" in args.vision_layers else dict.fromkeys(FAMILIES, int(args.vision_layers)))
    rows = []
    for i, name in enumerate(args.families.split(",")):
        row = run_family(name, depth[name], args, tokenizer_dir, 1000 * (i + 1))
        rows.append(row)
        for key, value in row.items():
            print(f"  {key:<32} {value}", flush=True)
    if args.json:
        args.json.write_text(json.dumps({"machine": info, "rows": rows}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
