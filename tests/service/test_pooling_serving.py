"""Embeddings and reranking served end to end (issue 39): one scheduler and two pooling executors
(`--runner pooling`) on a tiny random sentence-transformers folder made here, the gateway in front.

The numbers are sentence-transformers' on the same folder: `Embed` equals `SentenceTransformer.encode`
(cosine >= 0.9999, largest difference <= 1e-4, float32) for a batch of short and long texts;
`Rerank` on an embedding model equals the cosine similarity of those vectors; the gateway's
answers equal the gRPC ones (the official `openai` SDK for /v1/embeddings). Bad inputs are
INVALID_ARGUMENT naming the field before any work, and the service keeps serving; an executor
killed mid-batch leaves its inputs to the other, which computes the same numbers.
(Cross-encoders' scores against `CrossEncoder.predict` are checked at the runner's level,
tests/executor/test_pooling.py; here the scheduler's pair tokenization is checked against
sentence-transformers' tokenizer.)
"""

from __future__ import annotations

import base64
import signal
import threading
import time

import grpc
import httpx2 as httpx
import numpy as np
import pytest

from pagoda.v1 import generation_pb2 as pb
from tests.gateway.gateway import Gateway
from tests.service.harness import Service

st = pytest.importorskip("sentence_transformers")
pooling_models = pytest.importorskip("tests.executor.test_pooling")

DIMS = [8, 16, pooling_models.HIDDEN]
BUDGET = 256  # tokens a step: a batch of long texts takes many steps (the kill lands mid-batch)


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    root = tmp_path_factory.mktemp("pooling-serving")
    model = pooling_models.encoder_folder(root, "bert", seed=11)
    return pooling_models.st_folder(model, "mean", True, {"matryoshka_dimensions": DIMS})


@pytest.fixture(scope="module")
def reference(folder):
    return st.SentenceTransformer(str(folder), device="cpu")


@pytest.fixture(scope="module")
def service(folder):
    with Service(
        model=str(folder),
        scheduler_args=["--runner", "pooling", "--max-num-batched-tokens", str(BUDGET), "--executor-timeout", "1.0"],
        executor_args=["--runner", "pooling", "--num-threads", "1"],
        num_executors=2,
    ) as svc:
        yield svc


def assert_same(ours, theirs) -> None:
    """Two answers of the same inputs: equal up to the float32 rounding of differently batched steps
    (an input's step mates, and so its attention kernel's shapes, depend on the queue at the time)."""
    np.testing.assert_allclose(np.asarray(ours, dtype=np.float32), np.asarray(theirs, dtype=np.float32), rtol=0, atol=1e-6)


def vectors(reply: pb.EmbedResponse) -> np.ndarray:
    assert [e.index for e in reply.embeddings] == list(range(len(reply.embeddings)))
    return np.asarray([list(e.values) for e in reply.embeddings], dtype=np.float32)


def test_embed_equals_sentence_transformers(service, reference):
    inputs = pooling_models.texts()
    reply = service.stub.Embed(pb.EmbedRequest(texts=inputs), timeout=120)
    pooling_models.assert_vectors_equal(vectors(reply), reference.encode(inputs))
    assert reply.usage.prompt_tokens == sum(len(ids) for ids in reference.tokenizer(inputs)["input_ids"])
    # token ids as sentence-transformers' tokenizer gives them: the same vectors
    ids = [pb.TokenIds(ids=i) for i in reference.tokenizer(inputs)["input_ids"]]
    by_ids = service.stub.Embed(pb.EmbedRequest(token_ids=ids), timeout=120)
    assert_same(vectors(by_ids), vectors(reply))
    metrics = httpx.get(f"http://127.0.0.1:{service.metrics_port}/metrics", timeout=30).text
    counted = [line for line in metrics.splitlines() if line.startswith("pagoda:prompt_tokens_total ")]
    assert counted and float(counted[0].split()[1]) == 2 * reply.usage.prompt_tokens  # (the module's first requests)


def test_the_python_client_and_the_cli(service, capsys):
    import json

    from pagoda.client import Client
    from pagoda.client.cli import main as pagoda_cli

    inputs = pooling_models.texts(n=4, seed=8)
    grpc_vectors = vectors(service.stub.Embed(pb.EmbedRequest(texts=inputs), timeout=60))
    grpc_rerank = service.stub.Rerank(pb.RerankRequest(query=inputs[0], documents=inputs[1:], top_n=2), timeout=60)
    with Client(f"127.0.0.1:{service.port}", timeout=60) as client:
        reply = client.embed(inputs)
        assert_same(reply.vectors, grpc_vectors)
        assert len(client.embed(inputs[0], dimensions=8).vectors[0]) == 8
        ranked = client.rerank(inputs[0], inputs[1:], top_n=2)
        assert [r.index for r in ranked.results] == [r.index for r in grpc_rerank.results]
        assert_same([r.relevance_score for r in ranked.results], [r.relevance_score for r in grpc_rerank.results])
    capsys.readouterr()
    assert pagoda_cli(["embed", "--target", f"127.0.0.1:{service.port}", *inputs[:2]]) == 0
    lines = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert [line["index"] for line in lines] == [0, 1]
    assert_same([line["embedding"] for line in lines], grpc_vectors[:2])


def test_vllm_engine_embed_for_smg(service):
    from smg_grpc_proto import vllm_engine_pb2 as vpb
    from smg_grpc_proto import vllm_engine_pb2_grpc as vpb_grpc

    engine = vpb_grpc.VllmEngineStub(service.channel)
    text = pooling_models.texts(n=3)[2]
    ours = vectors(service.stub.Embed(pb.EmbedRequest(texts=[text]), timeout=60))[0]
    by_text = engine.Embed(vpb.EmbedRequest(request_id="t", tokenized=vpb.TokenizedInput(original_text=text)), timeout=60)
    ids = service.stub.Embed(pb.EmbedRequest(texts=[text]), timeout=60).usage.prompt_tokens
    assert by_text.embedding_dim == len(ours) and by_text.prompt_tokens == ids
    assert_same(by_text.embedding, ours)
    with pytest.raises(grpc.RpcError) as err:
        engine.Embed(vpb.EmbedRequest(request_id="u", tokenized=vpb.TokenizedInput(input_ids=[2, 10**6])), timeout=60)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert err.value.details().startswith("tokenized.input_ids[1]:"), err.value.details()
    info = engine.GetModelInfo(vpb.GetModelInfoRequest(), timeout=60)
    assert not info.is_generation


def test_matryoshka_dimensions_and_normalize(service, folder, reference):
    inputs = pooling_models.texts(seed=3)
    cut = st.SentenceTransformer(str(folder), device="cpu", truncate_dim=16)
    reply = service.stub.Embed(pb.EmbedRequest(texts=inputs, dimensions=16), timeout=120)
    pooling_models.assert_vectors_equal(vectors(reply), cut.encode(inputs, normalize_embeddings=True))
    raw = vectors(service.stub.Embed(pb.EmbedRequest(texts=inputs, normalize=False), timeout=120))
    unnormalized = st.SentenceTransformer(modules=[reference[0], reference[1]], device="cpu")  # without Normalize
    pooling_models.assert_vectors_equal(raw, unnormalized.encode(inputs))


def test_rerank_on_an_embedding_model_is_cosine_similarity(service, reference):
    query, documents = "the cat runs", pooling_models.texts(n=6, seed=5)
    reply = service.stub.Rerank(pb.RerankRequest(query=query, documents=documents, top_n=4), timeout=120)
    q, d = reference.encode([query]), reference.encode(documents)
    expected = (d @ q[0]) / (np.linalg.norm(d, axis=1) * np.linalg.norm(q[0]))
    assert len(reply.results) == 4
    assert [r.index for r in reply.results] == list(np.argsort(-expected, kind="stable")[:4])
    assert max(abs(r.relevance_score - expected[r.index]) for r in reply.results) <= 1e-4


def test_the_gateway_answers_as_grpc_does(service):
    import openai

    inputs = pooling_models.texts(n=5, seed=7)
    grpc_vectors = vectors(service.stub.Embed(pb.EmbedRequest(texts=inputs), timeout=120))
    grpc_rerank = service.stub.Rerank(pb.RerankRequest(query=inputs[0], documents=inputs[1:]), timeout=120)
    with Gateway(f"127.0.0.1:{service.port}") as gateway:
        client = openai.OpenAI(base_url=f"{gateway.url}/v1", api_key="unused")
        name = client.models.list().data[0].id
        for encoding_format in (openai.NOT_GIVEN, "float"):  # not given: the SDK asks for base64 and decodes it
            reply = client.embeddings.create(input=inputs, model=name, encoding_format=encoding_format)
            assert_same([d.embedding for d in reply.data], grpc_vectors)
        packed = client.embeddings.create(input=inputs, model=name, encoding_format="base64")
        decoded = [np.frombuffer(base64.b64decode(d.embedding), dtype="<f4") for d in packed.data]
        assert_same(decoded, grpc_vectors)
        assert reply.usage.prompt_tokens == reply.usage.total_tokens > 0
        cut = vectors(service.stub.Embed(pb.EmbedRequest(texts=inputs[:1], dimensions=8), timeout=120))
        one = client.embeddings.create(input=inputs[0], model=name, dimensions=8)
        assert len(one.data) == 1
        assert_same(one.data[0].embedding, cut[0])
        with pytest.raises(openai.BadRequestError) as err:
            client.embeddings.create(input=[inputs[0], ""], model=name)
        assert err.value.body["param"] == "input" and "texts[1]" in err.value.body["message"]
        with pytest.raises(openai.BadRequestError) as err:
            client.embeddings.create(input=inputs[0], model=name, dimensions=5)
        assert err.value.body["param"] == "dimensions"

        body = httpx.post(f"{gateway.url}/v1/rerank", json={"query": inputs[0], "documents": inputs[1:]}, timeout=60)
        assert body.status_code == 200, body.text
        results = body.json()["results"]
        assert [r["index"] for r in results] == [r.index for r in grpc_rerank.results]
        assert_same([r["relevance_score"] for r in results], [r.relevance_score for r in grpc_rerank.results])
        assert [r["document"]["text"] for r in results] == [inputs[1:][r.index] for r in grpc_rerank.results]
        score = httpx.post(f"{gateway.url}/v1/score", json={"text_1": inputs[0], "text_2": inputs[1:]}, timeout=60).json()
        by_index = {r.index: r.relevance_score for r in grpc_rerank.results}
        assert [d["index"] for d in score["data"]] == list(range(len(inputs) - 1))
        assert_same([d["score"] for d in score["data"]], [by_index[i] for i in range(len(inputs) - 1)])
        bad = httpx.post(f"{gateway.url}/v1/rerank", json={"query": "", "documents": ["a"]}, timeout=60)
        assert bad.status_code == 400 and bad.json()["error"]["param"] == "query"


def _bad_embeds(max_model_len: int) -> list[tuple[str, pb.EmbedRequest]]:
    long_text = " ".join(["river"] * (max_model_len + 5))
    return [
        ("texts", pb.EmbedRequest()),
        ("texts[1]", pb.EmbedRequest(texts=["a cat", ""])),
        ("texts", pb.EmbedRequest(texts=["a"] * 2049)),
        ("texts[0]", pb.EmbedRequest(texts=[long_text])),
        ("texts", pb.EmbedRequest(texts=["a"], token_ids=[pb.TokenIds(ids=[2, 3])])),
        ("token_ids[0].ids", pb.EmbedRequest(token_ids=[pb.TokenIds()])),
        ("token_ids[0].ids[1]", pb.EmbedRequest(token_ids=[pb.TokenIds(ids=[2, 10**6])])),
        ("dimensions", pb.EmbedRequest(texts=["a"], dimensions=5)),
        ("dimensions", pb.EmbedRequest(texts=["a"], dimensions=0)),
        ("truncate_prompt_tokens", pb.EmbedRequest(texts=["a"], truncate_prompt_tokens=max_model_len + 1)),
        ("request_id", pb.EmbedRequest(texts=["a"], request_id="x" * 257)),
    ]


def test_bad_inputs_name_the_field_and_the_service_keeps_serving(service, reference):
    max_model_len = service.stub.GetModelInfo(pb.GetModelInfoRequest(), timeout=30).max_model_len
    before = vectors(service.stub.Embed(pb.EmbedRequest(texts=["a cat"]), timeout=60))
    for field, req in _bad_embeds(max_model_len):
        with pytest.raises(grpc.RpcError) as err:
            service.stub.Embed(req, timeout=30)
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT, (field, err.value.details())
        assert err.value.details().startswith(field + ":"), (field, err.value.details())
    for field, req in [("query", pb.RerankRequest(documents=["a"])), ("documents", pb.RerankRequest(query="a")),
                       ("documents[1]", pb.RerankRequest(query="a", documents=["b", ""]))]:
        with pytest.raises(grpc.RpcError) as err:
            service.stub.Rerank(req, timeout=30)
        assert err.value.details().startswith(field + ":"), (field, err.value.details())
    with pytest.raises(grpc.RpcError) as err:  # a pooling model generates nothing
        list(service.stub.Generate(pb.GenerateRequest(text="hello"), timeout=30))
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and err.value.details().startswith("model:")
    raw = pb.EmbedRequest(texts=["ok", "XX"]).SerializeToString().replace(b"XX", b"\xff\xfe")
    with pytest.raises(grpc.RpcError) as err:
        service.channel.unary_unary("/pagoda.v1.Generation/Embed")(raw, timeout=30)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and err.value.details().startswith("texts[1]:")
    # truncate_prompt_tokens cuts a text too long for the model, as the tokenizer truncates
    long_text = " ".join(["river"] * (max_model_len + 5))
    cut = service.stub.Embed(pb.EmbedRequest(texts=[long_text], truncate_prompt_tokens=20), timeout=60)
    assert cut.usage.prompt_tokens == 20
    pooling_models.assert_vectors_equal(vectors(cut), reference.encode([" ".join(["river"] * 18)]))
    after = vectors(service.stub.Embed(pb.EmbedRequest(texts=["a cat"]), timeout=60))
    assert_same(before, after)
    info = service.wait_all_blocks_free()
    assert info.num_running == 0 and info.num_waiting == 0


def test_a_cancelled_call_drops_its_inputs(service):
    # the most inputs a request may carry (2,048), a third of them ~100 tokens: seconds of work on any machine,
    # so the 0.3 s deadline always comes first (240 short ones were answered in time on a quiet machine)
    inputs = [text for seed in range(171) for text in pooling_models.texts(seed=200 + seed)][:2048]
    with pytest.raises(grpc.RpcError) as err:
        service.stub.Embed(pb.EmbedRequest(texts=inputs, request_id="short-deadline"), timeout=0.3)
    assert err.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    info = service.wait_all_blocks_free()  # the inputs still queued or running are dropped, not run
    assert info.num_running == 0 and info.num_waiting == 0
    reply = service.stub.Embed(pb.EmbedRequest(texts=inputs[:2], request_id="short-deadline"), timeout=60)
    assert len(reply.embeddings) == 2  # the id is free again


def test_an_executor_killed_mid_batch_leaves_its_inputs_to_the_other(service, reference):
    """Last in this module: it leaves the service one executor."""
    inputs = [text for seed in range(40) for text in pooling_models.texts(seed=100 + seed)]  # 480 texts, 1-100 tokens
    expected = reference.encode(inputs)
    victim = service.executors[0]
    outcome: dict = {}

    def call():
        try:
            outcome["reply"] = service.stub.Embed(pb.EmbedRequest(texts=inputs), timeout=300)
        except grpc.RpcError as exc:
            outcome["error"] = exc

    thread = threading.Thread(target=call)
    thread.start()
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:  # both executors hold some of the batch
        executors = service.server_info().executors
        if len(executors) == 2 and all(e.num_running for e in executors):
            break
        time.sleep(0.01)
    victim.send_signal(signal.SIGKILL)
    thread.join(300)
    assert "error" not in outcome, outcome.get("error")
    pooling_models.assert_vectors_equal(vectors(outcome["reply"]), expected)
    assert "moving its requests" in (service.logdir / "scheduler.log").read_text()  # it died holding some
    info = service.wait_all_blocks_free()
    assert len(info.executors) == 1 and info.num_running == 0 and info.num_waiting == 0
