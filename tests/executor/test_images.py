"""Images in, at the model runner (issue 40): LLaVA and Gemma 3 with their vision towers, against transformers.

Tiny random `LlavaForConditionalGeneration` (CLIP tower, MLP projector, feature layer -2, the
"default" strategy dropping CLS) and `Gemma3ForConditionalGeneration` (SigLIP tower, pooled to 4
soft tokens, an image's tokens attending both ways) with processors built here: the default
model's tokenizer with the image tokens added, transformers' PIL image processors sized small.
Images drawn with PIL in two sizes and aspect ratios. The plans (tests/executor/plans.py) go
through the wire protobufs, so `ImageInput` is tested as the executor receives it. Every
computed row's log-probabilities equal transformers' forward on the same pixels (its Gemma 3
mask from `token_type_ids`), and greedy equals its `generate`.
"""

from __future__ import annotations

import pytest
import torch
from PIL import Image, ImageDraw

from executor_svc.model_runner import ModelRunner
from pagoda import wire
from pagoda.images import image_inputs as images_of
from pagoda.step import ImageInput, ImageTensor, KVCacheGroupSpec
from pagoda.v1 import executor_pb2 as pb
from tests.executor.plans import PlanBuilder, run_beam_searches, run_to_completion
from tests.vision_models import qwen_inputs, tiny_gemma3, tiny_llava, tiny_qwen2_5_vl

MAX_TOKENS = 6
BLOCK_SIZE = 4
NUM_BLOCKS = 128


def draw(width: int, height: int, color: tuple[int, int, int]) -> Image.Image:
    image = Image.new("RGB", (width, height), color)
    pen = ImageDraw.Draw(image)
    pen.ellipse((width // 5, height // 4, 4 * width // 5, 3 * height // 4), fill=(255 - color[0], color[2], color[1]))
    pen.line((0, height - 1, width - 1, 0), fill=(color[1], 255 - color[2], color[0]), width=3)
    return image


IMAGES = {"wide": draw(48, 30, (200, 30, 60)), "tall": draw(22, 40, (20, 160, 220))}


@pytest.fixture(scope="module")
def llava(tmp_path_factory, default_model_dir):
    """(folder, processor, transformers' model) of a tiny LLaVA (tests/vision_models.py)."""
    out_dir = tmp_path_factory.mktemp("llava")
    return out_dir, *tiny_llava(default_model_dir, out_dir)


@pytest.fixture(scope="module")
def gemma3(tmp_path_factory, default_model_dir):
    """(folder, processor, transformers' model) of a tiny Gemma 3 (tests/vision_models.py)."""
    out_dir = tmp_path_factory.mktemp("gemma3")
    return out_dir, *tiny_gemma3(default_model_dir, out_dir)


@pytest.fixture(scope="module")
def qwen2_5_vl(tmp_path_factory, default_model_dir):
    """(folder, (tokenizer, image processor), transformers' model) of a tiny Qwen2.5-VL (tests/vision_models.py)."""
    out_dir = tmp_path_factory.mktemp("qwen2_5_vl")
    return out_dir, *tiny_qwen2_5_vl(default_model_dir, out_dir)


def runner_of(model_dir, one_group: bool = False) -> ModelRunner:
    # one_group: every layer on one block table (the plans here hold one), sliding layers still windowed
    groups = (KVCacheGroupSpec(tuple(range(4)), None),) if one_group else None
    return ModelRunner(model_dir, device="cpu", dtype="float32", block_size=BLOCK_SIZE, num_kv_blocks=NUM_BLOCKS,
                       kv_cache_groups=groups, encoder_cache_rows=64)


def processed(processor, text: str, image: Image.Image | None):
    return processor(text=text, images=image, return_tensors="pt")


def image_inputs(inputs, image_token_id: int) -> tuple[ImageInput, ...]:
    """The processor's output as the scheduler sends it (`pagoda.images`): one ImageInput a run of image tokens."""
    return images_of(inputs["input_ids"][0].tolist(), inputs, image_token_id)


def serve(runner: ModelRunner, requests: dict[str, tuple], max_tokens: int = MAX_TOKENS, preempt: dict[int, str] | None = None):
    """Run `requests` (id -> (token ids, images, chunk sizes)) in one batch through the wire; returns
    (generated tokens, every computed row's logits per request, errors). The encoder cache is checked every step.
    `preempt`: step -> a request preempted before it (sent again in full, its rows so far dropped)."""
    builder = PlanBuilder(block_size=BLOCK_SIZE, num_blocks=NUM_BLOCKS)
    rows: dict[str, list[torch.Tensor]] = {r: [] for r in requests}
    for req_id, (ids, images, chunks) in requests.items():
        builder.add(req_id, ids, max_tokens, chunk_sizes=chunks, images=images)
    next_plan = builder.next_plan

    def next_plan_preempting():
        victim = (preempt or {}).get(builder.step_id)
        if victim is not None:
            builder.preempt(victim)
            rows[victim].clear()
        return next_plan()

    builder.next_plan = next_plan_preempting
    errors = []

    def step(plan):
        sent = wire.plan_from_proto(pb.StepPlan.FromString(wire.plan_to_proto(plan).SerializeToString()))
        result, logits = runner.execute_with_logits(sent)
        runner.check_encoder_cache()
        errors.extend(result.errors)
        for req_id, rows_of in logits.items():
            rows[req_id].append(rows_of)
        return result

    update = builder.update

    def update_and_stop_failed(plan, result):
        update(plan, result)
        for error in result.errors:
            if error.req_id in builder.requests:
                builder._finish(error.req_id)

    builder.update = update_and_stop_failed

    outputs = run_to_completion(runner, builder, max_steps=200, on_step=step)
    runner.check_encoder_cache()
    assert runner.encoder_cache is None or runner.encoder_cache.num_rows == 0  # freed once computed
    return outputs, {r: torch.cat(v) for r, v in rows.items() if v}, errors


def reference(model, inputs, max_tokens: int = MAX_TOKENS) -> tuple[list[int], torch.Tensor]:
    """transformers' greedy tokens, and its log-probabilities of every row of prompt + output[:-1]."""
    kwargs = {k: v for k, v in inputs.items() if k != "attention_mask"}
    with torch.no_grad():
        out = model.generate(**kwargs, max_new_tokens=max_tokens, do_sample=False, min_new_tokens=max_tokens)
        tokens = out[0, inputs["input_ids"].shape[1] :].tolist()
        full = dict(kwargs, input_ids=out[:, :-1])
        for name in ("token_type_ids", "mm_token_type_ids"):  # (the generated tokens are text)
            if name in kwargs:
                full[name] = torch.nn.functional.pad(kwargs[name], (0, max_tokens - 1))
        logits = model(**full).logits[0].float()
    return tokens, logits.log_softmax(-1)


def assert_equal_to_reference(outputs, rows, req_id, expected) -> None:
    tokens, logprobs = expected
    assert outputs[req_id] == tokens, req_id
    torch.testing.assert_close(rows[req_id].log_softmax(-1), logprobs, atol=1e-4, rtol=1e-5)


# ---- LLaVA ---------------------------------------------------------------------------------

PROMPT = "USER: <image>\nWhat is drawn here, and in which colours? ASSISTANT:"


def test_llava_two_images_in_one_batch_equal_transformers(llava):
    """Two requests, the same text with another image each, in one batch: greedy and every row's
    log-probabilities equal transformers' on the same pixels; the images change the answer."""
    model_dir, processor, model = llava
    runner = runner_of(model_dir)
    image_id = processor.image_token_id
    inputs = {name: processed(processor, PROMPT, IMAGES[name]) for name in IMAGES}
    expected = {name: reference(model, inputs[name]) for name in IMAGES}
    assert not torch.allclose(expected["wide"][1], expected["tall"][1], atol=1e-2)  # another image, another answer
    requests = {name: (inputs[name]["input_ids"][0].tolist(), image_inputs(inputs[name], image_id), None) for name in IMAGES}
    assert all(len(images) == 1 and images[0].length == 16 for _, images, _ in requests.values())
    outputs, rows, errors = serve(runner, requests)
    assert not errors
    for name in IMAGES:
        assert_equal_to_reference(outputs, rows, name, expected[name])
    assert runner.encoder_cache.num_encoded == 2


def test_llava_chunked_prefill_through_an_image(llava):
    """Chunks that end inside the image (3, 5 and 7 tokens of its 16): the encoder runs once, its
    rows stay in the cache until the last placeholder is computed; two images in one prompt, the
    same image in a second request shares its entry; a text-only request is the text model's."""
    model_dir, processor, model = llava
    runner = runner_of(model_dir)
    image_id = processor.image_token_id
    two = processed(processor, "USER: <image> and <image>: which is wider? ASSISTANT:", [IMAGES["wide"], IMAGES["tall"]])
    one = processed(processor, PROMPT, IMAGES["wide"])
    text = processed(processor, "USER: no picture this time. ASSISTANT:", None)
    first = image_inputs(two, image_id)
    assert len(first) == 2
    chunks = [first[0].offset + 3, 5, 7, 9, 100]
    requests = {
        "two": (two["input_ids"][0].tolist(), first, chunks),
        "one": (one["input_ids"][0].tolist(), image_inputs(one, image_id), [first[0].offset + 5, 4]),
        "text": (text["input_ids"][0].tolist(), (), [3]),
    }
    outputs, rows, errors = serve(runner, requests)
    assert not errors
    assert runner.encoder_cache.num_encoded == 2  # the wide image once for both requests, the tall one once
    expected = {name: reference(model, inputs) for name, inputs in (("two", two), ("one", one), ("text", text))}
    for name in expected:
        assert_equal_to_reference(outputs, rows, name, expected[name])

    # the same image twice in one prompt: encoded once, held until its second copy is computed
    twice = processed(processor, "USER: <image> and again <image>: the same? ASSISTANT:", [IMAGES["tall"], IMAGES["tall"]])
    spans = image_inputs(twice, image_id)
    assert spans[0].hash == spans[1].hash
    chunks = [spans[0].end + 3, spans[1].end - spans[0].end - 5, 100]  # the first copy done while the second is half way
    outputs, rows, errors = serve(runner, {"twice": (twice["input_ids"][0].tolist(), spans, chunks)})
    assert not errors and runner.encoder_cache.num_encoded == 3
    assert_equal_to_reference(outputs, rows, "twice", reference(model, twice))

    # preempted with its first image half computed (its hold freed), then sent again: encoded again, the same answer
    outputs, rows, errors = serve(runner, {"two": requests["two"]}, preempt={1: "two"})
    assert not errors and runner.encoder_cache.num_encoded == 3 + 3
    assert_equal_to_reference(outputs, rows, "two", expected["two"])


def test_llava_images_checked_before_any_work(llava, default_model_dir):
    """A span that is not all image tokens, tensors the model does not take, an encoder cache too
    small: each fails its request alone, naming images; a text model given an image too."""
    model_dir, processor, _ = llava
    runner = runner_of(model_dir)
    inputs = processed(processor, PROMPT, IMAGES["wide"])
    ids = inputs["input_ids"][0].tolist()
    (good,) = image_inputs(inputs, processor.image_token_id)
    shifted = ImageInput(good.hash, good.offset - 1, good.length, good.tensors)
    extra = ImageInput(good.hash, good.offset, good.length, (*good.tensors, ImageTensor.from_torch("image_grid_thw", torch.ones(1, 3, dtype=torch.int64))))
    short = ImageInput(good.hash, good.offset, good.length, (ImageTensor("pixel_values", "float32", (1, 3, 32, 32), b"\0" * 12),))
    undeclared = (ids[: good.offset] + [processor.image_token_id] + ids[good.offset :], (good,), None)  # one token more than the span
    requests = {"shifted": (ids, (shifted,), None), "extra": (ids, (extra,), None), "short": (ids, (short,), None),
                "undeclared": undeclared, "good": (ids, (good,), None)}
    outputs, _, errors = serve(runner, requests, max_tokens=2)
    messages = {e.req_id: e.message for e in errors}
    assert set(messages) == {"shifted", "extra", "short", "undeclared"}
    assert "the prompt holds 17 image tokens" in messages["undeclared"]
    assert all(m.startswith("images: ") for m in messages.values())
    assert "not all the image token" in messages["shifted"] and "image_grid_thw" in messages["extra"]
    assert "bytes" in messages["short"] and len(outputs["good"]) == 2

    small = ModelRunner(model_dir, device="cpu", dtype="float32", block_size=BLOCK_SIZE, num_kv_blocks=NUM_BLOCKS, encoder_cache_rows=8)
    _, _, errors = serve(small, {"big": (ids, (good,), None)}, max_tokens=1)
    assert [e.req_id for e in errors] == ["big"] and "encoder cache" in errors[0].message

    text_runner = ModelRunner(default_model_dir, device="cpu", block_size=BLOCK_SIZE, num_kv_blocks=NUM_BLOCKS)
    _, _, errors = serve(text_runner, {"t": ([1, 2, 3, 4], (ImageInput(good.hash, 1, 2, good.tensors),), None)}, max_tokens=1)
    assert [e.req_id for e in errors] == ["t"] and "takes no images" in errors[0].message


# ---- Gemma 3 -------------------------------------------------------------------------------

GEMMA_PROMPT = "Here is a picture that I took on my walk this morning, near the river; please describe it in a few words: <start_of_image> What do you see?"


def test_gemma3_images_equal_transformers_with_bidirectional_image_attention(gemma3):
    """Two images in one batch and a text-only request: every row's log-probabilities equal
    transformers' (its mask lets an image's soft tokens see each other) on sliding and full layers;
    pan and scan (the image and two crops, three blocks of soft tokens); a chunk may end at an
    image's end but not inside it (its request fails alone)."""
    model_dir, processor, model = gemma3
    runner = runner_of(model_dir, one_group=True)
    image_id = processor.tokenizer.image_token_id
    inputs = {name: processed(processor, GEMMA_PROMPT, IMAGES[name]) for name in IMAGES}
    text = processed(processor, "A question without a picture: what comes next?", None)
    crops = processor(text=GEMMA_PROMPT, images=IMAGES["wide"], return_tensors="pt", do_pan_and_scan=True,
                      pan_and_scan_min_crop_size=8, pan_and_scan_max_num_crops=2, pan_and_scan_min_ratio_to_activate=1.2)
    expected = {name: reference(model, inputs[name]) for name in IMAGES}
    assert not torch.allclose(expected["wide"][1], expected["tall"][1], atol=1e-2)
    causal = reference(model, {k: v for k, v in inputs["wide"].items() if k != "token_type_ids"})
    assert not torch.allclose(expected["wide"][1], causal[1], atol=1e-3)  # the image's two-way mask matters
    images = {name: image_inputs(inputs[name], image_id) for name in IMAGES}
    offset = images["wide"][0].offset
    assert images["wide"][0].length == 4 and offset > 16  # the image's rows past the window of 16: sliding layers count
    requests = {
        "wide": (inputs["wide"]["input_ids"][0].tolist(), images["wide"], [offset + 4, 100]),  # a chunk ends at the image's end
        "tall": (inputs["tall"]["input_ids"][0].tolist(), images["tall"], None),
        "text": (text["input_ids"][0].tolist(), (), [5]),
        "crops": (crops["input_ids"][0].tolist(), image_inputs(crops, image_id), None),
    }
    assert len(requests["crops"][1]) == 3
    outputs, rows, errors = serve(runner, requests)
    assert not errors
    for name in IMAGES:
        assert_equal_to_reference(outputs, rows, name, expected[name])
    assert_equal_to_reference(outputs, rows, "text", reference(model, text))
    assert_equal_to_reference(outputs, rows, "crops", reference(model, crops))

    ids = requests["wide"][0]
    _, _, errors = serve(runner, {"split": (ids, images["wide"], [offset + 2, 100])}, max_tokens=1)
    assert [e.req_id for e in errors] == ["split"] and "not to" in errors[0].message


# ---- Qwen2.5-VL ----------------------------------------------------------------------------


def test_qwen2_5_vl_images_equal_transformers_with_3d_rotary_positions(qwen2_5_vl):
    """Two images of other sizes (grids 4 x 6 and 6 x 4) in one batch, one prefilled in chunks that end
    inside its image, and a text-only request: every row's log-probabilities equal transformers',
    whose rotary positions are 3-D (an image's tokens at their grid place, the text after it offset)."""
    model_dir, (tokenizer, images), model = qwen2_5_vl
    runner = runner_of(model_dir)
    config = model.config
    inputs = {name: qwen_inputs(tokenizer, images, config, "Look at this picture:", IMAGES[name], " what is it?") for name in IMAGES}
    text = qwen_inputs(tokenizer, images, config, "No picture, only a question: what comes next?", None, "")
    assert inputs["wide"]["image_grid_thw"].tolist() != inputs["tall"]["image_grid_thw"].tolist()
    expected = {name: reference(model, inputs[name]) for name in IMAGES}
    assert not torch.allclose(expected["wide"][1], expected["tall"][1], atol=1e-2)
    requests = {name: (inputs[name]["input_ids"][0].tolist(), image_inputs(inputs[name], config.image_token_id), None) for name in IMAGES}
    offset = requests["wide"][1][0].offset
    requests["wide"] = (*requests["wide"][:2], [offset + 2, 3, 100])
    requests["text"] = (text["input_ids"][0].tolist(), (), [4])
    outputs, rows, errors = serve(runner, requests)
    assert not errors
    for name in IMAGES:
        assert_equal_to_reference(outputs, rows, name, expected[name])
    assert_equal_to_reference(outputs, rows, "text", reference(model, text))


def test_llava_beam_search_a_constraint_and_n_through_an_image(llava):
    """Beam search over an image request (its beams forked in the core scheduler, each carrying the image)
    equals transformers' `generate(num_beams=3)` on the same pixels; a choice constraint on an image
    request equals transformers' generate with xgrammar's logits processor; `n` = 2 greedy siblings each
    equal its greedy. Each beside the same request with the other image, whose answer differs."""
    import xgrammar as xgr

    from pagoda.constraint import Constraint
    from pagoda.step import SamplingParams
    from scheduler_svc.beam_search import BeamSearch, BeamSearchParams
    from scheduler_svc.core import Request, Scheduler, SchedulerConfig

    model_dir, processor, model = llava
    runner = runner_of(model_dir)
    image_id = processor.image_token_id
    inputs = {name: processed(processor, PROMPT, IMAGES[name]) for name in IMAGES}
    prompts = {name: inputs[name]["input_ids"][0].tolist() for name in IMAGES}
    config = SchedulerConfig(num_blocks=NUM_BLOCKS, block_size=BLOCK_SIZE, max_model_len=runner.max_model_len,
                             kv_cache_groups=runner.kv_cache_groups, max_num_batched_tokens=256)
    width, n, max_tokens = 3, 2, 5
    params = BeamSearchParams(beam_width=width, max_tokens=max_tokens, n=n, vocab_size=runner.vocab_size)
    scheduler = Scheduler(config)
    searches = {name: BeamSearch(name, prompts[name], params, images=image_inputs(inputs[name], image_id)) for name in IMAGES}
    for search in searches.values():
        scheduler.add_requests([search.root()])
    run_beam_searches(runner, scheduler, searches.values(), on_step=runner.check_encoder_cache)
    best = {}
    for name, search in searches.items():
        kwargs = {k: v for k, v in inputs[name].items() if k != "attention_mask"}
        with torch.no_grad():
            rows = model.generate(**kwargs, num_beams=width, num_return_sequences=n, do_sample=False, max_new_tokens=max_tokens,
                                  min_new_tokens=max_tokens)
        best[name] = [list(h.output_token_ids) for h in search.best()]
        assert best[name] == [row[len(prompts[name]):].tolist() for row in rows], name
    assert best["wide"] != best["tall"]

    tokenizer = processor.tokenizer
    choices = ("a red ellipse on a field", "blue lines", "a circle", "nothing")
    info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=runner.vocab_size)
    grammar = "root ::= " + " | ".join(f'"{c}"' for c in choices)
    constraint = Constraint.choice(choices)
    runner.structured.defer = False  # the step waits for its grammar (no re-admission loop here)
    eos = model.generation_config.eos_token_id
    eos = frozenset([eos] if isinstance(eos, int) else eos)
    scheduler = Scheduler(config)
    requests = {name: Request(f"c-{name}", prompts[name], SamplingParams(temperature=0.0, constraint=constraint, stop_token_ids=tuple(eos)),
                              max_tokens=12, eos_token_ids=eos,
                              images=image_inputs(inputs[name], image_id)) for name in IMAGES}
    for request in requests.values():  # (one call each: a list is the `n` siblings of one request)
        scheduler.add_requests([request])
    while scheduler.has_unfinished():
        plan = scheduler.schedule()
        scheduler.update_from_output(plan, runner.execute(plan))
    runner.execute(scheduler.schedule())
    for name, request in requests.items():
        kwargs = {k: v for k, v in inputs[name].items() if k != "attention_mask"}
        processor_ = xgr.contrib.hf.LogitsProcessor(xgr.GrammarCompiler(info).compile_grammar(grammar))
        with torch.no_grad():
            out = model.generate(**kwargs, max_new_tokens=12, do_sample=False, logits_processor=[processor_])
        assert request.output_token_ids == out[0, len(prompts[name]):].tolist(), name
        assert tokenizer.decode(request.output_token_ids, skip_special_tokens=True) in choices
    assert not runner.requests and runner.encoder_cache.num_rows == 0

    # `n` = 2 of each image request (siblings: the follower forks the leader's prompt blocks, image rows included)
    scheduler = Scheduler(config)
    siblings = {name: [Request(f"n{i}-{name}", prompts[name], SamplingParams(temperature=0.0), max_tokens=MAX_TOKENS,
                               eos_token_ids=frozenset(), images=image_inputs(inputs[name], image_id)) for i in range(2)]
                for name in IMAGES}
    for group in siblings.values():
        scheduler.add_requests(group)
    while scheduler.has_unfinished():
        plan = scheduler.schedule()
        scheduler.update_from_output(plan, runner.execute(plan))
    runner.execute(scheduler.schedule())
    for name, group in siblings.items():
        want = reference(model, inputs[name])[0]
        assert [r.output_token_ids for r in group] == [want, want], name
    assert not runner.requests and runner.encoder_cache.num_rows == 0
