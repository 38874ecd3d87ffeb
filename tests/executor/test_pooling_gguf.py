"""Pooling models from GGUF files (issue 39), against sentence-transformers on the same weights.

A tiny random sentence-transformers folder (BERT, as `test_pooling` makes them) is written as a
GGUF file with the `gguf` package's `GGUFWriter` in the layout of llama.cpp's
`convert_hf_to_gguf.py` (its keys, tensor names and types, its "phantom space" vocabulary; the
converter itself is not in CI: the layout was compared key by key with its output on the same
folder). The file goes through `pagoda.model_files` (its metadata folder) into the
`PoolingRunner`, whose vectors must equal `SentenceTransformer.encode` on the folder: F32 within
cosine >= 0.9999 and 1e-4, F16 within cosine >= 0.99999, Q8_0 within cosine >= 0.999 (the
weights the file holds are rounded). The tokenizer made from the file must give the folder's
token ids.

XLM-RoBERTa (multilingual E5, bge-m3, the reranker bge-reranker-v2-m3) the same way: a random
XLM-R folder with a SentencePiece-Unigram tokenizer (pieces and scores trained here, a real
precompiled charsmap), written as the converter's `XLMRobertaModel` writes it (compared key by
key and tensor by tensor with the converter's output on such folders: only `general.*` naming
keys differ); its vectors equal `SentenceTransformer.encode`, its reranker's scores
`CrossEncoder.predict`, its ids the folder tokenizer's on multilingual texts.
"""

from __future__ import annotations

import base64
import json
from pathlib import Path

import numpy as np
import pytest
import torch

from pagoda.v1 import executor_pb2 as pb
from tests.executor.test_pooling import HIDDEN, MAX_POSITIONS, SPECIAL_BERT, WORDS, assert_vectors_equal, perturb, \
    pool_requests, st_folder, texts

gguf = pytest.importorskip("gguf")
st = pytest.importorskip("sentence_transformers")

_POOLING = {"mean": 1, "cls": 2, "lasttoken": 3}  # gguf.PoolingType
_FILE_TYPES = {"F32": 0, "F16": 1, "Q8_0": 7}  # gguf.LlamaFileType of the converter's --outtype


def add_special_ids(w, tok, bos: int, eos: int, add_sep: bool) -> None:
    """The special token ids and flags the converter writes for an encoder's tokenizer."""
    w.add_bos_token_id(bos)
    w.add_eos_token_id(eos)
    w.add_unk_token_id(tok.unk_token_id)
    w.add_sep_token_id(tok.sep_token_id)
    w.add_pad_token_id(tok.pad_token_id)
    w.add_mask_token_id(tok.mask_token_id)
    w.add_add_bos_token(True)
    w.add_add_eos_token(True)
    w.add_add_sep_token(add_sep)


def bert_folder(root: Path, seed: int) -> Path:
    """A random BertModel with a WordPiece tokenizer whose ids run 0..n-1 (as the converter checks)."""
    import transformers as T

    pieces = SPECIAL_BERT + WORDS + [chr(c) for c in range(97, 123) if chr(c) not in WORDS] + ["##s", "##er"]
    vocab = {token: i for i, token in enumerate(pieces)}
    tok = T.BertTokenizer(vocab=vocab, model_max_length=MAX_POSITIONS)
    config = T.BertConfig(vocab_size=len(vocab), hidden_size=HIDDEN, num_hidden_layers=2, num_attention_heads=4,
                          intermediate_size=64, initializer_range=0.2, max_position_embeddings=MAX_POSITIONS,
                          type_vocab_size=2)
    torch.manual_seed(seed)
    folder = root / f"gguf-bert-{seed}"
    perturb(T.BertModel(config), seed).save_pretrained(folder)
    tok.save_pretrained(folder)
    return folder


def write_bert_gguf(folder: Path, out: Path, outtype: str = "F32") -> Path:
    """The sentence-transformers BERT folder as llama.cpp's converter writes it with `--outtype`."""
    from safetensors.torch import load_file
    from transformers import AutoConfig, AutoTokenizer

    config = AutoConfig.from_pretrained(folder)
    tok = AutoTokenizer.from_pretrained(folder)
    w = gguf.GGUFWriter(str(out), "bert")
    w.add_type("model")
    w.add_name(folder.name)
    w.add_block_count(config.num_hidden_layers)
    w.add_context_length(config.max_position_embeddings)
    w.add_embedding_length(config.hidden_size)
    w.add_feed_forward_length(config.intermediate_size)
    w.add_head_count(config.num_attention_heads)
    w.add_layer_norm_eps(config.layer_norm_eps)
    w.add_file_type(_FILE_TYPES[outtype])
    w.add_causal_attention(False)
    modules = json.loads((folder / "modules.json").read_text())
    pooling_path = next(m["path"] for m in modules if m["type"].endswith("Pooling"))
    mode = json.loads((folder / pooling_path / "config.json").read_text())["pooling_mode"]
    w.add_pooling_type(gguf.PoolingType(_POOLING[mode]))
    w.add_quantization_version(gguf.GGML_QUANT_VERSION)
    w.add_token_type_count(config.type_vocab_size)
    w.add_tokenizer_model("bert")
    w.add_tokenizer_pre("bert-bge")
    by_id = {i: t for t, i in tok.get_vocab().items()}
    special = set(tok.all_special_ids)
    tokens, types = [], []
    for i in range(config.vocab_size):  # the converter's phantom space: "▁word", a continuation bare
        token = by_id[i]
        if i in special:
            tokens.append(token)
            types.append(gguf.TokenType.CONTROL)
        else:
            tokens.append(token[2:] if token.startswith("##") else "\u2581" + token)
            types.append(gguf.TokenType.NORMAL)
    w.add_token_list(tokens)
    w.add_token_types(types)
    add_special_ids(w, tok, tok.cls_token_id, tok.sep_token_id, add_sep=False)
    w.add_bool("tokenizer.ggml.normalizer.lowercase", True)
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.BERT, config.num_hidden_layers)
    for name, tensor in load_file(str(folder / "model.safetensors")).items():
        name = name.removeprefix("bert.")
        if name.startswith("pooler.") or name.endswith("position_ids"):
            continue  # the converter drops BERT's pooler
        gguf_name = names.get_name(name, try_suffixes=(".weight", ".bias"))
        assert gguf_name is not None, name
        data = tensor.float().numpy()
        # 1-D tensors, positions and token types stay F32 (the converter's rule)
        if outtype == "F32" or data.ndim == 1 or gguf_name.split(".")[0] in ("position_embd", "token_types"):
            w.add_tensor(gguf_name, data)
        else:
            qtype = gguf.GGMLQuantizationType[outtype]
            w.add_tensor(gguf_name, gguf.quants.quantize(data, qtype), raw_dtype=qtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return out


@pytest.fixture(scope="module")
def root(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("pooling-gguf")


@pytest.fixture(autouse=True)
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("PAGODA_CACHE_DIR", str(tmp_path / "cache"))


@pytest.mark.parametrize(("mode", "normalize", "outtype", "cosine"), [
    ("mean", True, "F32", 0.9999), ("cls", False, "F16", 0.99999), ("mean", True, "Q8_0", 0.999)])
def test_bert_gguf_equals_sentence_transformers(root, mode, normalize, outtype, cosine):
    from sentence_transformers import SentenceTransformer
    from transformers import AutoTokenizer

    from executor_svc.pooling import PoolingRunner
    from pagoda import model_files
    from pagoda.pooling_files import resolve_runner

    folder = st_folder(bert_folder(root, seed=len(mode)), mode, normalize)
    path = write_bert_gguf(folder, root / f"{folder.name}-{outtype}.gguf", outtype)
    model_dir = model_files.resolve_model(str(path), weights=False)
    assert resolve_runner(model_dir, "auto") == "pooling"
    inputs = texts()
    reference_tok = AutoTokenizer.from_pretrained(folder)
    tok = AutoTokenizer.from_pretrained(model_dir)
    for text in [*inputs, "The CAT runs, fast!", ("a dog", "the river")]:
        args = text if isinstance(text, tuple) else (text,)
        ours, theirs = tok(*args), reference_tok(*args)
        assert (ours["input_ids"], ours["token_type_ids"]) == (theirs["input_ids"], theirs["token_type_ids"]), text
    runner = PoolingRunner(model_dir)
    # the converter records no Normalize: a GGUF model's default is normalized (as llama.cpp's server)
    assert (runner.spec.pooling_mode, runner.spec.normalize, runner.max_model_len) == (mode, True, MAX_POSITIONS)
    reference = SentenceTransformer(str(folder), device="cpu").encode(inputs, convert_to_numpy=True)
    ours = np.asarray(runner.run(pool_requests(tok, inputs, normalize=normalize)), dtype=np.float32)
    if outtype == "F32":
        assert_vectors_equal(ours, reference)
    else:
        cos = (ours * reference).sum(-1) / (np.linalg.norm(ours, axis=-1) * np.linalg.norm(reference, axis=-1))
        assert cos.min() >= cosine, cos


def test_bert_gguf_refusals(root, tmp_path, monkeypatch):
    """What the runner cannot serve is refused naming the key: pooling NONE, RANK without a
    classifier, a BERT classifier."""
    from pagoda import model_files

    # a cache of its own: the shared one may hold other tests' files being written (CI saw one)
    monkeypatch.setenv("PAGODA_CACHE_DIR", str(tmp_path / "cache"))
    from pagoda.pooling_files import PoolingError

    folder = st_folder(bert_folder(root, seed=7), "mean", False)
    path = write_bert_gguf(folder, root / "refused.gguf")
    reader = gguf.GGUFReader(str(path))
    # the header scan that picks the runner reads the scalars the gguf package reads
    from pagoda.gguf_pooling import _scalar_keys

    scalars = {k: f.contents() for k, f in reader.fields.items()
               if not k.startswith("GGUF.") and f.types[0] != gguf.GGUFValueType.ARRAY}
    assert _scalar_keys(path, lambda key: True) == pytest.approx(scalars)

    def rewrite(name: str, change) -> Path:
        """The file again with `change(writer)` applied to its keys."""
        out = root / name
        w = gguf.GGUFWriter(str(out), "bert")
        for key, field in reader.fields.items():
            if key.startswith("GGUF.") or key == "general.architecture":
                continue
            value = field.contents()
            if key == "bert.pooling_type":
                continue
            vtype = field.types[0]
            sub = field.types[-1] if vtype == gguf.GGUFValueType.ARRAY else None
            w.add_key_value(key, value, vtype, sub_type=sub)
        change(w)
        for t in reader.tensors:
            w.add_tensor(t.name, np.array(t.data), raw_dtype=t.tensor_type)
        w.write_header_to_file()
        w.write_kv_data_to_file()
        w.write_tensors_to_file()
        w.close()
        return out

    none = rewrite("none.gguf", lambda w: w.add_pooling_type(gguf.PoolingType.NONE))
    with pytest.raises(PoolingError, match=r"bert\.pooling_type: NONE"):
        model_files.resolve_model(str(none), weights=False)
    rank = rewrite("rank.gguf", lambda w: w.add_pooling_type(gguf.PoolingType.RANK))
    with pytest.raises(PoolingError, match=r"bert\.pooling_type: RANK .*no classifier"):
        model_files.resolve_model(str(rank), weights=False)
    labels = rewrite("classifier.gguf", lambda w: w.add_classifier_output_labels(["LABEL_0"]))
    with pytest.raises(PoolingError, match=r"bert\.classifier\.output_labels: a BERT classifier"):
        model_files.resolve_model(str(labels), weights=False)
    assert not list(Path(model_files.cache_dir()).glob("*tmp*"))  # nothing half-written is left


def qwen3_folder(root: Path, seed: int = 0) -> Path:
    """A random Qwen3Model with a tiny byte-level BPE tokenizer that appends <|endoftext|>, as
    Qwen3-Embedding's does, wrapped as a last-token, normalized sentence-transformers folder."""
    import transformers as T
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=["<|endoftext|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator([" ".join(WORDS)] * 10, trainer)
    eos = tok.token_to_id("<|endoftext|>")
    tok.post_processor = processors.TemplateProcessing(single="$A:0 <|endoftext|>:0",
                                                       special_tokens=[("<|endoftext|>", eos)])
    fast = T.PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|endoftext|>", pad_token="<|endoftext|>",
                                     model_max_length=MAX_POSITIONS)
    config = T.Qwen3Config(vocab_size=len(fast), hidden_size=HIDDEN, intermediate_size=64, num_hidden_layers=2,
                           num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                           max_position_embeddings=MAX_POSITIONS,
                           initializer_range=0.2, tie_word_embeddings=True, pad_token_id=eos, eos_token_id=eos,
                           bos_token_id=eos)
    torch.manual_seed(seed)
    folder = root / f"gguf-qwen3-{seed}"
    perturb(T.Qwen3Model(config), seed).save_pretrained(folder)
    fast.save_pretrained(folder)
    return st_folder(folder, "lasttoken", True)


def write_qwen3_gguf(folder: Path, out: Path) -> Path:
    """The sentence-transformers Qwen3 folder as llama.cpp's converter writes it (--outtype f32)."""
    from safetensors.torch import load_file
    from transformers import AutoConfig, AutoTokenizer

    config = AutoConfig.from_pretrained(folder)
    tok = AutoTokenizer.from_pretrained(folder)
    w = gguf.GGUFWriter(str(out), "qwen3")
    w.add_type("model")
    w.add_name(folder.name)
    w.add_block_count(config.num_hidden_layers)
    w.add_context_length(config.max_position_embeddings)
    w.add_embedding_length(config.hidden_size)
    w.add_feed_forward_length(config.intermediate_size)
    w.add_head_count(config.num_attention_heads)
    w.add_head_count_kv(config.num_key_value_heads)
    w.add_rope_freq_base(float(config.rope_parameters["rope_theta"]))
    w.add_layer_norm_rms_eps(config.rms_norm_eps)
    w.add_key_length(config.head_dim)
    w.add_value_length(config.head_dim)
    w.add_file_type(0)
    w.add_pooling_type(gguf.PoolingType.LAST)
    w.add_quantization_version(gguf.GGML_QUANT_VERSION)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("qwen2")
    by_id = {i: t for t, i in tok.get_vocab().items()}
    w.add_token_list([by_id[i] for i in range(config.vocab_size)])
    w.add_token_types([gguf.TokenType.CONTROL if i in tok.all_special_ids else gguf.TokenType.NORMAL
                       for i in range(config.vocab_size)])
    merges = json.loads((folder / "tokenizer.json").read_text())["model"]["merges"]
    w.add_token_merges([" ".join(m) if isinstance(m, list) else m for m in merges])
    w.add_eos_token_id(tok.eos_token_id)
    w.add_pad_token_id(tok.pad_token_id)
    w.add_bos_token_id(config.bos_token_id)
    w.add_add_eos_token(True)
    w.add_add_sep_token(False)
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.QWEN3, config.num_hidden_layers)
    for name, tensor in load_file(str(folder / "model.safetensors")).items():
        gguf_name = names.get_name("model." + name.removeprefix("model."), try_suffixes=(".weight", ".bias"))
        assert gguf_name is not None, name
        w.add_tensor(gguf_name, tensor.float().numpy())
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return out


def test_qwen3_embedding_gguf_equals_sentence_transformers(root):
    """A decoder embedding model (Qwen3-Embedding's shape: last token, normalized) as a qwen3 GGUF
    file with qwen3.pooling_type LAST: runner auto pools it, with the folder's vectors."""
    from sentence_transformers import SentenceTransformer
    from transformers import AutoTokenizer

    from executor_svc.pooling import PoolingRunner
    from pagoda import model_files
    from pagoda.pooling_files import resolve_runner

    folder = qwen3_folder(root)
    model_dir = model_files.resolve_model(str(write_qwen3_gguf(folder, root / "qwen3.gguf")), weights=False)
    assert resolve_runner(model_dir, "auto") == "pooling"
    inputs = [" ".join(text.split()[:30]) for text in texts()]  # (a byte-level BPE of few merges: ~5 tokens a word)
    tok, reference_tok = AutoTokenizer.from_pretrained(model_dir), AutoTokenizer.from_pretrained(folder)
    assert [tok(t)["input_ids"] for t in inputs] == [reference_tok(t)["input_ids"] for t in inputs]
    runner = PoolingRunner(model_dir)
    assert (runner.spec.pooling_mode, runner.spec.normalize) == ("lasttoken", True)
    reference = SentenceTransformer(str(folder), device="cpu").encode(inputs, convert_to_numpy=True)
    assert_vectors_equal(runner.run(pool_requests(tok, inputs, normalize=True)), reference)


# SentencePiece's precompiled normalization map (the `precompiled_charsmap` XLM-R's tokenizer
# carries), zlib-compressed: made by sentencepiece 0.2.3's trainer from these rules (its
# `normalization_rule_tsv`; the full nmt_nfkc map is ~240 KB): Ａ->A, ｂ->b, ﬁ->fi, ①->1,
# U+3000->space, E+U+0301->É, Ⅻ->XII, …->..., ｶ->カ, tab->space
XLMR_CHARSMAP = (
    "eNod0wmQl2McB/DfvrOaZco0Y8Y4Soac5d9UzhCFWEaXoxVypM3KmQ6VY3e17EqHzu3ALtrULiGWapfYjcUm5c5Zm1EzRVKUcnze"
    "3pnPfL/zPs+88848vyeyI+LYiIPbRPoUNh+RRNFBEYfpVTKRhRVJVFs/RK9oH9FKltQlUZjNGXFgf1vvKmWOPJRi/XBJHMlTTUkc"
    "LY/CJ6IdHTiGmsYkar+POF4/jhPoyEmcyCmcTCdO5TQ604UMda2TqC9PorveDb8Up3MWZ3IOZ3MuPTif87iAnvTiQi6iN5dwMZfS"
    "h1wu4wou58p0T04S/WRfBtCfqxjINVzNIK7lOvK4nsHcyA3cxBBu4WaGcivDuI3h5FPA7YzgDu7iTu7hbu7jXu5nJKMZxVjGMI4H"
    "mMB4HuJBHuFhitKD51GKKWEij/MYZZQyiSeYzJNMZUp6tkxjBtOZxUzmMJu5lDOfeTzNAp7lGSqp4HmeYyEvsIgqFvMi1SzhpXRm"
    "WMrLvMorLOM13uB13qSW5bzFSlZQn84M7/A277KKBt5jNY18wPt8SBMf8xFraGYtn7COT/mM9XzB53zFl3zD13zLBox6fMeP/MBG"
    "fqKFTfzMZn7ht5qs2Cq3pGulWdEyMyu269vSNX7ld3bwBzvZzS7+4k/2sod9/M0/7Oc//j1w/TOZTHR1D/Jyc01gfkE0lEVLcXX8"
    "Dyifmp4="
)
MULTILINGUAL = [
    "the cat runs fast over the river", "le chat court vite sur la rivière", "der Hund läuft über den Fluss",
    "собака бежит через реку", "猫はとても速く走る", "القط يجري بسرعة", "École du chat",
    "l'oiseau chante la nuit",
    "die Katze und der Hund", "вода и камень", "鳥は夜に歌う", "الماء والحجر",
]


def xlmr_tokenizer(max_length: int):
    """An XLM-RoBERTa tokenizer as transformers builds one from a SentencePiece model: a Unigram of
    (piece, score) laid out as XLM-R's (<s> <pad> </s> <unk>, the pieces, <mask>), the
    Precompiled normalizer of XLMR_CHARSMAP; its pieces and scores trained here by `tokenizers`."""
    import base64
    import zlib

    import transformers as T
    from tokenizers import Tokenizer, models, normalizers, pre_tokenizers, trainers

    charsmap = zlib.decompress(base64.b64decode("".join(XLMR_CHARSMAP)))
    trainer_tok = Tokenizer(models.Unigram())
    trainer_tok.normalizer = normalizers.Precompiled(charsmap)
    trainer_tok.pre_tokenizer = pre_tokenizers.Metaspace()
    trainer = trainers.UnigramTrainer(vocab_size=220, special_tokens=["<unk>"], unk_token="<unk>", shrinking_factor=0.9)
    trainer_tok.train_from_iterator([*MULTILINGUAL, " ".join(WORDS)] * 20, trainer)
    pieces = [(p, s) for p, s in json.loads(trainer_tok.to_str())["model"]["vocab"] if p != "<unk>"]
    vocab = [("<s>", 0.0), ("<pad>", 0.0), ("</s>", 0.0), ("<unk>", 0.0), *pieces, ("<mask>", 0.0)]
    return T.XLMRobertaTokenizer(vocab=vocab, _spm_precompiled_charsmap=charsmap, model_max_length=max_length)


def xlmr_folder(root: Path, seed: int, labels: int = 0) -> Path:
    """A random XLMRobertaModel (XLMRobertaForSequenceClassification of `labels` labels) with a
    SentencePiece-Unigram tokenizer (`xlmr_tokenizer`); positions after the padding index 1."""
    import transformers as T

    tok = xlmr_tokenizer(MAX_POSITIONS)
    config = T.XLMRobertaConfig(vocab_size=len(tok), hidden_size=HIDDEN, num_hidden_layers=2, num_attention_heads=4,
                                intermediate_size=64, initializer_range=0.2, max_position_embeddings=MAX_POSITIONS + 2,
                                type_vocab_size=1, pad_token_id=1, bos_token_id=0, eos_token_id=2)
    if labels:
        config.num_labels = labels
    torch.manual_seed(seed)
    folder = root / f"gguf-xlmr-{labels}-{seed}"
    cls = T.XLMRobertaForSequenceClassification if labels else T.XLMRobertaModel
    perturb(cls(config), seed).save_pretrained(folder)
    tok.save_pretrained(folder)
    return folder


def write_xlmr_gguf(folder: Path, out: Path, from_spm: bool = False) -> Path:
    """The XLM-RoBERTa folder (a sentence-transformers one, or a cross-encoder) as llama.cpp's
    converter writes it at --outtype f32 (its `XLMRobertaModel`: arch `bert`, the vocabulary from
    tokenizer.json as `t5` pieces with scores and the charsmap, positions from padding_idx + 1 on,
    the classifier as `cls` / `cls.output`). `from_spm`: as from a folder's sentencepiece.bpe.model
    (bge-m3's, multilingual E5's): <mask>, which the SentencePiece model lacks, left as an unused
    "[PADn]", and remove_extra_whitespaces from its normalizer spec (true)."""
    from safetensors.torch import load_file
    from transformers import AutoConfig, AutoTokenizer

    config = AutoConfig.from_pretrained(folder)
    tok = AutoTokenizer.from_pretrained(folder)
    offset = config.pad_token_id + 1
    w = gguf.GGUFWriter(str(out), "bert")
    w.add_type("model")
    w.add_name(folder.name)
    w.add_block_count(config.num_hidden_layers)
    w.add_context_length(config.max_position_embeddings - offset)
    w.add_embedding_length(config.hidden_size)
    w.add_feed_forward_length(config.intermediate_size)
    w.add_head_count(config.num_attention_heads)
    w.add_layer_norm_eps(config.layer_norm_eps)
    w.add_file_type(0)
    w.add_causal_attention(False)
    if (folder / "modules.json").is_file():
        modules = json.loads((folder / "modules.json").read_text())
        pooling_path = next(m["path"] for m in modules if m["type"].endswith("Pooling"))
        mode = json.loads((folder / pooling_path / "config.json").read_text())["pooling_mode"]
        w.add_pooling_type(gguf.PoolingType(_POOLING[mode]))
    labels = config.id2label if config.architectures[0].endswith("ForSequenceClassification") else None
    if labels and not (len(labels) == 2 and labels[0] == "LABEL_0"):  # (the converter drops the dummy pair)
        w.add_classifier_output_labels([v for _, v in sorted(labels.items())])
    w.add_quantization_version(gguf.GGML_QUANT_VERSION)
    tok_json = json.loads((folder / "tokenizer.json").read_text())
    added = tok.get_added_vocab()
    tokens, scores, types = [], [], []
    for i in range(tok.vocab_size):
        if from_spm and i == tok.mask_token_id:
            tokens.append(f"[PAD{i - 1}]")
            scores.append(-10000.0)
            types.append(gguf.TokenType.UNUSED)
            continue
        tokens.append(tok.convert_ids_to_tokens(i))
        scores.append(tok_json["model"]["vocab"][i][1])
        types.append(gguf.TokenType.UNKNOWN if i == tok.unk_token_id else gguf.TokenType.CONTROL
                     if i in tok.all_special_ids else gguf.TokenType.USER_DEFINED if i in added.values()
                     else gguf.TokenType.NORMAL)
    w.add_tokenizer_model("t5")
    w.add_tokenizer_pre("default")
    w.add_token_list(tokens)
    w.add_token_scores(scores)
    w.add_token_types(types)
    w.add_add_space_prefix(tok.add_prefix_space)
    w.add_token_type_count(config.type_vocab_size)
    w.add_remove_extra_whitespaces(True if from_spm else tok.clean_up_tokenization_spaces)
    w.add_precompiled_charsmap(base64.b64decode(tok_json["normalizer"]["precompiled_charsmap"]))
    add_special_ids(w, tok, tok.bos_token_id, tok.eos_token_id, add_sep=True)
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.BERT, config.num_hidden_layers)
    for name, tensor in load_file(str(folder / "model.safetensors")).items():
        name = name.removeprefix("roberta.")
        if name.startswith("pooler.") or name.endswith("position_ids"):
            continue  # the converter drops the pooler
        if name == "embeddings.position_embeddings.weight":
            tensor = tensor[offset:]
        gguf_name = names.get_name(name, try_suffixes=(".weight", ".bias"))
        assert gguf_name is not None, name
        w.add_tensor(gguf_name, tensor.float().numpy())
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return out


def xlmr_texts() -> list[str]:
    """Multilingual texts, short and long (1 to ~150 tokens), and what the normalizer rewrites."""
    long = " ".join(MULTILINGUAL[1:7])
    return [*MULTILINGUAL[:6], "chat", long, "ＡＢＣ ﬁ ① Ⅻ E\u0301cole … ｶ\u3000猫", MULTILINGUAL[4] * 4,
            "  der   Hund\tläuft\n über  ", "🙂 unknown ✓ signs", " ".join(MULTILINGUAL[:7])]


def test_xlmr_gguf_equals_sentence_transformers(root):
    """An XLM-RoBERTa embedding model (multilingual E5's shape) as the converter writes it (arch
    bert, tokenizer t5): the tokenizer made from the file gives the folder's ids, the vectors equal
    SentenceTransformer.encode (positions after the padding index). The file is written as from a
    sentencepiece.bpe.model (the reranker tests' from tokenizer.json): <mask> is still <mask>."""
    from sentence_transformers import SentenceTransformer
    from transformers import AutoTokenizer

    from executor_svc.pooling import PoolingRunner
    from pagoda import model_files
    from pagoda.pooling_files import resolve_runner

    folder = st_folder(xlmr_folder(root, seed=21), "mean", True)
    model_dir = model_files.resolve_model(str(write_xlmr_gguf(folder, root / "xlmr.gguf", from_spm=True)),
                                          weights=False)
    assert resolve_runner(model_dir, "auto") == "pooling"
    inputs = xlmr_texts()
    reference_tok, tok = AutoTokenizer.from_pretrained(folder), AutoTokenizer.from_pretrained(model_dir)
    for text in [*inputs, "<s> a <mask> b </s>", ("le chat", "die Katze"), ("", "猫")]:
        args = text if isinstance(text, tuple) else (text,)
        assert tok(*args)["input_ids"] == reference_tok(*args)["input_ids"], text
    assert max(len(tok(t)["input_ids"]) for t in inputs) > 100  # short and long mixed
    assert reference_tok.unk_token_id in tok(inputs[-2])["input_ids"]  # (a character outside the vocabulary)
    runner = PoolingRunner(model_dir)
    spec = runner.spec
    assert (spec.model_type, spec.pooling_mode, runner.max_model_len) == ("xlm-roberta", "mean", MAX_POSITIONS)
    reference = SentenceTransformer(str(folder), device="cpu").encode(inputs, convert_to_numpy=True)
    assert_vectors_equal(runner.run(pool_requests(tok, inputs, normalize=True)), reference)


@pytest.mark.parametrize("labels", [1, 2])
def test_xlmr_reranker_gguf_equals_cross_encoder(root, labels):
    """A GGUF reranker (bge-reranker-v2-m3's shape: XLMRobertaForSequenceClassification, written with
    cls / cls.output; two labels LABEL_0/LABEL_1 lose their names in the converter) is served as a
    cross-encoder: its scores equal CrossEncoder.predict on the folder."""
    from sentence_transformers import CrossEncoder
    from transformers import AutoTokenizer

    from executor_svc.pooling import PoolingRunner
    from pagoda import model_files
    from pagoda.pooling_files import resolve_runner

    folder = xlmr_folder(root, seed=22 + labels, labels=labels)
    model_dir = model_files.resolve_model(str(write_xlmr_gguf(folder, root / f"rerank-{labels}.gguf")), weights=False)
    assert resolve_runner(model_dir, "auto") == "pooling"
    inputs = xlmr_texts()
    pairs = [(inputs[i], inputs[-1 - i]) for i in range(len(inputs) // 2)] + [(inputs[1], inputs[2])]
    reference = CrossEncoder(str(folder), device="cpu")
    tok = AutoTokenizer.from_pretrained(model_dir)
    assert [tok(*p)["input_ids"] for p in pairs] == [reference.tokenizer(*p)["input_ids"] for p in pairs]
    runner = PoolingRunner(model_dir)
    assert (runner.spec.task, runner.spec.num_labels) == ("classify", labels)
    assert runner.spec.activation == ("sigmoid" if labels == 1 else "identity")
    expected = np.asarray(reference.predict(pairs, convert_to_numpy=True), dtype=np.float32).reshape(len(pairs), labels)
    out = np.asarray(runner.run(pool_requests(tok, pairs, task=pb.POOL_TASK_CLASSIFY)), dtype=np.float32)
    assert np.abs(out - expected).max() <= 1e-4, np.abs(out - expected).max()
