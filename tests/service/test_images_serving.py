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
    """(folder, processor, transformers' model) of a tiny LLaVA (tests/vision_models.py), its chat template TEMPLATE:
    28 px images of 14 px patches (4 image tokens) in a folder named llava-v1.5-..., which is what SMG's router
    takes for LLaVA-1.5 and preprocesses itself (its processor assumes 14 px patches)."""
    out_dir = tmp_path_factory.mktemp("llava-v1.5-tiny")
    return out_dir, *tiny_llava(default_model_dir, out_dir, TEMPLATE, image_size=28, patch_size=14)


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


# ---- vllm.grpc.engine.VllmEngine (what SMG's router sends) and Tokenize ----------------------------


def vllm_request(ids, **fields):
    """A greedy VllmEngine request of tokenized `ids` (the router's form) and its images (`fields`)."""
    from smg_grpc_proto import vllm_engine_pb2 as vpb

    sampling = vpb.SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    return vpb.GenerateRequest(request_id="", tokenized=vpb.TokenizedInput(input_ids=ids), sampling_params=sampling,
                               stream=False, **fields)


def vllm_generate(svc, req) -> list[int]:
    from smg_grpc_proto import vllm_engine_pb2_grpc as vpb_grpc

    replies = list(vpb_grpc.VllmEngineStub(svc.channel).Generate(req, timeout=300))
    return list(replies[-1].complete.output_ids)


def router_ids(llava, images, question: str) -> list[int]:
    """The chat as SMG renders and tokenizes it for media_refs: one `<image>` an image, unexpanded."""
    content = [*({"type": "image"} for _ in images), {"type": "text", "text": question}]
    return llava[1].tokenizer.apply_chat_template([{"role": "user", "content": content}], tokenize=True,
                                                  add_generation_prompt=True, return_dict=False)


def router_pixels(llava, images, question: str, dtype=torch.float32):
    """What SMG sends after running an image processor itself: expanded ids and the pixels as raw tensors."""
    from smg_grpc_proto import vllm_engine_pb2 as vpb

    from pagoda.images import placeholder_spans

    processor = llava[1]
    content = [*({"type": "image"} for _ in images), {"type": "text", "text": question}]
    text = processor.tokenizer.apply_chat_template([{"role": "user", "content": content}], tokenize=False,
                                                   add_generation_prompt=True)
    inputs = processor(text=[text], images=list(images), add_special_tokens=False, return_tensors="pt")
    ids = inputs["input_ids"][0].tolist()
    pixels = inputs["pixel_values"].to(dtype).contiguous()
    tensor = vpb.TensorData(shape=list(pixels.shape), dtype=str(dtype).removeprefix("torch."),
                            inline=pixels.reshape(-1).view(torch.uint8).numpy().tobytes())
    per = [len(ids[o:o + n]) // len(images) for o, n in placeholder_spans(ids, processor.image_token_id)][0]
    first = ids.index(processor.image_token_id)
    ranges = [vpb.PlaceholderRange(offset=first + k * per, length=per) for k in range(len(images))]
    return ids, vpb.MultimodalInputs(pixel_values=tensor, mm_placeholders=ranges, im_token_id=processor.image_token_id)


def data_url(image: Image.Image, fmt: str = "PNG") -> str:
    return f"data:image/{fmt.lower()};base64," + base64.b64encode(encoded(image, fmt)).decode()


def test_vllm_engine_media_refs_and_router_pixels_equal_the_chat_path_and_transformers(svc, llava):
    from smg_grpc_proto import vllm_engine_pb2 as vpb
    from smg_grpc_proto import vllm_engine_pb2_grpc as vpb_grpc
    from smg_grpc_proto.generated import common_pb2

    stub = vpb_grpc.VllmEngineStub(svc.channel)
    info = stub.GetServerInfo(vpb.GetServerInfoRequest(), timeout=30)
    assert (info.mm_processor, info.mm_media_ref_schemes, info.mm_item_limits) == ("inprocess", "data", "image=2")
    assert stub.GetModelInfo(vpb.GetModelInfoRequest(), timeout=30).supports_vision
    image = common_pb2.Modality.Value("IMAGE")
    want = reference(llava, [WIDE], "What is this?")
    refs = vpb.MediaRefs(items=[vpb.MediaRef(modality=image, url=data_url(WIDE))])
    assert vllm_generate(svc, vllm_request(router_ids(llava, [WIDE], "What is this?"), media_refs=refs)) == want
    two = vpb.MediaRefs(items=[vpb.MediaRef(modality=image, url=data_url(TALL)), vpb.MediaRef(modality=image, url=data_url(WIDE))])
    assert vllm_generate(svc, vllm_request(router_ids(llava, [TALL, WIDE], "Compare."), media_refs=two)) == reference(
        llava, [TALL, WIDE], "Compare.")
    ids, mm = router_pixels(llava, [WIDE], "What is this?")
    assert vllm_generate(svc, vllm_request(ids, mm_inputs=mm)) == want
    ids, mm = router_pixels(llava, [TALL, WIDE], "Compare.")
    assert vllm_generate(svc, vllm_request(ids, mm_inputs=mm)) == reference(llava, [TALL, WIDE], "Compare.")


def test_vllm_engine_bad_images_are_refused_naming_the_field_and_the_service_keeps_serving(svc, llava):
    from smg_grpc_proto import vllm_engine_pb2 as vpb
    from smg_grpc_proto.generated import common_pb2

    image = common_pb2.Modality.Value("IMAGE")
    ids = router_ids(llava, [WIDE], "What is this?")
    expanded, mm = router_pixels(llava, [WIDE], "What is this?")

    def refs(*urls):
        return vpb.MediaRefs(items=[vpb.MediaRef(modality=image, url=url) for url in urls])

    def pixels(**changes):
        out = vpb.MultimodalInputs()
        out.CopyFrom(mm)
        for key, value in changes.items():
            if key == "mm_placeholders":
                del out.mm_placeholders[:]
                out.mm_placeholders.extend(value)
            else:
                getattr(out, key).CopyFrom(value) if hasattr(value, "DESCRIPTOR") else setattr(out, key, value)
        return out

    half = mm.pixel_values.shape[2] // 2
    cases = [
        (vllm_request(ids, media_refs=refs("https://example.com/cat.png")), "media_refs.items[0].url", "allowed-media-domains"),
        (vllm_request(ids, media_refs=refs("data:image/png;base64," + base64.b64encode(encoded(WIDE, "BMP")).decode())),
         "media_refs.items[0]", "supported format"),
        (vllm_request(ids, media_refs=refs(data_url(WIDE), data_url(TALL))), "tokenized.input_ids", "1 image placeholders"),
        (vllm_request(ids, media_refs=refs(*[data_url(WIDE)] * 3)), "media_refs.items[2]", "more than 2 images"),
        (vllm_request(expanded, mm_inputs=pixels(pixel_values=vpb.TensorData(
            shape=[1, 3, half, half], dtype="float32", inline=bytes(12 * half * half)))), "mm_inputs.pixel_values", "expected"),
        (vllm_request(expanded, mm_inputs=pixels(mm_placeholders=[vpb.PlaceholderRange(
            offset=mm.mm_placeholders[0].offset + 1, length=mm.mm_placeholders[0].length)])), "mm_inputs.mm_placeholders[0]",
         "image tokens"),
        (vllm_request(expanded, mm_inputs=pixels(im_token_id=3)), "mm_inputs.im_token_id", "image token"),
        (vllm_request(expanded, mm_inputs=pixels(pixel_values=vpb.TensorData(
            shape=list(mm.pixel_values.shape), dtype="float32", inline=b"\xff" * len(mm.pixel_values.inline)))),
         "mm_inputs.pixel_values", "not finite"),
    ]
    for req, field, words in cases:
        with pytest.raises(grpc.RpcError) as err:
            vllm_generate(svc, req)
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT, (field, err.value.details())
        assert err.value.details().startswith(f"{field}: ") and words in err.value.details(), (field, err.value.details())
    bf16_ids, bf16 = router_pixels(llava, [WIDE], "What is this?", dtype=torch.bfloat16)  # a router casting to the model's dtype
    assert len(vllm_generate(svc, vllm_request(bf16_ids, mm_inputs=bf16))) == MAX_TOKENS
    info = svc.wait_all_blocks_free()
    assert all(e.num_free_blocks == e.num_total_blocks for e in info.executors)


@pytest.fixture(scope="module")
def smg(svc):
    """SMG, the field's router, in front of the module's LLaVA service (`smg launch --backend vllm`)."""
    from bench.smg_router import SmgRouter

    with SmgRouter([f"grpc://127.0.0.1:{svc.port}"]) as router:
        yield router


def test_an_image_url_chat_through_smg_equals_pagodas_chat_and_transformers(svc, llava, smg):
    """SMG preprocesses a LLaVA-1.5's images itself and sends VllmEngine its pixels (mm_inputs): Pagoda checks
    them against its processor's shapes and answers as its own chat path does (transformers' generate).
    The images are 28 x 28, the processor's size: SMG's resampling (Rust) is its own, so a resized image's
    pixels differ slightly from PIL's (a 22 x 40 one gave another answer after 5 tokens)."""
    import openai

    client = openai.OpenAI(base_url=f"{smg.url}/v1", api_key="unused", max_retries=0, timeout=300)
    model = smg.workers()[0]["model_id"]
    answers = []
    for picture, fmt in ((draw(28, 28, (200, 30, 60)), "PNG"), (draw(28, 28, (20, 160, 220)), "JPEG")):
        decoded = Image.open(io.BytesIO(encoded(picture, fmt)))
        want = collect(svc.stub.Generate(image_chat([encoded(picture, fmt), "What is this?"]), timeout=300))
        assert want["outputs"][0]["token_ids"] == reference(llava, [decoded], "What is this?")
        reply = client.chat.completions.create(
            model=model, max_tokens=MAX_TOKENS, temperature=0, extra_body={"ignore_eos": True},
            messages=[{"role": "user", "content": [{"type": "image_url", "image_url": {"url": data_url(picture, fmt)}},
                                                   {"type": "text", "text": "What is this?"}]}])
        assert reply.choices[0].message.content == want["outputs"][0]["text"]
        assert reply.usage.prompt_tokens == want["last"].usage.prompt_tokens
        assert reply.usage.completion_tokens == MAX_TOKENS
        answers.append(reply.choices[0].message.content)
    assert answers[0] != answers[1]


def test_tokenize_of_a_chat_with_images_is_the_processors_ids_generate_runs(svc, llava):
    processor = llava[1]
    for images, add in (([WIDE], True), ([TALL, WIDE], False)):
        req = pb.TokenizeRequest(add_generation_prompt=add)
        req.chat.CopyFrom(image_chat([*(encoded(i) for i in images), "What is this?"]).chat)
        content = [*({"type": "image"} for _ in images), {"type": "text", "text": "What is this?"}]
        text = processor.tokenizer.apply_chat_template([{"role": "user", "content": content}], tokenize=False,
                                                       add_generation_prompt=add)
        want = processor(text=[text], images=images, add_special_tokens=False)["input_ids"][0]
        reply = svc.stub.Tokenize(req, timeout=120)
        assert list(reply.token_ids) == list(want) and reply.tokens[-1] == processor.tokenizer.convert_ids_to_tokens(want[-1])
        assert list(reply.token_ids).count(processor.image_token_id) == 4 * len(images)
    generated = collect(svc.stub.Generate(image_chat([encoded(WIDE), "What is this?"]), timeout=300))
    req = pb.TokenizeRequest()
    req.chat.CopyFrom(image_chat([encoded(WIDE), "What is this?"]).chat)
    assert len(svc.stub.Tokenize(req, timeout=120).token_ids) == generated["last"].usage.prompt_tokens
    req = pb.TokenizeRequest()
    req.chat.CopyFrom(image_chat([encoded(WIDE, "BMP"), "What is this?"]).chat)
    with pytest.raises(grpc.RpcError) as err:
        svc.stub.Tokenize(req, timeout=60)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert err.value.details().startswith("chat.messages[0].parts[0].image: ") and "supported format" in err.value.details()


def test_messages_count_tokens_with_an_image_is_the_prompt_generate_runs(svc):
    """Anthropic's count_tokens of a message with an image block: the gateway's Tokenize now takes images."""
    import httpx2 as httpx

    from tests.gateway.gateway import Gateway

    generated = collect(svc.stub.Generate(image_chat([encoded(TALL), "What is this?"]), timeout=300))
    image = {"type": "image", "source": {"type": "base64", "media_type": "image/png",
                                         "data": base64.b64encode(encoded(TALL)).decode()}}
    with Gateway(f"127.0.0.1:{svc.port}") as gateway:
        reply = httpx.post(f"{gateway.url}/v1/messages/count_tokens", timeout=120, json={
            "model": "any", "messages": [{"role": "user", "content": [image, {"type": "text", "text": "What is this?"}]}]})
        assert reply.status_code == 200, reply.text
        assert reply.json()["input_tokens"] == generated["last"].usage.prompt_tokens
        # bytes that are no image: refused (400, the scheduler naming the part) as Generate refuses them
        image["source"]["data"] = base64.b64encode(b"not an image at all").decode()
        bad = httpx.post(f"{gateway.url}/v1/messages/count_tokens", timeout=120, json={
            "model": "any", "messages": [{"role": "user", "content": [image, {"type": "text", "text": "What is this?"}]}]})
        assert bad.status_code == 400 and "not an image" in bad.text, bad.text


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
        routed = routed_prompts(worker, tokenizer, ["Look: ", WIDE, TALL, " which?"])
    finally:
        worker.close()
    assert routed == [(params.prompt_token_ids, params.images)] * 2
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


def routed_prompts(worker, tokenizer, parts) -> list:
    """(ids, ImageInputs) of a user message of `parts` (str, PIL images) as a router sends it: tokenized with one
    placeholder an image (media_refs, expanded by the processor), and expanded with the processor's pixels (mm_inputs)."""
    content = [{"type": "text", "text": p} if isinstance(p, str) else {"type": "image"} for p in parts]
    pictures = [p for p in parts if not isinstance(p, str)]
    ids = tokenizer.apply_chat_template([{"role": "user", "content": content}], tokenize=True, add_generation_prompt=True,
                                        return_dict=False)
    images = worker.images
    expanded, refs = images.expand(ids, pictures, 511, "tokenized.input_ids")
    text = tokenizer.apply_chat_template([{"role": "user", "content": content}], tokenize=False, add_generation_prompt=True)
    features = images.processor(text=[text], images=pictures, add_special_tokens=False, return_tensors="pt")
    tensors = {k: v for k, v in features.items() if k in ("pixel_values", "image_grid_thw")}
    full = features["input_ids"][0].tolist()
    ranges = [(i.offset, i.length) for i in refs]
    return [(expanded, refs), images.preprocessed(full, tensors, ranges, 511, "mm_inputs")]


def test_gemma3_router_prompts_are_the_chat_paths(gemma3):
    """Gemma 3's placeholder is `<start_of_image>`: a router's tokenized prompt with one an image, expanded by the
    processor (media_refs), or its expanded ids and pixels (mm_inputs), is the prompt a chat with the image gives."""
    from scheduler_svc.prompts import PromptWorker
    from scheduler_svc.tokenizer import load_tokenizer, read_model_spec

    folder, processor, _ = gemma3
    tokenizer = load_tokenizer(folder)
    worker = PromptWorker(tokenizer, read_model_spec(folder, tokenizer), 512, model_dir=folder)
    try:
        for parts in (["Look at this", WIDE, "?"], [TALL, "and", WIDE, "which?"]):
            chat = image_chat([encoded(p) if isinstance(p, Image.Image) else p for p in parts])
            params = asyncio.run(worker.generate_params(chat))
            assert routed_prompts(worker, processor.tokenizer, parts) == [(params.prompt_token_ids, params.images)] * 2
        # ids that are not what their text tokenizes to ("this" split in two) keep theirs: each anchor expanded alone
        content = [{"type": "text", "text": "Look at this"}, {"type": "image"}, {"type": "text", "text": "?"}]
        ids = processor.tokenizer.apply_chat_template([{"role": "user", "content": content}], tokenize=True,
                                                      add_generation_prompt=True, return_dict=False)
        this = processor.tokenizer.convert_tokens_to_ids("Ġthis")
        split = processor.tokenizer.convert_tokens_to_ids(["Ġth", "is"])
        at = ids.index(this)
        odd = ids[:at] + split + ids[at + 1:]
        expanded, images = worker.images.expand(odd, [WIDE], 511, "tokenized.input_ids")
        anchor = odd.index(processor.tokenizer.boi_token_id)
        fragment = processor.tokenizer(processor.full_image_sequence, add_special_tokens=False)["input_ids"]
        assert expanded == odd[:anchor] + fragment + odd[anchor + 1:]
        chat = asyncio.run(worker.generate_params(image_chat(["Look at this", encoded(WIDE), "?"]))).images
        assert [i.tensors for i in images] == [i.tensors for i in chat] and images[0].offset == expanded.index(
            processor.tokenizer.image_token_id)
    finally:
        worker.close()


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
