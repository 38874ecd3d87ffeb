"""vllm.grpc.engine requests as Pagoda's, and Pagoda's responses as the protocol's (no service)."""

from __future__ import annotations

import grpc
import pytest
from smg_grpc_proto import vllm_engine_pb2 as vpb
from smg_grpc_proto.generated import common_pb2

from pagoda.v1 import generation_pb2 as pb
from scheduler_svc.errors import InvalidArgument
from scheduler_svc.media import MediaConfig
from scheduler_svc.tokenizer import ModelSpec
from scheduler_svc.validation import check_fields
from scheduler_svc.vllm_engine.media import MediaRefsInput, PixelInput, media_ref_schemes, request_media
from scheduler_svc.vllm_engine.requests import constrained_decoding_start, to_pagoda_request, vllm_field_error
from scheduler_svc.vllm_engine.responses import ResponseTranslator

SPEC = ModelSpec(max_position_embeddings=64, vocab_size=100, eos_token_ids=(2,))


def request(**sampling) -> vpb.GenerateRequest:
    return vpb.GenerateRequest(
        request_id="r", tokenized=vpb.TokenizedInput(input_ids=[5, 6, 7]), sampling_params=vpb.SamplingParams(**sampling)
    )


def test_proto3_zeros_mean_what_the_protocol_says():
    out = to_pagoda_request(request(), max_model_len=64)
    sampling = check_fields(out, SPEC, 64)  # Pagoda's own defaults apply to what is left unset
    assert (sampling.temperature, sampling.top_p, sampling.top_k, sampling.min_p) == (1.0, 1.0, 0, 0.0)
    assert sampling.repetition_penalty == 1.0 and sampling.seed is None and not sampling.logprobs
    assert not out.stopping.HasField("max_tokens")  # absent: up to max_model_len
    assert not out.sampling.HasField("n") and out.response.skip_special_tokens is False
    assert list(out.token_ids.ids) == [5, 6, 7] and out.request_id == "r"


def test_set_fields_carry_over():
    out = to_pagoda_request(
        request(
            temperature=0.0, top_p=0.5, top_k=7, min_p=0.1, repetition_penalty=1.2, presence_penalty=0.5,
            frequency_penalty=-0.5, max_tokens=9, min_tokens=2, stop=["\n"], stop_token_ids=[3], ignore_eos=True,
            n=2, logprobs=3, seed=-1, include_stop_str_in_output=True, skip_special_tokens=True, logit_bias={4: 1.5},
        ),
        max_model_len=64,
    )
    s, stop = out.sampling, out.stopping
    assert (s.temperature, s.top_k, s.n, s.seed) == (0.0, 7, 2, 2**64 - 1)
    assert s.top_p == pytest.approx(0.5) and s.repetition_penalty == pytest.approx(1.2)
    assert dict(s.logit_bias) == {4: 1.5}
    assert (stop.max_tokens, stop.min_tokens, list(stop.stop), list(stop.stop_token_ids)) == (9, 2, ["\n"], [3])
    assert stop.ignore_eos and stop.include_stop_str_in_output and out.response.skip_special_tokens
    assert out.response.logprobs and out.response.top_logprobs == 3


def test_logprobs_zero_asks_for_the_sampled_token_only():
    out = to_pagoda_request(request(logprobs=0), max_model_len=64)
    assert out.response.logprobs and out.response.top_logprobs == 0


def test_truncate_prompt_tokens_keeps_the_last_tokens():
    req = request(truncate_prompt_tokens=2)
    assert list(to_pagoda_request(req, 64).token_ids.ids) == [6, 7]
    req.tokenized.input_ids[:] = list(range(10))
    req.sampling_params.truncate_prompt_tokens = -1
    assert list(to_pagoda_request(req, 5).token_ids.ids) == [6, 7, 8, 9]  # max_model_len - 1
    req.sampling_params.truncate_prompt_tokens = 0
    with pytest.raises(InvalidArgument, match="sampling_params.truncate_prompt_tokens"):
        to_pagoda_request(req, 64)


def test_text_input_is_tokenized_by_pagoda():
    out = to_pagoda_request(vpb.GenerateRequest(text="hello"), 64)
    assert out.WhichOneof("prompt") == "text" and out.text == "hello"


@pytest.mark.parametrize(
    "sampling, expected",
    [
        (dict(json_schema='{"type": "object"}'), pb.Constraint(json_schema='{"type": "object"}')),
        (dict(regex="a+"), pb.Constraint(regex="a+")),
        (dict(grammar="root ::= 'a'"), pb.Constraint(grammar="root ::= 'a'")),
        (dict(structural_tag="{}"), pb.Constraint(structural_tag="{}")),
        (dict(json_object=True), pb.Constraint(json_object=True)),
        (dict(choice=vpb.ChoiceConstraint(choices=["a", "b"])), pb.Constraint(choice=pb.Choice(choices=["a", "b"]))),
    ],
)
def test_the_constraint_oneof_becomes_pagodas_structured_output(sampling, expected):
    out = to_pagoda_request(request(**sampling), 64)
    assert out.HasField("constraint") and out.constraint == expected


def test_a_request_without_a_constraint_has_none():
    assert not to_pagoda_request(request(), 64).HasField("constraint")


def test_a_constraint_starts_after_the_reasoning_of_the_engines_parser_unless_the_router_says_first_token():
    # GetServerInfo declares it: "after_reasoning" with a reasoning parser, "first_token" without
    assert constrained_decoding_start("qwen3") == "after_reasoning" and constrained_decoding_start("") == "first_token"
    held = to_pagoda_request(request(regex="a+"), 64, reasoning_parser="qwen3")
    assert held.reasoning_parser == "qwen3" and held.constraint == pb.Constraint(regex="a+")  # admission shapes it
    led = to_pagoda_request(request(regex="a+", grammar_from_first_token=True), 64, reasoning_parser="qwen3")
    assert led.reasoning_parser == "" and led.constraint == pb.Constraint(regex="a+")  # the router led it with the thought
    assert to_pagoda_request(request(regex="a+"), 64).reasoning_parser == ""  # no parser: the first token
    assert to_pagoda_request(request(), 64, reasoning_parser="qwen3").reasoning_parser == ""  # no constraint: no split


def test_constraint_errors_name_the_protocols_field():
    error = vllm_field_error(InvalidArgument("constraint.regex", "does not compile: bad"), request(regex="("))
    assert error.message == "sampling_params.regex: does not compile: bad"


@pytest.mark.parametrize(
    "field, req, code",
    [
        ("kv_transfer_params", vpb.GenerateRequest(kv_transfer_params=vpb.KvTransferParams()), grpc.StatusCode.UNIMPLEMENTED),
        ("kv_transfer_params_json", vpb.GenerateRequest(kv_transfer_params_json="{}"), grpc.StatusCode.UNIMPLEMENTED),
        ("data_parallel_rank", vpb.GenerateRequest(data_parallel_rank=1), grpc.StatusCode.INVALID_ARGUMENT),
        ("sampling_params.prompt_logprobs", request(prompt_logprobs=1), grpc.StatusCode.UNIMPLEMENTED),
        ("sampling_params.logprobs", request(logprobs=-1), grpc.StatusCode.INVALID_ARGUMENT),
        ("sampling_params.logit_bias", request(logit_bias={-3: 1.0}), grpc.StatusCode.INVALID_ARGUMENT),
        ("sampling_params.top_p", request(top_p=float("nan")), grpc.StatusCode.INVALID_ARGUMENT),
        ("input", vpb.GenerateRequest(), grpc.StatusCode.INVALID_ARGUMENT),
    ],
)
def test_what_pagoda_cannot_honour_is_refused_naming_the_field(field, req, code):
    if req.WhichOneof("input") is None and field != "input":
        req.tokenized.input_ids.append(5)
    with pytest.raises(Exception) as err:
        to_pagoda_request(req, 64)
    assert err.value.code == code
    assert err.value.message.startswith(f"{field}: ")


@pytest.mark.parametrize(
    "pagoda_field, vllm_field, input_kind",
    [
        ("sampling.top_p", "sampling_params.top_p", "tokenized"),
        ("stopping.max_tokens", "sampling_params.max_tokens", "tokenized"),
        ("stopping.stop[3]", "sampling_params.stop[3]", "tokenized"),
        ("response.top_logprobs", "sampling_params.logprobs", "tokenized"),
        ("prompt.token_ids", "tokenized.input_ids", "tokenized"),
        ("prompt", "tokenized.input_ids", "tokenized"),
        ("prompt", "text", "text"),
        ("request_id", "request_id", "tokenized"),
    ],
)
def test_pagoda_validation_errors_name_the_protocols_fields(pagoda_field, vllm_field, input_kind):
    req = request() if input_kind == "tokenized" else vpb.GenerateRequest(text="x")
    error = vllm_field_error(InvalidArgument(pagoda_field, "must be in (0, 1], got 1.5"), req)
    assert error.message == f"{vllm_field}: must be in (0, 1], got 1.5"


def pagoda_response(outputs, prompt=None, usage=False) -> pb.GenerateResponse:
    response = pb.GenerateResponse(request_id="r", outputs=outputs)
    if prompt is not None:
        response.prompt_info.num_prompt_tokens, response.prompt_info.num_cached_tokens = prompt
    if usage:
        response.usage.prompt_tokens = 3
    return response


def logprob(token_id, value, top=()):
    return pb.TokenLogprob(token_id=token_id, logprob=value, top=[pb.TopLogprob(token_id=t, logprob=v) for t, v in top])


PAGODA_STREAM = [
    pagoda_response([pb.SequenceOutput(index=0, token_ids=[10], logprobs=[logprob(10, -0.5, [(10, -0.5), (11, -1.0)])])], prompt=(3, 0)),
    pagoda_response(
        [
            pb.SequenceOutput(index=0, token_ids=[12, 13], logprobs=[logprob(12, -0.1, [(12, -0.1)]), logprob(13, -0.2, [(13, -0.2)])],
                              finish_reason=pb.FINISH_REASON_STOP_SEQUENCE, matched_stop="\n"),
            pb.SequenceOutput(index=1, token_ids=[2], logprobs=[logprob(2, -0.3, [(2, -0.3)])], finish_reason=pb.FINISH_REASON_STOP_TOKEN),
        ],
        usage=True,
    ),
]


def translate(stream: bool, top: int = 1):
    translator = ResponseTranslator(stream=stream, logprobs=True, top_logprobs=top)
    return [out for response in PAGODA_STREAM for out in translator.translate(response)]


def test_a_stream_is_chunks_with_a_complete_per_index_as_vllm_sends_them():
    kinds = [(r.WhichOneof("response"), getattr(r, r.WhichOneof("response")).index) for r in translate(stream=True)]
    assert kinds == [("chunk", 0), ("chunk", 0), ("complete", 0), ("chunk", 1), ("complete", 1)]
    chunk, last, complete, _, complete_1 = (getattr(r, r.WhichOneof("response")) for r in translate(stream=True))
    assert list(chunk.token_ids) == [10] and chunk.prompt_tokens == 3 and chunk.completion_tokens == 1
    assert list(chunk.output_logprobs.top_logprobs[0].token_ids) == [10]  # top 1 of the 2 alternatives
    assert list(last.token_ids) == [12, 13] and last.completion_tokens == 2
    assert list(complete.output_ids) == [12, 13]  # the last delta, as vLLM's servicer sends it
    assert complete.completion_tokens == 3 and complete.finish_reason == "stop" and complete.matched_stop_str == "\n"
    assert complete_1.finish_reason == "stop" and complete_1.matched_token_id == 2


def test_without_stream_each_index_is_one_complete_with_every_token():
    first, second = (r.complete for r in translate(stream=False, top=0))
    assert list(first.output_ids) == [10, 12, 13] and first.completion_tokens == 3 and first.index == 0
    assert list(first.output_logprobs.token_logprobs) == pytest.approx([-0.5, -0.1, -0.2])
    assert not first.output_logprobs.top_logprobs  # logprobs = 0: no alternatives
    assert list(second.output_ids) == [2] and second.index == 1


@pytest.mark.parametrize(
    "reason, name",
    [(pb.FINISH_REASON_EOS, "stop"), (pb.FINISH_REASON_LENGTH, "length"), (pb.FINISH_REASON_ABORTED, "abort")],
)
def test_finish_reasons_are_vllms(reason, name):
    translator = ResponseTranslator(stream=False, logprobs=False, top_logprobs=0)
    response = pagoda_response([pb.SequenceOutput(index=0, token_ids=[2], finish_reason=reason)], prompt=(3, 0), usage=True)
    (out,) = translator.translate(response)
    assert out.complete.finish_reason == name and out.complete.WhichOneof("matched_stop") is None


IMAGE = common_pb2.Modality.Value("IMAGE")


def pixels(**fields) -> vpb.TensorData:
    return vpb.TensorData(**({"shape": [1, 3, 2, 2], "dtype": "float32", "inline": bytes(48)} | fields))


@pytest.mark.parametrize(
    "field, req",
    [
        ("extra_mm_inputs", vpb.GenerateRequest(extra_mm_inputs=[vpb.MultimodalInputs()])),
        ("media_refs", vpb.GenerateRequest(media_refs=vpb.MediaRefs(items=[vpb.MediaRef(modality=IMAGE, url="data:,")]),
                                           mm_inputs=vpb.MultimodalInputs(pixel_values=pixels()))),
        ("media_refs", vpb.GenerateRequest(text="hi", media_refs=vpb.MediaRefs(items=[vpb.MediaRef(modality=IMAGE, url="x")]))),
        ("mm_inputs", vpb.GenerateRequest(text="hi", mm_inputs=vpb.MultimodalInputs(pixel_values=pixels()))),
        ("media_refs.items", vpb.GenerateRequest(media_refs=vpb.MediaRefs())),
        ("media_refs.items[1].modality", vpb.GenerateRequest(media_refs=vpb.MediaRefs(items=[
            vpb.MediaRef(modality=IMAGE, url="data:,"), vpb.MediaRef(modality=common_pb2.Modality.Value("VIDEO"), url="u")]))),
    ],
)
def test_images_the_engine_cannot_read_are_refused_naming_the_field(field, req):
    if req.WhichOneof("input") is None:
        req.tokenized.input_ids.append(5)
    with pytest.raises(InvalidArgument) as err:
        request_media(req)
    assert err.value.message.startswith(f"{field}: "), err.value.message


@pytest.mark.parametrize(
    "field, mm, words",
    [
        ("mm_inputs.pixel_values", vpb.MultimodalInputs(), "is required"),
        ("mm_inputs.pixel_values", vpb.MultimodalInputs(pixel_values=pixels(inline=bytes(47))), "needs 48"),
        ("mm_inputs.pixel_values", vpb.MultimodalInputs(pixel_values=pixels(dtype="float64")), "dtype"),
        ("mm_inputs.pixel_values", vpb.MultimodalInputs(pixel_values=pixels(shape=[1, 3, 0, 2], inline=b"")), "empty"),
        ("mm_inputs.pixel_values", vpb.MultimodalInputs(pixel_values=vpb.TensorData(
            shape=[1], dtype="float32", shm=common_pb2.ShmHandle())), "only inline"),
        ("mm_inputs.pixel_values", vpb.MultimodalInputs(pixel_values=pixels(shape=[2**20, 3, 64, 64], inline=b"")), "more than"),
        ("mm_inputs.model_specific_tensors[image_grid_thw]", vpb.MultimodalInputs(
            pixel_values=pixels(), model_specific_tensors={"image_grid_thw": pixels(dtype="int64")}), "needs 96"),
        ("mm_inputs.modality", vpb.MultimodalInputs(modality=common_pb2.Modality.Value("VIDEO")), "only images"),
        ("mm_inputs.mm_placeholders", vpb.MultimodalInputs(
            pixel_values=pixels(), mm_placeholders=[vpb.PlaceholderRange(offset=0, length=1)] * 3), "more than 2"),
    ],
)
def test_router_pixels_are_checked_before_they_are_read(field, mm, words):
    with pytest.raises(InvalidArgument) as err:
        PixelInput(mm).check(MediaConfig(limit_images=2))
    assert err.value.message.startswith(f"{field}: ") and words in err.value.message, err.value.message


def test_media_refs_urls_are_held_to_the_allowed_domains_and_the_image_limit():
    refs = MediaRefsInput(("data:image/png;base64,AAAA", "https://example.com/cat.png"))
    with pytest.raises(InvalidArgument) as err:
        refs.check(MediaConfig())
    assert err.value.message.startswith("media_refs.items[1].url: ") and "allowed-media-domains" in err.value.message
    refs.check(MediaConfig(allowed_domains=("example.com",)))
    with pytest.raises(InvalidArgument) as err:
        refs.check(MediaConfig(limit_images=1, allowed_domains=("example.com",)))
    assert err.value.message.startswith("media_refs.items[1]: more than 1 images")
    assert media_ref_schemes(MediaConfig()) == "data"
    assert media_ref_schemes(MediaConfig(allowed_domains=("example.com",))) == "http,https,data"
