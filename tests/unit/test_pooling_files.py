"""pagoda.pooling_files: a pooling model's folder read without torch (the files sentence-transformers
6.3 writes; tests/executor/test_pooling.py checks the numbers against sentence-transformers itself)."""

from __future__ import annotations

import json
import sys

import pytest

from pagoda.pooling_files import PoolingError, read_pooling_spec, resolve_runner

BERT = dict(architectures=["BertModel"], model_type="bert", hidden_size=32, max_position_embeddings=128)


def write(folder, files: dict):
    for name, content in files.items():
        path = folder / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(content))
    return folder


def st_folder(folder, config=BERT, mode="cls", normalize=True, pooling=None, **extra):
    modules = [dict(idx=0, name="0", path="", type="sentence_transformers.base.modules.transformer.Transformer"),
               dict(idx=1, name="1", path="1_Pooling", type="sentence_transformers.sentence_transformer.modules.pooling.Pooling")]
    if normalize:
        modules.append(dict(idx=2, name="2", path="2_Normalize", type="sentence_transformers.base.modules.normalize.Normalize"))
    files = {"config.json": config, "modules.json": modules,
             "1_Pooling/config.json": pooling or dict(embedding_dimension=config["hidden_size"], pooling_mode=mode, include_prompt=True),
             "sentence_bert_config.json": dict(transformer_task="feature-extraction")}
    files.update(extra)
    return write(folder, files)


def test_st_folder_modes_prompts_and_normalize(tmp_path):
    st_config = dict(prompts={"query": "query: ", "document": ""}, default_prompt_name="query")
    spec = read_pooling_spec(st_folder(tmp_path, **{"config_sentence_transformers.json": st_config}))
    assert (spec.task, spec.pooling_mode, spec.normalize, spec.hidden_size) == ("embed", "cls", True, 32)
    assert spec.prompts == {"query": "query: ", "document": ""} and spec.default_prompt_name == "query"
    assert spec.max_model_len == 128 and spec.matryoshka_dimensions is None and not spec.is_matryoshka
    for mode in ("mean", "lasttoken"):
        folder = tmp_path / mode
        assert read_pooling_spec(st_folder(folder, mode=mode, normalize=False)).pooling_mode == mode
        assert not read_pooling_spec(folder).normalize


def test_legacy_pooling_keys_and_max_length(tmp_path):
    pooling = dict(word_embedding_dimension=32, pooling_mode_cls_token=False, pooling_mode_mean_tokens=True)
    spec = read_pooling_spec(st_folder(tmp_path, pooling=pooling, **{"sentence_bert_config.json": dict(max_seq_length=64)}))
    assert spec.pooling_mode == "mean" and spec.max_model_len == 64
    write(tmp_path, {"sentence_bert_config.json": {}, "tokenizer_config.json": dict(model_max_length=100)})
    assert read_pooling_spec(tmp_path).max_model_len == 100
    write(tmp_path, {"tokenizer_config.json": dict(model_max_length=int(1e30))})  # transformers' "no limit"
    assert read_pooling_spec(tmp_path).max_model_len == 128


@pytest.mark.parametrize("pooling,field", [
    (dict(pooling_mode="max"), "1_Pooling/config.json pooling_mode"),
    (dict(pooling_mode="weightedmean"), "1_Pooling/config.json pooling_mode"),
    (dict(pooling_mode=["cls", "mean"]), "1_Pooling/config.json pooling_mode"),
    (dict(pooling_mode_max_tokens=True), "1_Pooling/config.json pooling_mode"),
    (dict(pooling_mode="mean", include_prompt=False), "1_Pooling/config.json include_prompt"),
])
def test_unsupported_pooling_named(tmp_path, pooling, field):
    with pytest.raises(PoolingError) as err:
        read_pooling_spec(st_folder(tmp_path, pooling=pooling))
    assert err.value.field == field and field in str(err.value)


def test_unsupported_modules_named(tmp_path):
    st_folder(tmp_path)
    modules = json.loads((tmp_path / "modules.json").read_text())
    modules.insert(2, dict(idx=2, name="2", path="2_Dense", type="sentence_transformers.base.modules.dense.Dense"))
    write(tmp_path, {"modules.json": modules})
    with pytest.raises(PoolingError, match="modules.json: .*Dense"):
        read_pooling_spec(tmp_path)


def test_matryoshka(tmp_path):
    spec = read_pooling_spec(st_folder(tmp_path, config=dict(BERT, matryoshka_dimensions=[8, 16, 32])))
    assert spec.matryoshka_dimensions == (8, 16, 32) and spec.is_matryoshka
    spec.check_dimensions(16)
    spec.check_dimensions(0)
    with pytest.raises(PoolingError, match="dimensions: 12 is not one of"):
        spec.check_dimensions(12)
    spec = read_pooling_spec(st_folder(tmp_path / "any", config=dict(BERT, is_matryoshka=True)))
    spec.check_dimensions(5)
    with pytest.raises(PoolingError, match="dimensions: 33 is out of range 1..32"):
        spec.check_dimensions(33)
    spec = read_pooling_spec(st_folder(tmp_path / "none"))
    with pytest.raises(PoolingError, match="dimensions: the model declares no Matryoshka"):
        spec.check_dimensions(16)
    with pytest.raises(PoolingError, match="config.json matryoshka_dimensions"):
        read_pooling_spec(st_folder(tmp_path / "bad", config=dict(BERT, matryoshka_dimensions=[8, 64])))


def classifier(folder, num_labels, model_type="bert", **files):
    arch = {"bert": "BertForSequenceClassification", "xlm-roberta": "XLMRobertaForSequenceClassification"}[model_type]
    config = dict(BERT, architectures=[arch], model_type=model_type,
                  id2label={str(i): f"LABEL_{i}" for i in range(num_labels)}, max_position_embeddings=514, pad_token_id=1)
    return write(folder, {"config.json": config, **files})


def test_cross_encoder_activation_rule(tmp_path):
    # CrossEncoder's rule: the saved activation_fn (config_sentence_transformers.json, then
    # config.json's), else a sigmoid for one label and none for several
    one = read_pooling_spec(classifier(tmp_path / "one", 1))
    assert (one.task, one.num_labels, one.activation) == ("classify", 1, "sigmoid")
    three = read_pooling_spec(classifier(tmp_path / "three", 3, model_type="xlm-roberta"))
    assert (three.num_labels, three.activation, three.max_model_len) == (3, "identity", 512)  # 514 - (pad 1 + 1)
    saved = {"config_sentence_transformers.json": dict(activation_fn="torch.nn.modules.linear.Identity")}
    assert read_pooling_spec(classifier(tmp_path / "saved", 1, **saved)).activation == "identity"
    folder = classifier(tmp_path / "legacy", 1)
    config = json.loads((folder / "config.json").read_text())
    write(folder, {"config.json": dict(config, sbert_ce_default_activation_function="torch.nn.modules.activation.Tanh")})
    assert read_pooling_spec(folder).activation == "tanh"
    untrusted = {"config_sentence_transformers.json": dict(activation_fn="my_package.Scale")}  # CrossEncoder: default
    assert read_pooling_spec(classifier(tmp_path / "untrusted", 1, **untrusted)).activation == "sigmoid"
    unknown = {"config_sentence_transformers.json": dict(activation_fn="torch.nn.modules.activation.GELU")}
    with pytest.raises(PoolingError, match="config_sentence_transformers.json activation_fn: 'torch.nn.modules.activation.GELU'"):
        read_pooling_spec(classifier(tmp_path / "unknown", 1, **unknown))


def test_runner_resolution(tmp_path):
    lm = write(tmp_path / "lm", {"config.json": dict(architectures=["Qwen3ForCausalLM"], model_type="qwen3", hidden_size=32)})
    bare = write(tmp_path / "bare", {"config.json": BERT})
    qwen3_model = write(tmp_path / "q3", {"config.json": dict(architectures=["Qwen3Model"], model_type="qwen3", hidden_size=32,
                                                                max_position_embeddings=64)})
    st_lm = st_folder(tmp_path / "st_lm", config=dict(architectures=["Qwen3ForCausalLM"], model_type="qwen3", hidden_size=32,
                                                       max_position_embeddings=64), mode="lasttoken")
    ce = classifier(tmp_path / "ce", 1)
    assert resolve_runner(lm, "auto") == "generate" and read_pooling_spec(lm) is None
    for folder in (bare, qwen3_model, st_lm, ce):
        assert resolve_runner(folder, "auto") == "pooling"
        assert resolve_runner(folder, "pooling") == "pooling"
    assert read_pooling_spec(bare).pooling_mode == "mean"  # sentence-transformers' default without modules.json
    assert read_pooling_spec(st_lm).pooling_mode == "lasttoken"
    assert resolve_runner(st_lm, "generate") == "generate"  # Qwen3-Embedding's folder still has its LM head
    with pytest.raises(PoolingError, match="--runner: pooling: Qwen3ForCausalLM is a generation model"):
        resolve_runner(lm, "pooling")
    with pytest.raises(PoolingError, match="--runner: generate: BertModel has no language-model head"):
        resolve_runner(bare, "generate")
    with pytest.raises(PoolingError, match="--runner: 'encode'"):
        resolve_runner(bare, "encode")


def test_no_torch_import():
    import subprocess
    code = "import sys, pagoda.pooling_files; assert 'torch' not in sys.modules, 'torch imported'"
    subprocess.run([sys.executable, "-c", code], check=True)
