"""Pooling models as GGUF files, as llama.cpp's `convert_hf_to_gguf.py` writes them (read without torch).

A GGUF file is a pooling model when its architecture is an encoder (`bert`: BERT, bge-small,
all-MiniLM; XLM-RoBERTa too: multilingual E5, bge-m3, bge-reranker-v2-m3) or its metadata sets
`<arch>.pooling_type` (a decoder embedding model such as Qwen3-Embedding, architecture `qwen3`).
Its metadata directory (`pagoda.model_files`) is then written as a sentence-transformers folder
(a cross-encoder's folder for a reranker), so that `pagoda.pooling_files.read_pooling_spec` and
the scheduler's tokenizer read it as they read any folder:

- `config.json`: for `bert`, a `BertModel` config from the `bert.*` keys (the vocabulary's size
  from `tokenizer.ggml.tokens`, `max_position_embeddings` from `bert.context_length`, token
  types from `tokenizer.ggml.token_type_count`, GELU (erf) as sentence-transformers runs it);
  an XLM-RoBERTa file (`tokenizer.ggml.model` "t5": the converter's `XLMRobertaModel` writes
  XLM-R as `bert` with its SentencePiece vocabulary) an `XLMRobertaModel` config whose positions
  start after the padding index as XLM-R's do (the converter cut those `padding_idx + 1` rows
  off `position_embd`: `max_position_embeddings` = context_length + padding_idx + 1);
  a decoder's by transformers from its metadata, as for generation;
- the tokenizer: for `bert` (`tokenizer.ggml.model` "bert"), a `tokenizers` WordPiece built from
  `tokenizer.ggml.tokens` with the converter's "phantom space" undone (a control token as it is,
  `▁word` -> `word`, any other piece -> `##piece`), BERT's normalizer (lowercasing as
  `tokenizer.ggml.normalizer.lowercase` says; llama.cpp lowercases when the key is absent) and
  `[CLS] A [SEP]` / `[CLS] A [SEP] B [SEP]` from the cls/sep ids; for "t5", XLM-R's as transformers
  builds it from a SentencePiece model (`XLMRobertaTokenizer`): a Unigram of the tokens and
  `tokenizer.ggml.scores`, the `Precompiled` normalizer of `tokenizer.ggml.precompiled_charsmap`,
  whitespace split and the `▁` prefix (`tokenizer.ggml.add_space_prefix`), `<s> A </s>` /
  `<s> A </s></s> B </s>`, the control tokens special; a decoder's by transformers;
- `modules.json`, `1_Pooling/config.json` (`pooling_type` MEAN, CLS or LAST; an encoder without
  the key pools the mean, sentence-transformers' default for a bare encoder) and `2_Normalize`:
  the converter does not record a Normalize module, and llama.cpp's server normalizes
  embeddings by default, so a GGUF model's default is normalized vectors (a request may ask for
  them unnormalized: the raw pooled vector, equal to a folder without Normalize);
- a reranker (`cls.weight` and `cls.output.weight`: XLMRobertaForSequenceClassification's
  `classifier.dense` and `classifier.out_proj`, as llama.cpp's `--rerank` runs them; `pooling_type`
  RANK or absent): an `XLMRobertaForSequenceClassification` config of as many labels as
  `cls.output` has rows (`<arch>.classifier.output_labels` their names) and no modules.json: its
  scores are `CrossEncoder.predict`'s (a sigmoid for one label; the file records no other activation);
- `sentence_bert_config.json`: `max_seq_length` = `<arch>.context_length` (the converter keeps
  no shorter sentence-transformers limit).

Not served, refused naming the key: `pooling_type` NONE (per-token vectors), RANK without a
classifier, a BERT classifier (`cls.output` without `cls`: the converter drops BERT's
`pooler.dense`, which BertForSequenceClassification applies before its classifier, so its scores
cannot be the model's), another tokenizer model, other encoder architectures.
"""

from __future__ import annotations

import json
from pathlib import Path

from pagoda.pooling_files import PoolingError

ENCODER_ARCHITECTURES = ("bert",)
# gguf.PoolingType values -> sentence-transformers' pooling_mode (NONE 0 is not served; RANK 4: a reranker)
POOLING_MODES = {1: "mean", 2: "cls", 3: "lasttoken"}
_POOLING_NAMES = {0: "NONE", 1: "MEAN", 2: "CLS", 3: "LAST", 4: "RANK"}
_RANK = 4  # gguf.PoolingType.RANK
_CONTROL, _USER_DEFINED, _UNUSED, _BYTE = 3, 4, 5, 6  # gguf.TokenType
# an encoder file's tokenizer.ggml.model -> its transformers model_type (the converter writes
# XLM-RoBERTa as `bert` with its SentencePiece vocabulary, "t5" in llama.cpp's names)
_ENCODER_TOKENIZERS = {"bert": "bert", "t5": "xlm-roberta"}


def _field(reader, key: str, default=None):
    field = reader.fields.get(key)
    return default if field is None else field.contents()


def architecture(reader) -> str:
    return str(_field(reader, "general.architecture", ""))


def pooling_type(reader) -> int | None:
    """`<arch>.pooling_type` of the file (a gguf.PoolingType value), or None when absent."""
    value = _field(reader, f"{architecture(reader)}.pooling_type")
    return None if value is None else int(value)


def is_pooling(reader) -> bool:
    """Whether the file is a pooling model: an encoder architecture or a pooling_type set."""
    return architecture(reader) in ENCODER_ARCHITECTURES or pooling_type(reader) is not None


def _scalar_keys(path: str | Path, wanted) -> dict:
    """The file's scalar metadata values whose key `wanted(key)` accepts, read from its header alone.

    The `gguf` package's reader parses every array (a vocabulary of 49,152 tokens: 14 s on a
    2-core EPYC) to answer two keys; this walks the key-value section, skipping arrays by their
    lengths, with the package's value types and byte order (little-endian files)."""
    import struct

    from gguf import GGUF_MAGIC, GGUFValueType

    sizes = {GGUFValueType.UINT8: "B", GGUFValueType.INT8: "b", GGUFValueType.UINT16: "H", GGUFValueType.INT16: "h",
             GGUFValueType.UINT32: "I", GGUFValueType.INT32: "i", GGUFValueType.FLOAT32: "f", GGUFValueType.BOOL: "?",
             GGUFValueType.UINT64: "Q", GGUFValueType.INT64: "q", GGUFValueType.FLOAT64: "d"}
    found = {}
    with open(path, "rb") as f:
        def read(fmt: str):
            size = struct.calcsize("<" + fmt)
            data = f.read(size)
            if len(data) != size:
                raise ValueError(f"{path}: a truncated GGUF header")
            return struct.unpack("<" + fmt, data)[0]

        def string() -> bytes:
            return f.read(read("Q"))

        if read("I") != GGUF_MAGIC:
            raise ValueError(f"{path}: not a (little-endian) GGUF file")
        read("I")  # version
        read("Q")  # tensors
        for _ in range(read("Q")):
            key = string().decode("utf-8", "replace")
            vtype = GGUFValueType(read("I"))
            if vtype == GGUFValueType.STRING:
                value = string().decode("utf-8", "replace")
            elif vtype == GGUFValueType.ARRAY:
                itype, count = GGUFValueType(read("I")), read("Q")
                if itype == GGUFValueType.STRING:
                    for _ in range(count):
                        f.seek(read("Q"), 1)
                elif itype in sizes:
                    f.seek(count * struct.calcsize("<" + sizes[itype]), 1)
                else:
                    raise ValueError(f"{path}: {key}: an array of {itype.name} in a GGUF header")
                continue
            else:
                value = read(sizes[vtype])
            if wanted(key):
                found[key] = value
    return found


def is_pooling_file(path: str | Path) -> bool:
    """`is_pooling` of the file, read from its header (fast: no array is parsed)."""
    keys = _scalar_keys(path, lambda key: key == "general.architecture" or key.endswith(".pooling_type"))
    arch = keys.get("general.architecture", "")
    return arch in ENCODER_ARCHITECTURES or f"{arch}.pooling_type" in keys


def pooling_mode(reader) -> str:
    """The sentence-transformers pooling_mode of the file; PoolingError naming the key for one not served."""
    arch = architecture(reader)
    kind = pooling_type(reader)
    if kind is None:
        if arch in ENCODER_ARCHITECTURES:
            return "mean"
        raise PoolingError(f"{arch}.pooling_type", "absent: a generation model (serve it with --runner generate)")
    if kind not in POOLING_MODES:
        what = ("per-token vectors" if kind == 0 else "a reranker's scores, but the file has no classifier (cls.weight "
                "and cls.output.weight)" if kind == _RANK else "unknown")
        raise PoolingError(f"{arch}.pooling_type", f"{_POOLING_NAMES.get(kind, kind)} ({what}) is not served; "
                                                   "MEAN, CLS and LAST are, and RANK for an XLM-RoBERTa reranker")
    return POOLING_MODES[kind]


def encoder_type(reader) -> str:
    """The transformers model_type of an encoder file, by its tokenizer: "bert" or "xlm-roberta"."""
    tok_model = _field(reader, "tokenizer.ggml.model")
    if tok_model not in _ENCODER_TOKENIZERS:
        raise PoolingError("tokenizer.ggml.model", f"{tok_model!r}: the bert architecture is served with BERT's "
                                                   "WordPiece ('bert') and XLM-RoBERTa's SentencePiece ('t5') "
                                                   "tokenizers only (serve the safetensors folder)")
    return _ENCODER_TOKENIZERS[tok_model]


def classifier_labels(reader) -> int:
    """The number of labels of a reranker file (XLM-RoBERTa's `cls` + `cls.output` head), 0 for an
    embedding model; PoolingError naming the key for a classifier that cannot be served."""
    arch = architecture(reader)
    tensors = {t.name: t for t in reader.tensors}
    labels = _field(reader, f"{arch}.classifier.output_labels")
    if "cls.output.weight" not in tensors and "cls.weight" not in tensors and labels is None:
        return 0
    if "cls.weight" not in tensors:
        raise PoolingError(f"{arch}.classifier.output_labels",
                           "a BERT classifier: llama.cpp's converter drops its pooler.dense, so its scores "
                           "cannot be the model's (serve the safetensors folder)")
    if "cls.output.weight" not in tensors:
        raise PoolingError("cls.output.weight", "missing: a one-layer classifier head is not served")
    if encoder_type(reader) != "xlm-roberta":
        raise PoolingError("tokenizer.ggml.model", "a classifier head (cls, cls.output) over a WordPiece vocabulary: "
                                                   "XLM-RoBERTa rerankers are served (serve the safetensors folder)")
    shape = [int(n) for n in tensors["cls.output.weight"].shape]  # GGUF order: [hidden, labels]
    count = shape[1] if len(shape) > 1 else 1
    if labels is not None and len(labels) != count:
        raise PoolingError(f"{arch}.classifier.output_labels",
                           f"{len(labels)} names for the {count} rows of cls.output")
    return count


def check_servable(reader) -> tuple[str, int]:
    """(pooling mode, labels: 0 for an embedding model) after refusing what the pooling runner
    cannot serve (PoolingError naming the key)."""
    arch = architecture(reader)
    if arch in ENCODER_ARCHITECTURES:
        encoder_type(reader)
        labels = classifier_labels(reader)
        if labels:
            kind = pooling_type(reader)
            if kind not in (None, _RANK):  # (the head reads the first token, <s>)
                raise PoolingError(f"{arch}.pooling_type", f"{_POOLING_NAMES.get(kind, kind)} on a reranker: "
                                                           "RANK (or none) is served")
            return "cls", labels
    return pooling_mode(reader), 0


def _bert_config(reader, labels: int = 0) -> dict:
    arch = architecture(reader)
    tokens = _field(reader, "tokenizer.ggml.tokens") or []

    def need(key: str):
        value = _field(reader, f"{arch}.{key}")
        if value is None:
            raise PoolingError(f"{arch}.{key}", "missing")
        return value

    pad = _field(reader, "tokenizer.ggml.padding_token_id")
    config = {
        "architectures": ["BertModel"],
        "model_type": "bert",
        "vocab_size": len(tokens),
        "hidden_size": int(need("embedding_length")),
        "num_hidden_layers": int(need("block_count")),
        "num_attention_heads": int(need("attention.head_count")),
        "intermediate_size": int(need("feed_forward_length")),
        "max_position_embeddings": int(need("context_length")),
        "type_vocab_size": int(_field(reader, "tokenizer.ggml.token_type_count", 2)),
        "layer_norm_eps": float(need("attention.layer_norm_epsilon")),
        "hidden_act": "gelu",
        "position_embedding_type": "absolute",
        "pad_token_id": int(pad) if pad is not None else 0,
    }
    if encoder_type(reader) == "xlm-roberta":
        if pad is None:
            raise PoolingError("tokenizer.ggml.padding_token_id", "missing: XLM-RoBERTa's positions start after it")
        # the converter cut the padding_idx + 1 rows no input uses off position_embd (and off context_length)
        config["max_position_embeddings"] += int(pad) + 1
        config["model_type"] = "xlm-roberta"
        config["architectures"] = ["XLMRobertaForSequenceClassification" if labels else "XLMRobertaModel"]
        for key in ("bos_token_id", "eos_token_id"):
            if _field(reader, f"tokenizer.ggml.{key}") is not None:
                config[key] = int(_field(reader, f"tokenizer.ggml.{key}"))
        if labels:
            names = _field(reader, f"{arch}.classifier.output_labels") or [f"LABEL_{i}" for i in range(labels)]
            config["num_labels"] = labels
            config["id2label"] = {str(i): str(name) for i, name in enumerate(names)}
            config["label2id"] = {str(name): i for i, name in enumerate(names)}
    return config


def _special(reader, tokens, key: str) -> str:
    value = _field(reader, f"tokenizer.ggml.{key}")
    if value is None or not 0 <= int(value) < len(tokens):
        raise PoolingError(f"tokenizer.ggml.{key}", "missing or outside the vocabulary")
    return tokens[int(value)]


def _bert_tokenizer(reader, max_length: int):
    """A transformers fast tokenizer over a `tokenizers` WordPiece made from the file's vocabulary."""
    from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    tokens = _field(reader, "tokenizer.ggml.tokens")
    types = _field(reader, "tokenizer.ggml.token_type")
    if not tokens or not types or len(tokens) != len(types):
        raise PoolingError("tokenizer.ggml.tokens", "missing, or not one token type per token")
    vocab: dict[str, int] = {}
    for i, (token, kind) in enumerate(zip(tokens, types)):
        # undo the converter's phantom space: "▁word" began a word, any other piece continued one
        piece = token if kind == _CONTROL else token[1:] if token.startswith("\u2581") else "##" + token
        vocab.setdefault(piece, i)

    def special(key: str) -> str:
        return _special(reader, tokens, key)

    cls = special("bos_token_id")  # the converter writes [CLS] as BOS and [SEP] as EOS / separator
    # (the gguf package spells the key "seperator")
    has_sep = "tokenizer.ggml.seperator_token_id" in reader.fields
    sep = special("seperator_token_id") if has_sep else special("eos_token_id")
    unk = special("unknown_token_id")
    lowercase = bool(_field(reader, "tokenizer.ggml.normalizer.lowercase", True))
    tok = Tokenizer(models.WordPiece(vocab, unk_token=unk, max_input_chars_per_word=100))
    tok.normalizer = normalizers.BertNormalizer(clean_text=True, handle_chinese_chars=True, strip_accents=None,
                                                lowercase=lowercase)
    tok.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    tok.post_processor = processors.TemplateProcessing(
        single=f"{cls}:0 $A:0 {sep}:0", pair=f"{cls}:0 $A:0 {sep}:0 $B:1 {sep}:1",
        special_tokens=[(cls, vocab[cls]), (sep, vocab[sep])])
    tok.decoder = decoders.WordPiece(prefix="##")
    extra = {}
    for name, key in (("pad_token", "padding_token_id"), ("mask_token", "mask_token_id")):
        if f"tokenizer.ggml.{key}" in reader.fields:
            extra[name] = special(key)
    return PreTrainedTokenizerFast(tokenizer_object=tok, cls_token=cls, sep_token=sep, unk_token=unk,
                                   model_max_length=max_length,
                                   model_input_names=["input_ids", "token_type_ids", "attention_mask"], **extra)


def _xlmr_tokenizer(reader, max_length: int):
    """XLM-RoBERTa's tokenizer from the file's SentencePiece vocabulary, built as transformers'
    `XLMRobertaTokenizer` builds it from a SentencePiece model: a Unigram of (token, score) with
    <unk> by its id (SentencePiece's Viterbi over the scores), the Precompiled normalizer of the
    charsmap, whitespace split then `▁` as the word prefix, `<s> A </s>` / `<s> A </s></s> B </s>`."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, normalizers, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    tokens = _field(reader, "tokenizer.ggml.tokens")
    types = _field(reader, "tokenizer.ggml.token_type")
    scores = _field(reader, "tokenizer.ggml.scores")
    if not tokens or not types or len(tokens) != len(types):
        raise PoolingError("tokenizer.ggml.tokens", "missing, or not one token type per token")
    if not scores or len(scores) != len(tokens):
        raise PoolingError("tokenizer.ggml.scores", "missing, or not one score per token")

    mask_id = _field(reader, "tokenizer.ggml.mask_token_id")
    if mask_id is not None and 0 <= int(mask_id) < len(tokens) and types[int(mask_id)] == _UNUSED:
        # from a sentencepiece.bpe.model the converter leaves the id of the <mask> transformers
        # appends to XLM-R's pieces as a "[PADn]" placeholder
        tokens, types = list(tokens), list(types)
        tokens[int(mask_id)], types[int(mask_id)] = "<mask>", _CONTROL

    def special(key: str) -> str:
        return _special(reader, tokens, key)

    unk_id = int(_field(reader, "tokenizer.ggml.unknown_token_id", -1))
    if not 0 <= unk_id < len(tokens):
        raise PoolingError("tokenizer.ggml.unknown_token_id", "missing or outside the vocabulary")
    byte_fallback = _BYTE in types
    tok = Tokenizer(models.Unigram([(t, float(s)) for t, s in zip(tokens, scores)], unk_id=unk_id,
                                   byte_fallback=byte_fallback))
    charsmap = _field(reader, "tokenizer.ggml.precompiled_charsmap")
    if charsmap:
        tok.normalizer = normalizers.Precompiled(bytes(int(b) & 0xFF for b in charsmap))
    prepend = "always" if _field(reader, "tokenizer.ggml.add_space_prefix", True) else "never"
    metaspace = pre_tokenizers.Metaspace(replacement="\u2581", prepend_scheme=prepend)
    tok.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.WhitespaceSplit(), metaspace])
    tok.decoder = decoders.Metaspace(replacement="\u2581", prepend_scheme=prepend)
    bos = special("bos_token_id")
    has_sep = "tokenizer.ggml.seperator_token_id" in reader.fields
    eos = special("seperator_token_id") if has_sep else special("eos_token_id")
    tok.post_processor = processors.TemplateProcessing(
        single=[bos, "$A", eos], pair=[bos, "$A", eos, eos, "$B", eos],
        special_tokens=[(bos, tokens.index(bos)), (eos, tokens.index(eos))])
    # control pieces (<s>, <pad>, </s>) are special, user-defined ones whole pieces, as in transformers
    tok.add_special_tokens([AddedToken(t, normalized=False, special=True)
                            for t, kind in zip(tokens, types) if kind == _CONTROL])
    tok.add_tokens([AddedToken(t, normalized=False) for t, kind in zip(tokens, types) if kind == _USER_DEFINED])
    extra = {"eos_token": special("eos_token_id"), "unk_token": tokens[unk_id]}
    for name, key in (("pad_token", "padding_token_id"), ("mask_token", "mask_token_id")):
        if f"tokenizer.ggml.{key}" in reader.fields:
            extra[name] = special(key)
    if "mask_token" in extra:  # (XLM-R's <mask> takes the space before it)
        extra["mask_token"] = AddedToken(extra["mask_token"], lstrip=True, normalized=False, special=True)
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token=bos, cls_token=bos, sep_token=eos,
                                   model_max_length=max_length, model_input_names=["input_ids", "attention_mask"],
                                   **extra)


def write_pooling_metadata(gguf_path: Path, out: Path) -> None:
    """The sentence-transformers folder standing for the pooling GGUF file (see the module's text)."""
    from gguf import GGUFReader

    reader = GGUFReader(str(gguf_path))
    arch = architecture(reader)
    mode, labels = check_servable(reader)
    out.mkdir(parents=True, exist_ok=True)
    context = _field(reader, f"{arch}.context_length")
    if arch in ENCODER_ARCHITECTURES:
        config = _bert_config(reader, labels)
        (out / "config.json").write_text(json.dumps(config, indent=2))
        if config["model_type"] == "xlm-roberta":
            _xlmr_tokenizer(reader, int(context)).save_pretrained(out)
        else:
            _bert_tokenizer(reader, config["max_position_embeddings"]).save_pretrained(out)
        if labels:  # a cross-encoder's folder: the model and its tokenizer, no modules
            (out / "sentence_bert_config.json").write_text(json.dumps({"max_seq_length": int(context)}))
            return
    else:
        from transformers import AutoConfig, AutoTokenizer

        folder, name = str(gguf_path.parent), gguf_path.name
        try:
            AutoTokenizer.from_pretrained(folder, gguf_file=name).save_pretrained(out)
            config = AutoConfig.from_pretrained(folder, gguf_file=name).to_dict()
        except (ValueError, KeyError) as exc:
            raise PoolingError("general.architecture", f"{arch!r}: transformers cannot read it ({exc})") from None
        key_length = _field(reader, f"{arch}.attention.key_length")
        if key_length is not None and "head_dim" in config:  # (transformers' GGUF config leaves its default)
            config["head_dim"] = int(key_length)
        (out / "config.json").write_text(json.dumps(config, indent=2))
    hidden = int(config.get("hidden_size", 0))
    modules = [
        {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
        {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"},
        {"idx": 2, "name": "2", "path": "2_Normalize", "type": "sentence_transformers.models.Normalize"},
    ]
    (out / "modules.json").write_text(json.dumps(modules, indent=2))
    (out / "1_Pooling").mkdir(exist_ok=True)
    (out / "1_Pooling" / "config.json").write_text(json.dumps({"embedding_dimension": hidden, "pooling_mode": mode}))
    (out / "2_Normalize").mkdir(exist_ok=True)
    if context is not None:
        (out / "sentence_bert_config.json").write_text(json.dumps({"max_seq_length": int(context)}))
