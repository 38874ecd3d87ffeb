"""Images over gRPC (issue 40): a tiny LLaVA folder with its processor saved in it, served end to end.

One LLaVA service for the module (--limit-mm-per-prompt image=2, two executors). A chat whose user message has an image
part gives transformers' greedy `generate` on the same processor output, token for token; another
image gives another answer; the same image again hits the prefix cache, another image does not;
each bad image is INVALID_ARGUMENT naming `prompt.chat.messages[i].parts[j].image` before any
work, and the service keeps serving. A text-only model refuses images (at the prompt worker).
A tiny Gemma 3 served with 8-token chunks: its executor registers whole_image_chunks, so a chunk
that would end inside an image's soft tokens is cut before it (the executor fails one that does
not), and the answers equal transformers'. An executor killed mid-stream of two image requests: they
resume on the other one, still transformers' answers. A tiny Qwen2.5-VL served: its answers (two
images of other grids and a text-only chat in one batch) equal transformers'.
"""

from __future__ import annotations

import asyncio
import base64
import io
import signal
import struct
import zlib

import grpc
import pytest
import torch
from PIL import Image, ImageDraw

from pagoda.v1 import generation_pb2 as pb
from tests.service.harness import Service, collect, one_torch_thread
from tests.vision_models import qwen_inputs, tiny_gemma3, tiny_llava, tiny_qwen2_5_vl

MAX_TOKENS = 8
TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{% if m['content'] is string %}{{ m['content'] }}"
    "{% else %}{% for c in m['content'] %}{% if c['type'] == 'image' %}<image>{% else %}{{ c['text'] }}{% endif %}"
    "{% endfor %}{% endif %}<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def draw(width: int, height: int, color: tuple[int, int, int]) -> Image.Image:
    image = Image.new("RGB", (width, height), color)
    pen = ImageDraw.Draw(image)
    pen.ellipse((width // 5, height // 4, 4 * width // 5, 3 * height // 4), fill=(255 - color[0], color[2], color[1]))
    pen.line((0, height - 1, width - 1, 0), fill=(color[1], 255 - color[2], color[0]), width=3)
    return image


def encoded(image: Image.Image, fmt: str = "PNG") -> bytes:
    out = io.BytesIO()
    image.save(out, format=fmt)
    return out.getvalue()


def png_claiming(width: int, height: int) -> bytes:
    """A small PNG whose header claims width x height pixels (a decompression bomb's header)."""
    data = bytearray(encoded(Image.new("RGB", (4, 4))))
    ihdr = data[12:29]  # type + 13 bytes of IHDR data
    ihdr[4:12] = struct.pack(">II", width, height)
    data[12:29] = ihdr
    data[29:33] = struct.pack(">I", zlib.crc32(bytes(ihdr)))
    return bytes(data)


WIDE, TALL = draw(48, 30, (200, 30, 60)), draw(22, 40, (20, 160, 220))


@pytest.fixture(scope="module")
def llava(tmp_path_factory, default_model_dir):
    """(folder, processor, transformers' model) of a tiny LLaVA (tests/vision_models.py), its chat template TEMPLATE."""
    out_dir = tmp_path_factory.mktemp("llava")
    return out_dir, *tiny_llava(default_model_dir, out_dir, TEMPLATE)


@pytest.fixture(scope="module")
def svc(llava):
    """Two executors of one torch thread each (they share the machine's cores), so the last test can kill one."""
    scheduler_args = ["--limit-mm-per-prompt", "image=2", "--executor-timeout", "1.0"]
    with Service(model=str(llava[0]), scheduler_args=scheduler_args, executor_args=["--num-threads", "1"], num_executors=2) as service:
        yield service


def image_chat(parts, before: str = "") -> pb.GenerateRequest:
    """A greedy request: one user message of `parts` (str: text; bytes: an image's data; pb.Image)."""
    req = pb.GenerateRequest()
    if before:
        req.chat.messages.add(role="system", content=before)
    message = req.chat.messages.add(role="user")
    for part in parts:
        if isinstance(part, str):
            message.parts.add(text=part)
        elif isinstance(part, bytes):
            message.parts.add(image=pb.Image(data=part))
        else:
            message.parts.add(image=part)
    req.sampling.temperature = 0.0
    req.stopping.max_tokens = MAX_TOKENS
    req.stopping.ignore_eos = True
    return req


def reference(llava, images, question: str, max_tokens: int = MAX_TOKENS) -> list[int]:
    _, processor, model = llava
    content = [*({"type": "image"} for _ in images), {"type": "text", "text": question}]
    text = processor.tokenizer.apply_chat_template([{"role": "user", "content": content}], tokenize=False,
                                                   add_generation_prompt=True)
    inputs = processor(text=[text], images=list(images), add_special_tokens=False, return_tensors="pt")
    kwargs = {k: v for k, v in inputs.items() if k != "attention_mask"}
    with torch.no_grad():
        out = model.generate(**kwargs, max_new_tokens=max_tokens, min_new_tokens=max_tokens, do_sample=False)
    return out[0, inputs["input_ids"].shape[1]:].tolist()


def test_an_image_chat_equals_transformers_and_another_image_differs(svc, llava):
    wide = collect(svc.stub.Generate(image_chat([encoded(WIDE), "What is this?"]), timeout=300))
    assert wide["outputs"][0]["token_ids"] == reference(llava, [WIDE], "What is this?")
    data_url = "data:image/jpeg;base64," + base64.b64encode(encoded(TALL, "JPEG")).decode()
    tall = collect(svc.stub.Generate(image_chat([pb.Image(url=data_url), "What is this?"]), timeout=300))
    assert tall["outputs"][0]["token_ids"] == reference(llava, [Image.open(io.BytesIO(encoded(TALL, "JPEG")))], "What is this?")
    assert tall["outputs"][0]["token_ids"] != wide["outputs"][0]["token_ids"]
    two = collect(svc.stub.Generate(image_chat([encoded(TALL), encoded(WIDE), "Compare."]), timeout=300))
    assert two["outputs"][0]["token_ids"] == reference(llava, [TALL, WIDE], "Compare.")


def test_the_same_image_hits_the_prefix_cache_and_another_does_not(svc, llava):
    system = "You look at pictures. " * 3  # a text prefix of full blocks before the image
    first = collect(svc.stub.Generate(image_chat([encoded(WIDE), "Describe it."], before=system), timeout=300))
    again = collect(svc.stub.Generate(image_chat([encoded(WIDE), "Describe it."], before=system), timeout=300))
    other = collect(svc.stub.Generate(image_chat([encoded(draw(48, 30, (0, 90, 40))), "Describe it."], before=system), timeout=300))
    prompt_tokens = first["last"].usage.prompt_tokens
    text_blocks = other["last"].usage.cached_prompt_tokens
    assert again["outputs"][0]["token_ids"] == first["outputs"][0]["token_ids"]
    assert again["last"].usage.cached_prompt_tokens == (prompt_tokens - 1) // 16 * 16  # all full blocks
    assert 0 < text_blocks < again["last"].usage.cached_prompt_tokens  # the system text's blocks only
    assert other["outputs"][0]["token_ids"] != first["outputs"][0]["token_ids"]


BAD = {
    "not an image": ([b"GIF89a but not really"], "parts[0].image", "not an image"),
    "bitmap": ([encoded(WIDE, "BMP")], "parts[0].image", "supported format"),
    "bomb": ([png_claiming(6000, 5000)], "parts[0].image", "pixels"),
    "three images": ([encoded(WIDE), "a", encoded(WIDE), encoded(WIDE)], "parts[3].image", "more than 2 images"),
    "url": ([pb.Image(url="https://example.com/cat.png")], "parts[0].image.url", "allowed-media-domains"),
    "bad base64": ([pb.Image(url="data:image/png;base64,@@@")], "parts[0].image.url", "base64"),
    "empty": ([pb.Image()], "parts[0].image", "one of data or url"),
}


@pytest.mark.parametrize("case", list(BAD))
def test_bad_images_are_refused_naming_the_field(svc, case):
    parts, field, words = BAD[case]
    with pytest.raises(grpc.RpcError) as err:
        collect(svc.stub.Generate(image_chat(parts), timeout=60))
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT, err.value.details()
    assert f"prompt.chat.messages[0].{field}" in err.value.details() and words in err.value.details(), err.value.details()


def test_content_and_parts_together_are_refused_and_the_service_keeps_serving(svc, llava):
    req = image_chat([encoded(WIDE), "What is this?"])
    req.chat.messages[0].content = "also this"
    with pytest.raises(grpc.RpcError) as err:
        collect(svc.stub.Generate(req, timeout=60))
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "prompt.chat.messages[0].parts" in err.value.details()
    ok = collect(svc.stub.Generate(image_chat([encoded(WIDE), "What is this?"]), timeout=300))
    assert ok["outputs"][0]["token_ids"] == reference(llava, [WIDE], "What is this?")
    info = svc.wait_all_blocks_free()
    assert all(e.num_free_blocks == e.num_total_blocks for e in info.executors)


LONG = 120  # tokens: the streams are still running when one executor is killed


def test_an_executor_killed_mid_stream_of_image_requests_resumes_them_exactly(svc, llava):
    """Two image streams, one on each executor (least-loaded routing); SIGKILL one executor after a few
    tokens: its stream moves to the survivor, which encodes the image again and recomputes prompt +
    tokens so far, and each stream is transformers' answer, nothing lost or repeated. (The last test
    of this service: one executor is left.)"""
    from tests.service.test_failover import Stream, executor_id_of

    pictures = {"wide": WIDE, "tall": TALL}
    with one_torch_thread():  # (the service's processes share the cores)
        expected = {name: reference(llava, [picture], "Tell me a long story.", LONG) for name, picture in pictures.items()}
    streams = {}
    for name, picture in pictures.items():
        req = image_chat([encoded(picture), "Tell me a long story."])
        req.stopping.max_tokens = LONG
        streams[name] = Stream(svc.stub, name, request=req)
    for stream in streams.values():
        stream.wait_tokens(3)
    busy = {e.executor_id for e in svc.server_info().executors if e.num_running > 0}
    assert busy, f"the streams ended before the kill: {svc.server_info()}"
    victim = next(p for p in svc.executors if any(executor_id_of(p) in f"-{b}" for b in busy))
    victim.send_signal(signal.SIGKILL)
    victim.wait(timeout=10)
    for name, stream in streams.items():
        assert stream.result()["outputs"][0]["token_ids"] == expected[name], name
    assert "moving its requests" in (svc.logdir / "scheduler.log").read_text()
    info = svc.wait_all_blocks_free()
    assert len(info.executors) == 1 and all(e.num_free_blocks == e.num_total_blocks for e in info.executors)


def test_a_text_only_model_refuses_images(default_model_dir):
    from scheduler_svc.errors import InvalidArgument
    from scheduler_svc.prompts import PromptWorker
    from scheduler_svc.tokenizer import load_tokenizer, read_model_spec

    tokenizer = load_tokenizer(default_model_dir)
    worker = PromptWorker(tokenizer, read_model_spec(default_model_dir, tokenizer), 512, model_dir=default_model_dir)
    try:
        with pytest.raises(InvalidArgument) as err:
            asyncio.run(worker.generate_params(image_chat(["Look:", encoded(WIDE)])))
        assert err.value.field == "prompt.chat.messages[0].parts[1].image" and "takes no images" in str(err.value)
    finally:
        worker.close()


GEMMA_TEMPLATE = TEMPLATE.replace("<image>", "<start_of_image>")
BUDGET = 8


@pytest.fixture(scope="module")
def gemma3(tmp_path_factory, default_model_dir):
    """(folder, processor, transformers' model) of a tiny Gemma 3 (tests/vision_models.py), its chat template GEMMA_TEMPLATE."""
    out_dir = tmp_path_factory.mktemp("gemma3")
    return out_dir, *tiny_gemma3(default_model_dir, out_dir, GEMMA_TEMPLATE)


def test_gemma3_chunks_are_cut_before_an_image_and_equal_transformers(gemma3):
    _, processor, _ = gemma3
    image_id = processor.tokenizer.image_token_id
    straddling = []
    for words in range(12):  # questions whose image a chunk of 8 would end inside
        question = "Look " * words
        text = processor.tokenizer.apply_chat_template(
            [{"role": "user", "content": [{"type": "text", "text": question}, {"type": "image"}, {"type": "text", "text": "?"}]}],
            tokenize=False, add_generation_prompt=True)
        ids = processor(text=[text], images=[WIDE], add_special_tokens=False)["input_ids"][0]
        offset = ids.index(image_id)
        if offset // BUDGET != (offset + 3) // BUDGET:
            straddling.append(question)
    assert len(straddling) >= 2
    with Service(model=str(gemma3[0]), scheduler_args=["--max-num-batched-tokens", str(BUDGET)]) as service:
        for question, picture in zip(straddling[:2], (WIDE, TALL)):
            out = collect(service.stub.Generate(image_chat([question, encoded(picture), "?"]), timeout=300))
            assert out["outputs"][0]["token_ids"] == gemma_reference(gemma3, picture, question)


def gemma_reference(gemma3, picture, question: str) -> list[int]:
    _, processor, model = gemma3
    content = [{"type": "text", "text": question}, {"type": "image"}, {"type": "text", "text": "?"}]
    text = processor.tokenizer.apply_chat_template([{"role": "user", "content": content}], tokenize=False, add_generation_prompt=True)
    inputs = processor(text=[text], images=[picture], add_special_tokens=False, return_tensors="pt")
    kwargs = {k: v for k, v in inputs.items() if k != "attention_mask"}
    with torch.no_grad():
        out = model.generate(**kwargs, max_new_tokens=MAX_TOKENS, min_new_tokens=MAX_TOKENS, do_sample=False)
    return out[0, inputs["input_ids"].shape[1]:].tolist()


def test_qwen2_5_vl_prompts_are_what_its_processor_gives(tmp_path, default_model_dir):
    """Qwen2.5-VL's processor class needs torchvision: the prompt worker expands its image pads from the
    folder's image processor as that class does (the runner's test checks such inputs against transformers)."""
    import transformers as T
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    from pagoda.images import image_inputs
    from scheduler_svc.prompts import PromptWorker
    from scheduler_svc.tokenizer import load_tokenizer, read_model_spec

    tokenizer = T.AutoTokenizer.from_pretrained(str(default_model_dir))
    tokenizer.add_special_tokens({"additional_special_tokens": ["<|image_pad|>", "<|vision_start|>", "<|vision_end|>", "<|video_pad|>"]})
    tokenizer.chat_template = TEMPLATE.replace("<image>", "<|vision_start|><|image_pad|><|vision_end|>")
    images = Qwen2VLImageProcessorPil(min_pixels=28 * 28 * 4, max_pixels=28 * 28 * 12, patch_size=14, merge_size=2, temporal_patch_size=2)
    ids = tokenizer.convert_tokens_to_ids
    config = T.Qwen2_5_VLConfig(text_config={"vocab_size": len(tokenizer)}, image_token_id=ids("<|image_pad|>"),
                                vision_start_token_id=ids("<|vision_start|>"), vision_end_token_id=ids("<|vision_end|>"))
    config.save_pretrained(tmp_path)
    tokenizer.save_pretrained(tmp_path)
    images.save_pretrained(tmp_path)
    scheduler_tokenizer = load_tokenizer(tmp_path)
    worker = PromptWorker(scheduler_tokenizer, read_model_spec(tmp_path, scheduler_tokenizer), 512, model_dir=tmp_path)
    try:
        params = asyncio.run(worker.generate_params(image_chat(["Look: ", encoded(WIDE), encoded(TALL), " which?"])))
    finally:
        worker.close()
    before = tokenizer.apply_chat_template([{"role": "user", "content": [{"type": "text", "text": "Look: "}, {"type": "image"}]}],
                                           tokenize=False).removesuffix("<|vision_start|><|image_pad|><|vision_end|><|im_end|>\n")
    wide = qwen_inputs(tokenizer, images, config, before, WIDE, "")
    tall = qwen_inputs(tokenizer, images, config, "", TALL, " which?<|im_end|>\n<|im_start|>assistant\n")
    expected_ids = wide["input_ids"][0].tolist() + tall["input_ids"][0].tolist()
    assert params.prompt_token_ids == expected_ids
    assert [(i.offset, i.length) for i in params.images] == [
        (i.offset, i.length) for i in image_inputs(expected_ids, {"pixel_values": torch.cat([wide["pixel_values"], tall["pixel_values"]]),
                                                                  "image_grid_thw": torch.cat([wide["image_grid_thw"], tall["image_grid_thw"]])},
                                                   config.image_token_id)]
    for got, inputs in zip(params.images, (wide, tall)):
        tensors = {t.name: t.to_torch() for t in got.tensors}
        assert torch.equal(tensors["pixel_values"], inputs["pixel_values"])
        assert torch.equal(tensors["image_grid_thw"], inputs["image_grid_thw"])


QWEN_VISION = "<|vision_start|><|image_pad|><|vision_end|>"


def test_qwen2_5_vl_over_grpc_equals_transformers(tmp_path, default_model_dir):
    """A tiny Qwen2.5-VL (dynamic resolution: the two images have other grids, so other token counts)
    served end to end; two image chats in one batch and a text-only one each give transformers'
    greedy tokens and their log-probabilities (3-D rotary positions, the windowed vision transformer)."""
    (tokenizer, images), model = tiny_qwen2_5_vl(default_model_dir, tmp_path, TEMPLATE.replace("<image>", QWEN_VISION))
    question = " what is it?"

    def expected(picture) -> tuple[list[int], torch.Tensor]:
        content = [{"type": "text", "text": "Look: "}, *([{"type": "image"}] if picture else []), {"type": "text", "text": question}]
        text = tokenizer.apply_chat_template([{"role": "user", "content": content}], tokenize=False, add_generation_prompt=True)
        before, after = text.split(QWEN_VISION) if picture else (text, "")
        inputs = qwen_inputs(tokenizer, images, model.config, before, picture, after)
        with torch.no_grad():
            out = model.generate(**inputs, max_new_tokens=MAX_TOKENS, min_new_tokens=MAX_TOKENS, do_sample=False,
                                 output_logits=True, return_dict_in_generate=True)
        tokens = out.sequences[0, inputs["input_ids"].shape[1]:]
        logprobs = torch.stack([step[0].float().log_softmax(-1)[t] for step, t in zip(out.logits, tokens)])
        return tokens.tolist(), logprobs

    pictures = {"wide": WIDE, "tall": TALL, "text": None}
    references = {name: expected(picture) for name, picture in pictures.items()}
    assert not torch.allclose(references["wide"][1], references["tall"][1], atol=1e-3)  # the image matters
    with Service(model=str(tmp_path)) as service:
        calls = {}
        for name, p in pictures.items():  # (all three in flight at once)
            req = image_chat(["Look: ", *([encoded(p)] if p else []), question])
            req.response.logprobs = True
            calls[name] = service.stub.Generate(req, timeout=300)
        for name, call in calls.items():
            out = collect(call)["outputs"][0]
            tokens, logprobs = references[name]
            assert out["token_ids"] == tokens, name
            got = torch.tensor([lp.logprob for lp in out["logprobs"]])
            torch.testing.assert_close(got, logprobs, atol=1e-4, rtol=0, msg=name)
