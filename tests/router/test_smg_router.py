"""SMG, the field's router, in front of two Pagoda schedulers over `vllm.grpc.engine.VllmEngine`.

One set of services for the whole module (2 cores in CI): two schedulers, each with one CPU
executor, and `smg launch --backend vllm --worker-urls grpc://a grpc://b`. The tests check that
what comes through the router is Pagoda's own answer (and transformers'), that the router routes
by the real prefix caches (KV events), that its health and load views are the schedulers', that
VllmEngine answers grpcurl-style calls found by reflection, and, last, that a killed scheduler
leaves new requests to the other.
"""

from __future__ import annotations

import hashlib
import io
import time
import uuid
import zipfile
from concurrent.futures import ThreadPoolExecutor

import grpc
import httpx2 as httpx
import openai
import pytest
from google.protobuf import descriptor_pb2, descriptor_pool, message_factory
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc
from smg_grpc_proto import vllm_engine_pb2 as vpb
from smg_grpc_proto import vllm_engine_pb2_grpc as vpb_grpc
from smg_grpc_proto.generated import common_pb2

from bench.smg_router import DETERMINISTIC_ROUTING, SmgRouter
from pagoda import model_files
from pagoda.v1 import generation_pb2 as pb
from tests.client.services import EXECUTOR_ARGS
from tests.service.harness import Service, collect, greedy_request, one_torch_thread

try:  # main has moved transformers' greedy continuation to tests/references.py
    from tests.references import hf_greedy
except ImportError:
    from tests.service.harness import hf_greedy

pytestmark = pytest.mark.timeout(900)

MESSAGES = [{"role": "user", "content": "What is the capital of France?"}]
PROMPT = "The three primary colors are"
VLLM_SERVICE = "vllm.grpc.engine.VllmEngine"


@pytest.fixture(scope="module")
def schedulers():
    services = [Service(executor_args=EXECUTOR_ARGS), Service(executor_args=EXECUTOR_ARGS)]
    try:
        with ThreadPoolExecutor(2) as pool:  # both start at once: half the wait
            list(pool.map(Service.start, services))
        yield services
    finally:
        for svc in services:
            svc.stop()


@pytest.fixture(scope="module")
def router(schedulers):
    urls = [f"grpc://127.0.0.1:{svc.port}" for svc in schedulers]
    # qwen3: the router splits `<think>` blocks off as Pagoda's qwen3 parser does (SmolLM2 writes none unasked)
    args = [*DETERMINISTIC_ROUTING, "--health-check-interval-secs", "1", "--reasoning-parser", "qwen3"]
    with SmgRouter(urls, args) as smg:
        yield smg


@pytest.fixture(scope="module")
def oai(router):
    return openai.OpenAI(base_url=f"{router.url}/v1", api_key="unused", max_retries=0, timeout=180)


@pytest.fixture(scope="module")
def model_name(schedulers):
    return schedulers[0].stub.GetModelInfo(pb.GetModelInfoRequest(), timeout=10).name


def vllm_stub(svc: Service) -> vpb_grpc.VllmEngineStub:
    return vpb_grpc.VllmEngineStub(svc.channel)


def unique_text(words: int) -> str:
    """Text no earlier request sent: its blocks are cached nowhere yet."""
    tag = uuid.uuid4().hex[:8]
    return " ".join(f"{tag}{i % 10} apple river" for i in range(words // 3)) + " and then"


def pagoda_text(svc: Service, text: str, max_tokens: int, **response) -> dict:
    req = greedy_request(text=text, max_tokens=max_tokens)
    for key, value in response.items():
        setattr(req.response, key, value)
    return collect(svc.stub.Generate(req, timeout=120))


# ---- answers -------------------------------------------------------------------------------


def test_chat_through_the_router_equals_pagodas_greedy_answer_streamed_or_not(schedulers, oai, model_name):
    want = collect(schedulers[0].stub.Generate(greedy_request(chat=[("user", MESSAGES[0]["content"])], max_tokens=24), timeout=120))
    reply = oai.chat.completions.create(model=model_name, messages=MESSAGES, max_tokens=24, temperature=0)
    assert reply.choices[0].message.content == want["outputs"][0]["text"]
    assert reply.usage.prompt_tokens == want["last"].usage.prompt_tokens
    assert reply.usage.completion_tokens == want["last"].usage.completion_tokens
    stream = oai.chat.completions.create(
        model=model_name, messages=MESSAGES, max_tokens=24, temperature=0, stream=True, stream_options={"include_usage": True}
    )
    chunks = list(stream)
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == want["outputs"][0]["text"]
    assert chunks[-1].usage.completion_tokens == want["last"].usage.completion_tokens


def test_completions_through_the_router_equal_pagoda_and_transformers(schedulers, oai, model_name, hf_reference):
    want = pagoda_text(schedulers[1], PROMPT, 16)
    hf_model, tokenizer = hf_reference
    with one_torch_thread():
        hf_ids = hf_greedy(hf_model, tokenizer.encode(PROMPT), 16)
    assert want["outputs"][0]["token_ids"] == hf_ids
    reply = oai.completions.create(model=model_name, prompt=PROMPT, max_tokens=16, temperature=0)
    assert reply.choices[0].text == want["outputs"][0]["text"] == tokenizer.decode(hf_ids, skip_special_tokens=True)
    streamed = "".join(c.choices[0].text for c in oai.completions.create(
        model=model_name, prompt=PROMPT, max_tokens=16, temperature=0, stream=True) if c.choices)
    assert streamed == want["outputs"][0]["text"]


def test_chat_logprobs_through_the_router_are_pagodas(schedulers, oai, model_name):
    req = greedy_request(chat=[("user", MESSAGES[0]["content"])], max_tokens=6)
    req.response.logprobs, req.response.top_logprobs = True, 2
    want = collect(schedulers[0].stub.Generate(req, timeout=120))["outputs"][0]["logprobs"]
    reply = oai.chat.completions.create(
        model=model_name, messages=MESSAGES, max_tokens=6, temperature=0, logprobs=True, top_logprobs=2
    )
    got = reply.choices[0].logprobs.content
    assert [t.logprob for t in got] == pytest.approx([lp.logprob for lp in want], abs=1e-4)
    assert [[a.logprob for a in t.top_logprobs] for t in got] == [
        pytest.approx([a.logprob for a in lp.top], abs=1e-4) for lp in want
    ]


# ---- VllmEngine itself -------------------------------------------------------------------


def vllm_generate(svc: Service, ids: list[int], stream: bool = True, **sampling) -> list[vpb.GenerateResponse]:
    req = vpb.GenerateRequest(
        request_id=uuid.uuid4().hex, tokenized=vpb.TokenizedInput(input_ids=ids),
        sampling_params=vpb.SamplingParams(**sampling), stream=stream,
    )
    return list(vllm_stub(svc).Generate(req, timeout=120))


def completes(responses) -> dict[int, vpb.GenerateComplete]:
    return {r.complete.index: r.complete for r in responses if r.WhichOneof("response") == "complete"}


def test_vllm_engine_generate_is_pagodas_generate(schedulers):
    svc = schedulers[0]
    ids = list(svc.stub.Tokenize(pb.TokenizeRequest(text=PROMPT), timeout=10).token_ids)
    want = collect(svc.stub.Generate(greedy_request(prompt_ids=ids, max_tokens=8), timeout=120))
    responses = vllm_generate(svc, ids, temperature=0.0, max_tokens=8)
    chunks = [r.chunk for r in responses if r.WhichOneof("response") == "chunk"]
    assert [t for c in chunks for t in c.token_ids] == want["outputs"][0]["token_ids"]
    assert all(c.prompt_tokens == len(ids) for c in chunks)
    final = completes(responses)[0]
    assert final.finish_reason == "length" and final.completion_tokens == 8
    # n samples with a seed: the same tokens per index as Pagoda's own API
    seeded = greedy_request(prompt_ids=ids, max_tokens=6)
    seeded.sampling.temperature, seeded.sampling.seed, seeded.sampling.n = 1.0, 7, 2
    want = collect(svc.stub.Generate(seeded, timeout=120))
    got = completes(vllm_generate(svc, ids, stream=False, temperature=1.0, seed=7, n=2, max_tokens=6))
    assert {i: list(c.output_ids) for i, c in got.items()} == {i: o["token_ids"] for i, o in want["outputs"].items()}
    # a stop string: "stop", the string, and the ids up to the token that completed it
    text = pagoda_text(svc, PROMPT, 16)["outputs"][0]["text"]
    stop = text.split()[1]
    stopped = greedy_request(prompt_ids=ids, max_tokens=16)
    stopped.stopping.stop.append(stop)
    want = collect(svc.stub.Generate(stopped, timeout=120))
    final = completes(vllm_generate(svc, ids, stream=False, temperature=0.0, max_tokens=16, stop=[stop]))[0]
    assert (final.finish_reason, final.matched_stop_str) == ("stop", stop)
    assert list(final.output_ids) == want["outputs"][0]["token_ids"]


def test_vllm_engine_constraints_are_pagodas_structured_output(schedulers):
    svc = schedulers[0]
    ids = list(svc.stub.Tokenize(pb.TokenizeRequest(text=PROMPT), timeout=10).token_ids)
    choices = ["alpha", "beta", "gamma"]
    want_req = greedy_request(prompt_ids=ids, max_tokens=16)
    want_req.constraint.choice.choices.extend(choices)
    want = collect(svc.stub.Generate(want_req, timeout=120))["outputs"][0]
    assert want["text"] in choices
    final = completes(
        vllm_generate(svc, ids, stream=False, temperature=0.0, max_tokens=16, choice=vpb.ChoiceConstraint(choices=choices))
    )[0]
    assert list(final.output_ids) == want["token_ids"] and final.finish_reason == "stop"


def test_the_routers_reasoning_split_is_pagodas(schedulers, router, oai, model_name):
    """A thought the model is made to write (a regex constraint, which the router hands the engine to
    run from the first token, as the workers declare: they run no reasoning parser) comes back split
    as Pagoda's qwen3 parser splits the same greedy text (what Pagoda's gateway and gRPC API return)."""
    from pagoda.reasoning import get_reasoning_parser

    svc = schedulers[0]
    info = vllm_stub(svc).GetServerInfo(vpb.GetServerInfoRequest(), timeout=10)
    assert (info.engine_reasoning_parser, info.constrained_decoding_start) == ("", "first_token")
    assert router.worker(svc.port)["labels"]["constrained_decoding_start"] == "first_token"
    regex = "<think>[a-z ]+</think>[A-Za-z ]+"
    req = greedy_request(chat=[("user", MESSAGES[0]["content"])], max_tokens=24)
    req.constraint.regex = regex
    text = collect(svc.stub.Generate(req, timeout=180))["outputs"][0]["text"]
    reasoning, content = get_reasoning_parser("qwen3").split("", text)
    assert text.startswith("<think>") and reasoning and content, text  # a thought and an answer
    reply = oai.chat.completions.create(model=model_name, messages=MESSAGES, max_tokens=24, temperature=0,
                                        extra_body={"regex": regex})
    message = reply.choices[0].message
    assert (message.model_extra["reasoning_content"], message.content) == (reasoning, content)


@pytest.mark.parametrize(
    "sampling, code, field",
    [
        (dict(top_p=1.5), grpc.StatusCode.INVALID_ARGUMENT, "sampling_params.top_p"),
        (dict(max_tokens=100_000), grpc.StatusCode.INVALID_ARGUMENT, "sampling_params.max_tokens"),
        (dict(logprobs=21), grpc.StatusCode.INVALID_ARGUMENT, "sampling_params.logprobs"),
        (dict(regex="[ab"), grpc.StatusCode.INVALID_ARGUMENT, "sampling_params.regex"),
        (dict(prompt_logprobs=1), grpc.StatusCode.UNIMPLEMENTED, "sampling_params.prompt_logprobs"),
    ],
)
def test_vllm_engine_refuses_bad_fields_by_name_and_keeps_serving(schedulers, sampling, code, field):
    svc = schedulers[1]
    with pytest.raises(grpc.RpcError) as err:
        vllm_generate(svc, [5, 6, 7], **sampling)
    assert err.value.code() == code and err.value.details().startswith(f"{field}:")
    assert completes(vllm_generate(svc, [5, 6, 7], temperature=0.0, max_tokens=2))[0].completion_tokens == 2


def test_vllm_engine_abort_ends_the_stream_and_frees_its_blocks(schedulers):
    svc = schedulers[1]
    request_id = uuid.uuid4().hex
    req = vpb.GenerateRequest(
        request_id=request_id, tokenized=vpb.TokenizedInput(input_ids=[5, 6, 7] * 20), stream=True,
        sampling_params=vpb.SamplingParams(temperature=0.0, max_tokens=2000, ignore_eos=True),
    )
    call = vllm_stub(svc).Generate(req, timeout=120)
    next(call)  # running
    vllm_stub(svc).Abort(vpb.AbortRequest(request_ids=[request_id, "unknown-id"]), timeout=10)
    final = completes(list(call))[0]
    assert final.finish_reason == "abort" and final.completion_tokens < 2000
    info = svc.wait_all_blocks_free()
    assert info.num_running == 0 and all(e.num_free_blocks == e.num_total_blocks for e in info.executors)


def test_get_tokenizer_streams_the_tokenizer_files_with_their_sha256(schedulers):
    chunks = list(vllm_stub(schedulers[0]).GetTokenizer(common_pb2.GetTokenizerRequest(), timeout=60))
    data = b"".join(c.data for c in chunks)
    assert [bool(c.sha256) for c in chunks] == [False] * (len(chunks) - 1) + [True]
    assert chunks[-1].sha256 == hashlib.sha256(data).hexdigest()
    model_dir = model_files.resolve_model(None, weights=False)
    with zipfile.ZipFile(io.BytesIO(data)) as bundle:
        assert bundle.read("tokenizer.json") == (model_dir / "tokenizer.json").read_bytes()
        assert {"tokenizer_config.json", "config.json"} <= set(bundle.namelist())


def test_flush_cache_empties_the_prefix_caches_once_idle(schedulers):
    svc = schedulers[1]
    pagoda_text(svc, unique_text(60), 2)
    assert sum(e.num_cached_blocks for e in svc.server_info().executors) > 0
    reply = vllm_stub(svc).FlushCache(common_pb2.FlushCacheRequest(timeout_s=10), timeout=30)
    assert reply.success, reply.message
    assert sum(e.num_cached_blocks for e in svc.server_info().executors) == 0
    with pytest.raises(grpc.RpcError) as err:
        vllm_stub(svc).FlushCache(common_pb2.FlushCacheRequest(timeout_s=-1), timeout=10)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "timeout_s" in err.value.details()


def test_reflection_finds_vllm_engine_and_calls_it_grpcurl_style(schedulers):
    """What `grpcurl -plaintext host:port vllm.grpc.engine.VllmEngine/GetModelInfo` does: list the
    services, fetch the descriptors by symbol, build the messages from them, call the method."""
    channel = schedulers[0].channel
    reflection = reflection_pb2_grpc.ServerReflectionStub(channel)

    def ask(**request):
        (answer,) = reflection.ServerReflectionInfo(iter([reflection_pb2.ServerReflectionRequest(**request)]), timeout=10)
        return answer

    assert VLLM_SERVICE in [s.name for s in ask(list_services="").list_services_response.service]
    pool = descriptor_pool.DescriptorPool()
    files = [descriptor_pb2.FileDescriptorProto.FromString(raw)
             for raw in ask(file_containing_symbol=VLLM_SERVICE).file_descriptor_response.file_descriptor_proto]
    for file in sorted(files, key=lambda f: len(f.dependency)):  # common.proto before vllm_engine.proto
        pool.Add(file)
    service = pool.FindServiceByName(VLLM_SERVICE)
    for method_name, check in (
        ("GetModelInfo", lambda reply: reply.max_context_length > 0 and reply.is_generation),
        ("HealthCheck", lambda reply: reply.healthy),
    ):
        method = service.FindMethodByName(method_name)
        request_class = message_factory.GetMessageClass(method.input_type)
        reply_class = message_factory.GetMessageClass(method.output_type)
        call = channel.unary_unary(
            f"/{VLLM_SERVICE}/{method_name}", request_serializer=request_class.SerializeToString,
            response_deserializer=reply_class.FromString,
        )
        assert check(call(request_class(), timeout=10)), method_name


# ---- routing by the real prefix caches ---------------------------------------------------


def cached_through_router(oai, model_name, prompt: str) -> int:
    reply = oai.completions.create(model=model_name, prompt=prompt, max_tokens=2, temperature=0)
    return reply.usage.prompt_tokens_details.cached_tokens


@pytest.mark.parametrize("holder", [0, 1])
def test_a_prefix_cached_on_one_scheduler_is_routed_there(schedulers, oai, model_name, holder):
    """The prefix is sent to scheduler `holder` directly, never through the router: only its KV
    events can tell the router where it is cached."""
    prefix = unique_text(150)
    warm = pagoda_text(schedulers[holder], prefix, 1)
    num_prefix = warm["last"].usage.prompt_tokens
    time.sleep(1.0)  # the events reach the router within a step; a second is generous
    cached = cached_through_router(oai, model_name, prefix + " a river")
    assert cached >= (num_prefix // 16 - 1) * 16 > 0, cached  # every full block of the prefix, or all but one


def test_a_conversation_returns_to_where_its_history_is_cached(oai, model_name):
    messages = [{"role": "system", "content": unique_text(120)}, {"role": "user", "content": "Name a color."}]
    first = oai.chat.completions.create(model=model_name, messages=messages, max_tokens=8, temperature=0)
    messages += [{"role": "assistant", "content": first.choices[0].message.content},
                 {"role": "user", "content": "And another one?"}]
    time.sleep(1.0)
    second = oai.chat.completions.create(model=model_name, messages=messages, max_tokens=8, temperature=0)
    assert second.usage.prompt_tokens_details.cached_tokens >= (first.usage.prompt_tokens // 16 - 1) * 16 > 0


# ---- the router's view of the schedulers ---------------------------------------------------


def wait_for(condition, timeout: float = 30.0, what: str = ""):
    deadline = time.monotonic() + timeout
    while True:
        value = condition()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"not within {timeout} s: {what}")
        time.sleep(0.2)


def test_the_routers_health_and_load_views_match_get_server_info(schedulers, router):
    for svc in schedulers:
        info = vllm_stub(svc).GetServerInfo(vpb.GetServerInfoRequest(), timeout=10)
        pagoda_info = svc.server_info()
        worker = router.worker(svc.port)
        assert worker["is_healthy"] and vllm_stub(svc).HealthCheck(vpb.HealthCheckRequest(), timeout=10).healthy
        assert worker["labels"]["page_size"] == str(info.block_size)
        assert worker["labels"]["max_num_seqs"] == str(info.max_num_seqs)
        load = worker["engine_load"]["loads"][0]
        assert load["max_total_num_tokens"] == sum(e.num_total_blocks for e in pagoda_info.executors) * info.block_size
    svc = schedulers[0]
    busy = greedy_request(prompt_ids=[5, 6, 7] * 10, max_tokens=2000, ignore_eos=True)
    call = svc.stub.Generate(busy, timeout=300)
    next(call)

    def both_say(running: int) -> bool:
        load = router.worker(svc.port)["engine_load"]["loads"][0]
        pagoda_info = svc.server_info()
        return load["num_running_reqs"] == pagoda_info.num_running == running and load["num_waiting_reqs"] == pagoda_info.num_waiting

    wait_for(lambda: both_say(1), what="the router's pushed load shows the running request")
    call.cancel()
    wait_for(lambda: both_say(0), what="the router's pushed load shows it gone")


# ---- failure (last: it kills a scheduler) -------------------------------------------------


def test_a_killed_scheduler_leaves_new_requests_to_the_other(schedulers, router, oai, model_name):
    long_stream = oai.completions.create(
        model=model_name, prompt=PROMPT, max_tokens=2000, temperature=0, stream=True, extra_body={"ignore_eos": True}
    )
    first = next(iter(long_stream))
    assert first is not None
    victim = wait_for(lambda: next((s for s in schedulers if s.server_info().num_running), None), what="the stream runs")
    survivor = next(s for s in schedulers if s is not victim)
    victim.scheduler.kill()  # SIGKILL mid-stream: no drain, no goodbye
    victim.scheduler.wait()
    received = 1
    try:  # the stream it was serving breaks (how the router tells its client is the router's)
        for _ in long_stream:
            received += 1
    except (openai.APIError, httpx.HTTPError):
        pass
    assert received < 2000
    before = vllm_stub(survivor).GetServerInfo(vpb.GetServerInfoRequest(), timeout=10).last_receive_timestamp
    for i in range(4):
        reply = oai.completions.create(model=model_name, prompt=f"{PROMPT} number {i}", max_tokens=4, temperature=0)
        assert reply.choices[0].finish_reason in ("length", "stop") and reply.usage.completion_tokens >= 1
    after = vllm_stub(survivor).GetServerInfo(vpb.GetServerInfoRequest(), timeout=10).last_receive_timestamp
    assert after > before  # they ran on the survivor
    wait_for(lambda: not router.worker(victim.port)["is_healthy"], what="the router marks the dead scheduler unhealthy")
