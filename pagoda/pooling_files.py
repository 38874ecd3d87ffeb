"""A pooling model's files, read without torch: what the scheduler and the executors both need.

A sentence-transformers folder is a transformers model at its root plus `modules.json`, which
lists its modules: the `Transformer` (the root), a `Pooling` (`1_Pooling/config.json`:
`pooling_mode` cls, mean or lasttoken; the older `pooling_mode_*_token` booleans too) and an
optional `Normalize`. `config_sentence_transformers.json` holds its prompts (`query: ...`), the
default prompt's name and, for a cross-encoder, its activation; `sentence_bert_config.json` or
the tokenizer's `model_max_length` its longest input. A cross-encoder is a
`*ForSequenceClassification` model (with or without those files): its scores are what
sentence-transformers' `CrossEncoder.predict` gives: the logits through the activation the folder
names (`activation_fn`, or `config.json`'s `sentence_transformers.activation_fn` or
`sbert_ce_default_activation_function`), by default a sigmoid for one label and none for more.
Matryoshka dimensions come from `config.json` (`matryoshka_dimensions`, `is_matryoshka`), the
keys vLLM reads. `read_pooling_spec` gives a `PoolingSpec` or None (a generation model);
`resolve_runner` turns `--runner auto|generate|pooling` into the runner for a model folder.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

MODULES_FILE = "modules.json"
ST_CONFIG_FILE = "config_sentence_transformers.json"
SBERT_CONFIG_FILE = "sentence_bert_config.json"
POOLING_MODES = ("cls", "mean", "lasttoken")
RUNNERS = ("auto", "generate", "pooling")
# The encoder families the pooling runner runs (executor_svc/models/bert.py); decoder embedding
# models run through the decoder families (executor_svc/models/__init__.py's registry)
ENCODER_MODEL_TYPES = ("bert", "xlm-roberta")
# pooling_mode_* booleans of sentence-transformers < 6 -> the pooling_mode they mean
_LEGACY_MODE_KEYS = {
    "pooling_mode_cls_token": "cls",
    "pooling_mode_mean_tokens": "mean",
    "pooling_mode_lasttoken": "lasttoken",
    "pooling_mode_max_tokens": "max",
    "pooling_mode_mean_sqrt_len_tokens": "mean_sqrt_len_tokens",
    "pooling_mode_weightedmean_tokens": "weightedmean",
}
# torch activation classes sentence-transformers' CrossEncoder may name -> our name
_ACTIVATIONS = {"Sigmoid": "sigmoid", "Identity": "identity", "Tanh": "tanh", "Softmax": "softmax"}
_ST_TRANSFORMER = "Transformer"
_ST_POOLING = "Pooling"
_ST_NORMALIZE = "Normalize"


class PoolingError(ValueError):
    """A model folder the pooling runner cannot serve; `field` names the file or field at fault."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(f"{field}: {message}")
        self.field = field


@dataclass(frozen=True)
class PoolingSpec:
    task: str  # "embed" (a vector per input) or "classify" (a cross-encoder's scores)
    pooling_mode: str  # "cls" | "mean" | "lasttoken" (classify: the model's own head)
    normalize: bool  # the model's default: a sentence-transformers Normalize module
    prompts: dict = field(default_factory=dict)  # name -> text put before the input
    default_prompt_name: str | None = None
    max_model_len: int = 512  # the longest input in tokens, special tokens included
    hidden_size: int = 0  # embed: the vector's size; classify: the model's hidden size
    matryoshka_dimensions: tuple[int, ...] | None = None  # the sizes it may be cut to (None: see is_matryoshka)
    is_matryoshka: bool = False  # any size from 1 to hidden_size (or one of matryoshka_dimensions)
    num_labels: int = 0  # classify: scores per input
    activation: str = "identity"  # classify: "sigmoid" | "identity" | "tanh" | "softmax"
    architecture: str = ""  # config.json's architectures[0]
    model_type: str = ""  # config.json's model_type

    @property
    def is_encoder(self) -> bool:
        return self.model_type in ENCODER_MODEL_TYPES

    def check_dimensions(self, dimensions: int) -> None:
        """PoolingError("dimensions") unless the vector may be cut to `dimensions` (0: the whole vector)."""
        if dimensions == 0:
            return
        if self.task != "embed":
            raise PoolingError("dimensions", "only embedding models take dimensions")
        if not self.is_matryoshka:
            raise PoolingError("dimensions", "the model declares no Matryoshka dimensions (config.json's "
                                             "matryoshka_dimensions / is_matryoshka); it cannot be cut")
        if self.matryoshka_dimensions is not None:
            if dimensions not in self.matryoshka_dimensions:
                raise PoolingError("dimensions", f"{dimensions} is not one of the model's Matryoshka dimensions "
                                                 f"{list(self.matryoshka_dimensions)}")
        elif not 1 <= dimensions <= self.hidden_size:
            raise PoolingError("dimensions", f"{dimensions} is out of range 1..{self.hidden_size}")


def _read_json(path: Path, name: str):
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise PoolingError(name, f"cannot read {path}: {exc}") from None


def _model_config(path: Path) -> dict:
    config_path = path / "config.json"
    if not config_path.is_file():
        raise PoolingError("config.json", f"{path} has no config.json")
    config = _read_json(config_path, "config.json")
    if not isinstance(config, dict):
        raise PoolingError("config.json", "expected a JSON object")
    return config


def _text_config(config: dict) -> dict:
    text = config.get("text_config")
    return text if isinstance(text, dict) else config


def _architecture(config: dict) -> str:
    archs = config.get("architectures") or []
    return archs[0] if archs and isinstance(archs[0], str) else ""


def is_sentence_transformers_folder(path: str | Path) -> bool:
    return (Path(path) / MODULES_FILE).is_file()


def is_classifier(architecture: str) -> bool:
    return architecture.endswith("ForSequenceClassification")


def has_lm_head(architecture: str) -> bool:
    """A transformers architecture that ends in a language-model head (generates text)."""
    return architecture.endswith(("ForCausalLM", "ForConditionalGeneration", "LMHeadModel"))


def _modules(path: Path) -> list[dict]:
    modules = _read_json(path / MODULES_FILE, MODULES_FILE)
    if not isinstance(modules, list) or not all(isinstance(m, dict) for m in modules):
        raise PoolingError(MODULES_FILE, "expected a list of modules")
    return sorted(modules, key=lambda m: m.get("idx", 0))


def _module_kind(module: dict) -> str:
    return str(module.get("type", "")).rsplit(".", 1)[-1]


def _pooling_mode(config: dict, where: str) -> str:
    mode = config.get("pooling_mode")
    if mode is None:
        active = [m for key, m in _LEGACY_MODE_KEYS.items() if config.get(key)]
        mode = active[0] if len(active) == 1 else active
    if isinstance(mode, list) and len(mode) == 1:
        mode = mode[0]
    if not isinstance(mode, str) or mode not in POOLING_MODES:
        raise PoolingError(f"{where} pooling_mode", f"{mode!r}: the pooling runner pools one of {list(POOLING_MODES)}")
    if config.get("include_prompt") is False:
        raise PoolingError(f"{where} include_prompt", "false (pooling without the prompt's tokens) is not supported")
    return mode


def _activation(path: Path, config: dict, st_config: dict, num_labels: int) -> str:
    """The activation CrossEncoder.predict applies (sentence-transformers 6.3's rule)."""
    source, dotted = ST_CONFIG_FILE + " activation_fn", st_config.get("activation_fn")
    if dotted is None:
        st_in_config = config.get("sentence_transformers")
        if isinstance(st_in_config, dict) and "activation_fn" in st_in_config:
            source, dotted = "config.json sentence_transformers.activation_fn", st_in_config["activation_fn"]
        elif config.get("sbert_ce_default_activation_function") is not None:
            source, dotted = "config.json sbert_ce_default_activation_function", config["sbert_ce_default_activation_function"]
    # sentence-transformers resolves only torch's own classes without trust_remote_code (and falls
    # back to the default for others); we do the same and refuse torch classes we do not apply
    if isinstance(dotted, str) and dotted.startswith("torch."):
        name = dotted.rsplit(".", 1)[-1]
        if name not in _ACTIVATIONS:
            raise PoolingError(source, f"{dotted!r}: supported activations are {sorted(_ACTIVATIONS)}")
        return _ACTIVATIONS[name]
    return "sigmoid" if num_labels == 1 else "identity"


def _max_model_len(path: Path, config: dict, sbert_config: dict) -> int:
    text = _text_config(config)
    positions = text.get("max_position_embeddings")
    if isinstance(positions, int) and text.get("model_type") == "xlm-roberta":
        # XLM-RoBERTa's positions start after its padding index
        positions -= int(text.get("pad_token_id", 1)) + 1
    limits = [positions] if isinstance(positions, int) and positions > 0 else []
    seq = sbert_config.get("max_seq_length")
    if isinstance(seq, int) and seq > 0:
        limits.append(seq)
    else:
        tokenizer_config = path / "tokenizer_config.json"
        if tokenizer_config.is_file():
            tok_len = _read_json(tokenizer_config, "tokenizer_config.json").get("model_max_length")
            # transformers writes a huge sentinel when the tokenizer has no limit
            if isinstance(tok_len, int) and 0 < tok_len < 1 << 30:
                limits.append(tok_len)
    if not limits:
        raise PoolingError("config.json max_position_embeddings", "the model states no longest input")
    return min(limits)


def _matryoshka(config: dict) -> tuple[tuple[int, ...] | None, bool]:
    dims = config.get("matryoshka_dimensions")
    if dims is not None:
        if not isinstance(dims, list) or not all(isinstance(d, int) and not isinstance(d, bool) and d > 0 for d in dims):
            raise PoolingError("config.json matryoshka_dimensions", f"{dims!r}: expected a list of positive integers")
        return tuple(dims), True
    return None, bool(config.get("is_matryoshka", False))


def read_pooling_spec(path: str | Path) -> PoolingSpec | None:
    """The folder's pooling model; None for a generation model (no modules.json, a language-model
    head). PoolingError naming the file/field for a pooling folder the runner cannot serve."""
    path = Path(path)
    config = _model_config(path)
    arch = _architecture(config)
    text = _text_config(config)
    model_type = str(text.get("model_type", config.get("model_type", "")))
    st_folder = is_sentence_transformers_folder(path)
    classifier = is_classifier(arch)
    if not st_folder and not classifier and (has_lm_head(arch) or not arch.endswith("Model")):
        return None
    st_config = _read_json(path / ST_CONFIG_FILE, ST_CONFIG_FILE) if (path / ST_CONFIG_FILE).is_file() else {}
    sbert_config = _read_json(path / SBERT_CONFIG_FILE, SBERT_CONFIG_FILE) if (path / SBERT_CONFIG_FILE).is_file() else {}
    if not isinstance(st_config, dict):
        raise PoolingError(ST_CONFIG_FILE, "expected a JSON object")
    if not isinstance(sbert_config, dict):
        raise PoolingError(SBERT_CONFIG_FILE, "expected a JSON object")
    prompts = st_config.get("prompts") or {}
    if not isinstance(prompts, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in prompts.items()):
        raise PoolingError(f"{ST_CONFIG_FILE} prompts", "expected an object of names to texts")
    default_prompt = st_config.get("default_prompt_name")
    if default_prompt is not None and default_prompt not in prompts:
        raise PoolingError(f"{ST_CONFIG_FILE} default_prompt_name", f"{default_prompt!r} is not one of the prompts")
    hidden = int(text.get("hidden_size", 0))
    max_len = _max_model_len(path, config, sbert_config)
    common = dict(prompts=dict(prompts), default_prompt_name=default_prompt, max_model_len=max_len,
                  architecture=arch, model_type=model_type)

    if classifier:
        if st_folder:
            kinds = [_module_kind(m) for m in _modules(path)]
            if kinds != [_ST_TRANSFORMER]:
                raise PoolingError(MODULES_FILE, f"a cross-encoder of modules {kinds}: only a Transformer is supported")
        num_labels = config.get("num_labels")
        if num_labels is None:
            num_labels = len(config.get("id2label") or {}) or 2  # transformers' default
        if not isinstance(num_labels, int) or num_labels < 1:
            raise PoolingError("config.json num_labels", f"{num_labels!r}: expected a positive integer")
        if model_type not in ENCODER_MODEL_TYPES:
            raise PoolingError("config.json architectures", f"{arch}: cross-encoders of the {list(ENCODER_MODEL_TYPES)} "
                                                            "families are served")
        return PoolingSpec(task="classify", pooling_mode="cls", normalize=False, hidden_size=hidden,
                           num_labels=num_labels, activation=_activation(path, config, st_config, num_labels), **common)

    if not st_folder:
        # a bare encoder (BertModel, XLMRobertaModel): sentence-transformers' own default for a
        # folder without modules.json is mean pooling, no Normalize
        mode, normalize = "mean", False
    else:
        modules = _modules(path)
        kinds = [_module_kind(m) for m in modules]
        if not kinds or kinds[0] != _ST_TRANSFORMER:
            raise PoolingError(MODULES_FILE, f"modules {kinds}: the first must be a Transformer")
        if modules[0].get("path", "") not in ("", "."):
            raise PoolingError(MODULES_FILE, f"the Transformer's path {modules[0].get('path')!r}: "
                                             "the transformer's weights must be the folder's root")
        if kinds[1:] not in ([_ST_POOLING], [_ST_POOLING, _ST_NORMALIZE]):
            raise PoolingError(MODULES_FILE, f"modules {kinds}: the pooling runner serves Transformer, Pooling "
                                             "and an optional Normalize")
        pooling_dir = path / str(modules[1].get("path", ""))
        pooling_config = _read_json(pooling_dir / "config.json", f"{modules[1].get('path')}/config.json")
        if not isinstance(pooling_config, dict):
            raise PoolingError(f"{modules[1].get('path')}/config.json", "expected a JSON object")
        mode = _pooling_mode(pooling_config, f"{modules[1].get('path')}/config.json")
        normalize = kinds[-1] == _ST_NORMALIZE
        dim = pooling_config.get("embedding_dimension", pooling_config.get("word_embedding_dimension"))
        if isinstance(dim, int) and dim > 0 and hidden and dim != hidden:
            raise PoolingError(f"{modules[1].get('path')}/config.json embedding_dimension",
                               f"{dim} differs from the model's hidden_size {hidden}")
        if sbert_config.get("transformer_task", "feature-extraction") != "feature-extraction":
            raise PoolingError(f"{SBERT_CONFIG_FILE} transformer_task",
                               f"{sbert_config['transformer_task']!r}: only feature-extraction is served")
    if not hidden:
        raise PoolingError("config.json hidden_size", "missing")
    dims, matryoshka = _matryoshka(config)
    if dims is not None and any(d > hidden for d in dims):
        raise PoolingError("config.json matryoshka_dimensions", f"{list(dims)}: above hidden_size {hidden}")
    return PoolingSpec(task="embed", pooling_mode=mode, normalize=normalize, hidden_size=hidden,
                       matryoshka_dimensions=dims, is_matryoshka=matryoshka, **common)


def resolve_runner(path: str | Path, runner: str = "auto") -> str:
    """`--runner auto|generate|pooling` for the model folder: "generate" or "pooling". auto picks
    pooling for a sentence-transformers folder or a model without a language-model head
    (BertModel, XLMRobertaModel, Qwen3Model, *ForSequenceClassification). PoolingError("--runner")
    for a runner the model cannot take."""
    if runner not in RUNNERS:
        raise PoolingError("--runner", f"{runner!r}: expected one of {list(RUNNERS)}")
    path = Path(path)
    config = _model_config(path)
    arch = _architecture(config)
    poolable = is_sentence_transformers_folder(path) or is_classifier(arch) or (arch.endswith("Model") and not has_lm_head(arch))
    if runner == "auto":
        return "pooling" if poolable else "generate"
    if runner == "generate":
        if poolable and not has_lm_head(arch):
            raise PoolingError("--runner", f"generate: {arch or 'the model'} has no language-model head "
                                           "(serve it with --runner pooling)")
        return "generate"
    # pooling: a generation model pools its final hidden states (last token, as vLLM's default)
    # only when a sentence-transformers folder says how; read_pooling_spec checks the rest
    if not poolable:
        raise PoolingError("--runner", f"pooling: {arch or 'the model'} is a generation model and the folder has "
                                       f"no {MODULES_FILE} saying how to pool it")
    return "pooling"
