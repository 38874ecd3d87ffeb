"""The pooling runner against sentence-transformers on the same tiny random folders (issue 39).

Each folder is made here: a random transformers model (hidden 32, 2 layers; every 1-D weight
moved off its initial value) with a tiny local WordPiece tokenizer, wrapped and saved by
sentence-transformers (`SentenceTransformer(modules=[...]).save`, or a cross-encoder's
`*ForSequenceClassification` folder). The runner gets the token ids sentence-transformers'
tokenizer gives, in one batch that mixes short and long texts; its vectors must equal
`SentenceTransformer.encode` (cosine >= 0.9999, largest difference <= 1e-4, float32) and its
scores `CrossEncoder.predict`.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

import numpy as np
import pytest
import torch

from pagoda.v1 import executor_pb2 as pb

st = pytest.importorskip("sentence_transformers")

WORDS = ["the", "a", "cat", "dog", "runs", "fast", "slow", "blue", "red", "house", "tree", "and", "of", "river",
         "stone", "light", "over", "under", "green", "bird", "sings", "night", "day", "water"]
SPECIAL_BERT = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]
SPECIAL_XLMR = ["[CLS]", "[PAD]", "[SEP]", "[UNK]", "[MASK]"]  # XLM-R's order: <s>, <pad> (1), </s>, <unk>
HIDDEN = 32
MAX_POSITIONS = 160


def texts(n: int = 12, seed: int = 0) -> list[str]:
    """Short and long texts mixed (1 to ~110 tokens)."""
    rng = random.Random(seed)
    lengths = [1, 2, 100, 3, 60, 7, 1, 25, 90, 4, 40, 15][:n]
    return [" ".join(rng.choice(WORDS) for _ in range(k)) for k in lengths]


def tokenizer(folder: Path, specials: list[str]):
    """A WordPiece tokenizer of `specials` + WORDS + the letters, made here (no hub)."""
    from transformers import BertTokenizer

    vocab = {token: i for i, token in enumerate(specials + WORDS + [chr(c) for c in range(97, 123)])}
    # XLM-R's tokenizer gives no token types (its model has one)
    names = ["input_ids", "attention_mask"] if specials is SPECIAL_XLMR else ["input_ids", "token_type_ids", "attention_mask"]
    tok = BertTokenizer(vocab=vocab, model_max_length=MAX_POSITIONS - 8, model_input_names=names)
    assert len(tok) == len(vocab) and tok.unk_token_id not in tok(" ".join(WORDS))["input_ids"]
    return tok


def perturb(model, seed: int):
    torch.manual_seed(seed)
    with torch.no_grad():
        for param in model.parameters():
            if param.ndim == 1:
                param.add_(torch.randn_like(param) * 0.3)
    return model


def encoder_folder(root: Path, kind: str, head: int = 0, seed: int = 0) -> Path:
    """A random BERT / XLM-RoBERTa folder (a *ForSequenceClassification one with `head` labels)."""
    import transformers as T

    folder = root / f"{kind}-{head}-{seed}"
    tok = tokenizer(root / f"tok-{kind}", SPECIAL_XLMR if kind == "xlm-roberta" else SPECIAL_BERT)
    common = dict(vocab_size=len(tok), hidden_size=HIDDEN, num_hidden_layers=2, num_attention_heads=4,
                  intermediate_size=64, initializer_range=0.2)
    if kind == "bert":
        config = T.BertConfig(**common, max_position_embeddings=MAX_POSITIONS, type_vocab_size=2)
        cls = T.BertForSequenceClassification if head else T.BertModel
    else:
        # positions after the padding index 1, as XLM-R's own: 1 + 1 + MAX_POSITIONS
        config = T.XLMRobertaConfig(**common, max_position_embeddings=MAX_POSITIONS + 2, type_vocab_size=1,
                                    pad_token_id=1, bos_token_id=0, eos_token_id=2)
        cls = T.XLMRobertaForSequenceClassification if head else T.XLMRobertaModel
    if head:
        config.num_labels = head
    torch.manual_seed(seed)
    perturb(cls(config), seed).save_pretrained(folder)
    tok.save_pretrained(folder)
    return folder


def qwen3_folder(root: Path, bare: bool = False, seed: int = 0) -> Path:
    import transformers as T

    folder = root / f"qwen3-{bare}-{seed}"
    tok = tokenizer(root / "tok-qwen3", SPECIAL_BERT)
    config = T.Qwen3Config(vocab_size=len(tok), hidden_size=HIDDEN, intermediate_size=64, num_hidden_layers=2,
                           num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=MAX_POSITIONS,
                           initializer_range=0.2, tie_word_embeddings=True, pad_token_id=0)
    torch.manual_seed(seed)
    perturb((T.Qwen3Model if bare else T.Qwen3ForCausalLM)(config), seed).save_pretrained(folder)
    tok.save_pretrained(folder)
    return folder


def st_folder(model: Path, mode: str, normalize: bool, config_changes: dict | None = None) -> Path:
    from sentence_transformers import SentenceTransformer
    from sentence_transformers.sentence_transformer import modules as models

    modules = [models.Transformer(str(model)), models.Pooling(HIDDEN, pooling_mode=mode)]
    if normalize:
        modules.append(models.Normalize())
    out = model.parent / f"st-{model.name}-{mode}-{normalize}"
    SentenceTransformer(modules=modules, device="cpu").save(str(out))
    if config_changes:
        config = json.loads((out / "config.json").read_text())
        (out / "config.json").write_text(json.dumps({**config, **config_changes}))
    return out


def pool_requests(tok, inputs, task=pb.POOL_TASK_EMBED, normalize=False, dimensions=0) -> list[pb.PoolRequest]:
    requests = []
    for i, text in enumerate(inputs):
        enc = tok(*text) if isinstance(text, tuple) else tok(text)
        requests.append(pb.PoolRequest(req_id=f"r{i}", token_ids=enc["input_ids"], token_type_ids=enc.get("token_type_ids", []),
                                       task=task, normalize=normalize, dimensions=dimensions))
    return requests


def assert_vectors_equal(ours, reference):
    ours = np.asarray(ours, dtype=np.float32)
    reference = np.asarray(reference, dtype=np.float32)
    assert ours.shape == reference.shape
    cosine = (ours * reference).sum(-1) / (np.linalg.norm(ours, axis=-1) * np.linalg.norm(reference, axis=-1))
    assert cosine.min() >= 0.9999, cosine
    assert np.abs(ours - reference).max() <= 1e-4, np.abs(ours - reference).max()


@pytest.fixture(scope="module")
def root(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("pooling")


CASES = [("bert", "mean", True), ("bert", "cls", False), ("xlm-roberta", "mean", True), ("xlm-roberta", "cls", False),
         ("qwen3", "lasttoken", True), ("qwen3", "mean", False)]


@pytest.mark.parametrize("kind,mode,normalize", CASES)
def test_embeddings_equal_sentence_transformers(root, kind, mode, normalize):
    from sentence_transformers import SentenceTransformer

    from executor_svc.pooling import PoolingRunner

    model = qwen3_folder(root) if kind == "qwen3" else encoder_folder(root, kind)
    folder = st_folder(model, mode, normalize)
    reference = SentenceTransformer(str(folder), device="cpu")
    inputs = texts()
    expected = reference.encode(inputs, batch_size=4, convert_to_numpy=True)
    runner = PoolingRunner(folder, dtype="float32")
    assert (runner.spec.pooling_mode, runner.spec.normalize) == (mode, normalize)
    out = runner.run(pool_requests(reference.tokenizer, inputs, normalize=runner.spec.normalize))
    assert_vectors_equal(out, expected)


def test_bare_encoder_and_decoder_folders_mean_pool(root):
    """A folder without modules.json: sentence-transformers' default (mean, no Normalize)."""
    from sentence_transformers import SentenceTransformer

    from executor_svc.pooling import PoolingRunner

    inputs = texts(seed=1)
    for folder in (encoder_folder(root, "bert", seed=3), qwen3_folder(root, bare=True)):
        reference = SentenceTransformer(str(folder), device="cpu")
        runner = PoolingRunner(folder, dtype="float32")
        assert runner.spec.pooling_mode == "mean" and not runner.spec.normalize
        assert_vectors_equal(runner.run(pool_requests(reference.tokenizer, inputs)), reference.encode(inputs))


@pytest.mark.parametrize("kind,labels", [("bert", 1), ("bert", 3), ("xlm-roberta", 1)])
def test_scores_equal_cross_encoder(root, kind, labels):
    from sentence_transformers import CrossEncoder

    from executor_svc.pooling import PoolingRunner

    folder = encoder_folder(root, kind, head=labels)
    reference = CrossEncoder(str(folder), device="cpu")
    inputs = texts(seed=2)
    pairs = [(inputs[i], inputs[-1 - i]) for i in range(len(inputs))]
    expected = reference.predict(pairs, batch_size=4, convert_to_numpy=True)
    runner = PoolingRunner(folder, dtype="float32")
    assert (runner.spec.task, runner.spec.num_labels) == ("classify", labels)
    assert runner.spec.activation == ("sigmoid" if labels == 1 else "identity")
    requests = pool_requests(reference.tokenizer, pairs, task=pb.POOL_TASK_CLASSIFY)
    if kind == "bert":
        assert any(1 in r.token_type_ids for r in requests)  # the pair's second text: segment 1
    out = np.asarray(runner.run(requests), dtype=np.float32)
    expected = np.asarray(expected, dtype=np.float32).reshape(len(pairs), labels)
    assert np.abs(out - expected).max() <= 1e-4, np.abs(out - expected).max()


def test_matryoshka_truncation_equals_truncate_dim(root):
    from sentence_transformers import SentenceTransformer

    from executor_svc.pooling import PoolingRunner

    folder = st_folder(encoder_folder(root, "bert", seed=5), "mean", True, {"matryoshka_dimensions": [8, 16, HIDDEN]})
    inputs = texts(seed=4)
    runner = PoolingRunner(folder, dtype="float32")
    reference = SentenceTransformer(str(folder), device="cpu", truncate_dim=16)
    expected = reference.encode(inputs, normalize_embeddings=True)
    out = runner.run(pool_requests(reference.tokenizer, inputs, normalize=True, dimensions=16))
    assert_vectors_equal(out, expected)
    assert all(abs(np.linalg.norm(v) - 1) < 1e-5 for v in out)
    # unnormalized: the first 16 of the whole vector
    whole = runner.run(pool_requests(reference.tokenizer, inputs[:3], normalize=False))
    cut = runner.run(pool_requests(reference.tokenizer, inputs[:3], normalize=False, dimensions=8))
    assert np.allclose(np.asarray(whole)[:, :8], cut, atol=1e-6)


def test_bad_requests_fail_alone(root):
    from sentence_transformers import SentenceTransformer

    from executor_svc.pooling import PoolingRunner

    folder = st_folder(encoder_folder(root, "bert", seed=6), "cls", True)
    reference = SentenceTransformer(str(folder), device="cpu")
    runner = PoolingRunner(folder, dtype="float32")
    runner.max_batch_tokens = 40  # the step's inputs in several batches (the 100-token text alone)
    good = pool_requests(reference.tokenizer, texts(6, seed=7), normalize=True)
    bad = [
        pb.PoolRequest(req_id="empty", task=pb.POOL_TASK_EMBED),
        pb.PoolRequest(req_id="long", token_ids=[5] * (runner.max_model_len + 1), task=pb.POOL_TASK_EMBED),
        pb.PoolRequest(req_id="vocab", token_ids=[2, 10_000, 3], task=pb.POOL_TASK_EMBED),
        pb.PoolRequest(req_id="types", token_ids=[2, 5, 3], token_type_ids=[0, 0], task=pb.POOL_TASK_EMBED),
        pb.PoolRequest(req_id="task", token_ids=[2, 5, 3], task=pb.POOL_TASK_CLASSIFY),
        pb.PoolRequest(req_id="dims", token_ids=[2, 5, 3], task=pb.POOL_TASK_EMBED, dimensions=8),
    ]
    plan = pb.StepPlan(step_id=7, pool_requests=[good[0], *bad, *good[1:]])
    result = runner.execute_proto(plan)
    assert result.step_id == 7 and not result.error
    errors = {e.req_id: e.message for e in result.errors}
    assert set(errors) == {r.req_id for r in bad}
    assert errors["empty"].startswith("token_ids:") and errors["long"].startswith("token_ids:")
    assert errors["vocab"].startswith("token_ids:") and errors["types"].startswith("token_type_ids:")
    assert errors["task"].startswith("task:") and errors["dims"].startswith("dimensions:")
    assert [p.req_id for p in result.pooled] == [r.req_id for r in good]
    expected = reference.encode(texts(6, seed=7))
    assert_vectors_equal([list(p.values) for p in result.pooled], expected)


def test_worker_answers_pool_requests(root):
    """The worker's step path for a pooling runner: StepResult.pooled, the failures in errors."""
    from sentence_transformers import SentenceTransformer

    from executor_svc.pooling import PoolingRunner
    from executor_svc.worker import Worker, WorkerConfig

    folder = st_folder(encoder_folder(root, "xlm-roberta", seed=8), "mean", False)
    reference = SentenceTransformer(str(folder), device="cpu")
    runner = PoolingRunner(folder, dtype="float32")
    worker = Worker(WorkerConfig(scheduler="tcp://127.0.0.1:9"), lambda config: runner, runner.fingerprint)
    try:
        worker._runner = runner
        requests = pool_requests(reference.tokenizer, texts(4, seed=9))
        requests.append(pb.PoolRequest(req_id="empty", task=pb.POOL_TASK_EMBED))
        result = worker._execute(pb.StepPlan(step_id=3, pool_requests=requests))
        assert not result.error and [e.req_id for e in result.errors] == ["empty"]
        assert_vectors_equal([list(p.values) for p in result.pooled], reference.encode(texts(4, seed=9)))
        register = worker._register_message()
        assert (register.runner, register.num_kv_blocks, register.vocab_size) == ("pooling", 2, runner.vocab_size)
        # a scheduler with --enable-lora: the adapter is refused by name, the executor keeps serving
        status = worker._lora(pb.SchedulerMessage(load_lora=pb.LoadLora(name="sql", config_json=b"{}", weights=b"")))
        assert status.name == "sql" and "pooling runner applies no LoRA adapters" in status.error
    finally:
        worker._sock.disable_monitor()
        worker._monitor.close(0)
        worker._sock.close(0)
        worker._ctx.term()


def test_runner_flag_resolution(root):
    import argparse

    from executor_svc.__main__ import _runner_kind
    from pagoda.cli import StartupError

    folder = st_folder(encoder_folder(root, "bert", seed=10), "cls", True)
    args = lambda runner: argparse.Namespace(runner=runner, tensor_parallel_size=1)  # noqa: E731
    assert _runner_kind(args("auto"), folder) == "pooling"
    assert _runner_kind(args("pooling"), folder) == "pooling"
    with pytest.raises(StartupError, match="--runner: generate: BertModel has no language-model head"):
        _runner_kind(args("generate"), folder)
    with pytest.raises(StartupError, match="--runner: pooling: no tensor parallelism"):
        _runner_kind(argparse.Namespace(runner="pooling", tensor_parallel_size=2), folder)


def test_executor_process_registers_pooling_and_answers_a_plan(root):
    """`python -m executor_svc --runner auto` on a sentence-transformers folder, against a stand-in
    scheduler: Register.runner "pooling" with 2 KV blocks, then a plan's pool_requests answered."""
    import os
    import subprocess
    import sys
    import time

    import zmq
    from sentence_transformers import SentenceTransformer

    from tests.service.harness import ROOT

    folder = st_folder(encoder_folder(root, "bert", seed=11), "mean", True)
    reference = SentenceTransformer(str(folder), device="cpu")
    inputs = texts(5, seed=12)
    ctx = zmq.Context()
    sock = ctx.socket(zmq.ROUTER)
    port = sock.bind_to_random_port("tcp://127.0.0.1")
    env = {**os.environ, "PAGODA_RUNNER": "auto"}
    proc = subprocess.Popen([sys.executable, "-m", "executor_svc", "--model", str(folder), "--device", "cpu",
                             "--scheduler", f"tcp://127.0.0.1:{port}", "--insecure-executor-link", "--num-threads", "1"],
                            cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)

    def receive(kind: str, timeout_s: float = 120.0):
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if not sock.poll(500):
                assert proc.poll() is None, proc.stderr.read()
                continue
            identity, data = sock.recv_multipart()
            msg = pb.ExecutorMessage.FromString(data)
            if msg.WhichOneof("kind") == kind:
                return identity, getattr(msg, kind)
        pytest.fail(f"no {kind} from the executor")

    def send(identity, **kind):
        sock.send_multipart([identity, pb.SchedulerMessage(**kind).SerializeToString()])

    try:
        identity, _ = receive("hello")
        send(identity, config=pb.ExecutorConfig(block_size=16, max_num_batched_tokens=2048))
        identity, register = receive("register")
        assert (register.runner, register.num_kv_blocks, register.block_size) == ("pooling", 2, 16)
        send(identity, registered=pb.Registered())
        requests = pool_requests(reference.tokenizer, inputs, normalize=True)
        send(identity, step_plan=pb.StepPlan(step_id=1, pool_requests=requests))
        _, result = receive("step_result")
        assert result.step_id == 1 and not result.error and not result.errors
        assert_vectors_equal([list(p.values) for p in result.pooled], reference.encode(inputs))
        send(identity, shutdown=pb.Shutdown(reason="test over"))
        assert proc.wait(timeout=30) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        sock.close(0)
        ctx.term()
