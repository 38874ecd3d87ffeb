"""The scheduler's side of Embed and Rerank, against sentence-transformers on tiny random folders
(issue 39), with the pooling runner in-process instead of a service: a cross-encoder's pairs are
tokenized as `CrossEncoder` tokenizes them (token types included), and the runner's scores of
those inputs, ranked by `rerank_response`, are `CrossEncoder.predict`'s, best first; texts get
the folder's default prompt as `SentenceTransformer.encode` gives it. (The service itself:
tests/service/test_pooling_serving.py.)
"""

from __future__ import annotations

import json

import numpy as np
import pytest

from pagoda.pooling_files import read_pooling_spec
from pagoda.step import PoolRequest, PoolTask
from pagoda.v1 import generation_pb2 as pb
from scheduler_svc.errors import InvalidArgument
from scheduler_svc.pooling_requests import PoolingFrontEnd
from scheduler_svc.tokenizer import load_tokenizer, read_model_spec

st = pytest.importorskip("sentence_transformers")
pooling_models = pytest.importorskip("tests.executor.test_pooling")


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    return tmp_path_factory.mktemp("pooling-requests")


def front_end(folder) -> PoolingFrontEnd:
    spec = read_pooling_spec(folder)
    tokenizer = load_tokenizer(folder)
    return PoolingFrontEnd(tokenizer, spec, spec.max_model_len, read_model_spec(folder, tokenizer).vocab_size)


def run(folder, params) -> list[list[float]]:
    from executor_svc.pooling import PoolingRunner

    runner = PoolingRunner(folder, dtype="float32")
    requests = [PoolRequest(str(i), item.token_ids, params.task, item.token_type_ids, params.normalize, params.dimensions)
                for i, item in enumerate(params.inputs)]
    return runner.run(requests)


def test_rerank_equals_cross_encoder_predict_best_first(root):
    folder = pooling_models.encoder_folder(root, "bert", head=1, seed=21)
    reference = st.CrossEncoder(str(folder), device="cpu")
    query, documents = "the cat runs fast", pooling_models.texts(seed=9)
    front = front_end(folder)
    req = pb.RerankRequest(query=query, documents=documents, top_n=5)
    params = front.rerank_params(req)
    assert params.task is PoolTask.CLASSIFY
    for item, document in zip(params.inputs, documents, strict=True):
        expected = reference.tokenizer(query, document)
        assert item.token_ids == expected["input_ids"] and item.token_type_ids == expected["token_type_ids"]
    assert any(1 in item.token_type_ids for item in params.inputs)
    reply = front.rerank_response(req, params, run(folder, params))
    scores = reference.predict([(query, d) for d in documents])
    assert [r.index for r in reply.results] == list(np.argsort(-scores, kind="stable")[:5])
    assert max(abs(r.relevance_score - scores[r.index]) for r in reply.results) <= 1e-4
    assert reply.usage.prompt_tokens == sum(len(i.token_ids) for i in params.inputs)


def test_a_cross_encoder_does_not_embed_and_rerank_needs_one_label(root):
    with pytest.raises(InvalidArgument, match="^model: .*cross-encoder"):
        front_end(pooling_models.encoder_folder(root, "bert", head=1, seed=22)).embed_params(pb.EmbedRequest(texts=["a"]))
    with pytest.raises(InvalidArgument, match="^model: .*3 labels"):
        front_end(pooling_models.encoder_folder(root, "bert", head=3, seed=23)).rerank_params(
            pb.RerankRequest(query="a", documents=["b"]))


def test_texts_get_the_folders_default_prompt(root):
    folder = pooling_models.st_folder(pooling_models.encoder_folder(root, "bert", seed=24), "cls", True)
    config = json.loads((folder / "config_sentence_transformers.json").read_text())
    config.update(prompts={"query": "the river ", "document": ""}, default_prompt_name="query")
    (folder / "config_sentence_transformers.json").write_text(json.dumps(config))
    reference = st.SentenceTransformer(str(folder), device="cpu")
    inputs = pooling_models.texts(n=4, seed=2)
    params = front_end(folder).embed_params(pb.EmbedRequest(texts=inputs))
    assert [i.token_ids for i in params.inputs] == reference.tokenizer(["the river " + t for t in inputs])["input_ids"]
    assert params.normalize
    pooling_models.assert_vectors_equal(run(folder, params), reference.encode(inputs))
