"""Hugging Face names: `ORG/NAME`, `ORG/NAME:FILE.gguf` or `ORG/NAME:QUANT`, resolved into huggingface_hub's cache.

    <cache>/models--ORG--NAME/
        refs/<branch or tag>          the commit it points to
        snapshots/<commit>/<file>     the commit's files (links into blobs/)
        blobs/<hash>
        trees/<commit>.json           the commit's file listing (names, sizes), written when online

The cache is `HF_HUB_CACHE`, else `$HF_HOME/hub`, else `~/.cache/huggingface/hub`; `HF_TOKEN`
authenticates; `HF_HUB_OFFLINE=1` reads the cache only. All three are read at each call.

Only what a service needs is downloaded: config, generation config, tokenizer and chat-template
files, and for weights the index's shards (else the top-level `*.safetensors`) or the one GGUF
file. One resolution pins one commit: the first download resolves the revision, the later ones
ask for that commit. A GGUF repository (no config.json) takes a file name or a quantization tag
matched as llama.cpp's `-hf` does (case-insensitive, default Q4_K_M). Every failure is a
`HubError` whose message is one line naming the flag and, when the cache lacks something, the
cache folder.
"""

from __future__ import annotations

import glob
import logging
import os
import re
from dataclasses import dataclass
from pathlib import Path

log = logging.getLogger(__name__)

# Files a checkpoint's front end reads (scheduler_svc/tokenizer.py, transformers' AutoTokenizer);
# the sentence-transformers files are what --runner auto looks for (see the README).
METADATA_FILES = (
    "config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
    "added_tokens.json", "tokenizer.model", "vocab.json", "merges.txt", "chat_template.jinja", "chat_template.json",
    "vocab.txt", "sentencepiece.bpe.model",
    "modules.json", "config_sentence_transformers.json", "sentence_bert_config.json", "1_Pooling/config.json",
)
WEIGHTS_INDEX = "model.safetensors.index.json"
ADAPTER_FILES = ("adapter_config.json", "adapter_model.safetensors")
DEFAULT_GGUF_TAG = "Q4_K_M"  # llama.cpp's -hf default
_NAME = re.compile(r"(?P<repo_id>[A-Za-z0-9][\w.-]*/[\w.-]+)(?::(?P<file>[^:]+))?")
_SPLIT_GGUF = re.compile(r"-\d{5}-of-\d{5}\.gguf$", re.IGNORECASE)


class HubError(OSError):
    """A Hugging Face name that cannot be resolved; the message is one line that names the flag."""


@dataclass(frozen=True)
class HubName:
    """`ORG/NAME[:FILE]`; `file` is a GGUF file name (ends in .gguf) or a quantization tag."""

    repo_id: str
    file: str | None = None

    def __str__(self) -> str:
        return self.repo_id if self.file is None else f"{self.repo_id}:{self.file}"


def parse_hub_name(spec: str) -> HubName | None:
    """The Hugging Face name `spec` spells, or None (a path: absolute, ./, ~, or no ORG/ part)."""
    match = _NAME.fullmatch(spec)
    return None if match is None else HubName(match["repo_id"], match["file"])


def hub_cache_dir() -> Path:
    """huggingface_hub's cache folder, from the environment as it is now."""
    cache = os.environ.get("HF_HUB_CACHE") or os.environ.get("HUGGINGFACE_HUB_CACHE")
    if not cache:
        home = os.environ.get("HF_HOME") or os.path.join(
            os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "huggingface"
        )
        cache = os.path.join(home, "hub")
    return Path(os.path.expandvars(os.path.expanduser(cache)))


def is_offline() -> bool:
    value = os.environ.get("HF_HUB_OFFLINE") or os.environ.get("TRANSFORMERS_OFFLINE") or ""
    return value.strip().upper() in ("1", "ON", "YES", "TRUE")


def resolve_hub_model(name: HubName, revision: str | None = None, tokenizer_only: bool = False,
                      flag: str = "--model") -> Path:
    """The snapshot folder of a checkpoint, or the GGUF file the name picks, downloaded as needed.

    `tokenizer_only` (the scheduler): no safetensors weights are downloaded; a GGUF file is (its
    tokenizer is inside).
    """
    snapshot = _download(name, revision, [*METADATA_FILES, WEIGHTS_INDEX], flag)
    commit = snapshot.name
    files = repo_files(name.repo_id, snapshot)
    if name.file is None and (snapshot / "config.json").is_file():
        if not tokenizer_only:
            weights = _weight_files(name, snapshot, files, revision, flag)
            _download(name, commit, [glob.escape(f) for f in weights], flag)
            _require(snapshot, weights, name, flag)
        log.info("%s %s: revision %s, commit %s, in %s", flag, name, revision or "main", commit, snapshot)
        return snapshot
    gguf = pick_gguf(name, files, revision, flag)
    _download(name, commit, [glob.escape(gguf)], flag)
    _require(snapshot, [gguf], name, flag)
    log.info("%s %s: %s of revision %s, commit %s, in %s", flag, name, gguf, revision or "main", commit, snapshot)
    return snapshot / gguf


def resolve_adapter(spec: str, revision: str | None = None, flag: str = "--lora-modules") -> Path:
    """A PEFT LoRA folder (adapter_config.json + adapter_model.safetensors): a local folder that
    exists, else a Hugging Face name (`ORG/ADAPTER`) downloaded into the cache."""
    path = Path(spec).expanduser()
    name = None if path.exists() else parse_hub_name(spec)
    if not path.exists() and (name is None or name.file is not None):
        raise HubError(f"{flag} {spec}: no such local folder, and not a Hugging Face name ORG/ADAPTER")
    if name is None:
        folder, where = path, "a local folder"
    else:
        folder = _download(name, revision, list(ADAPTER_FILES), flag)
        where = f"revision {revision or 'main'} (commit {folder.name}) in {hub_cache_dir()}"
    missing = [f for f in ADAPTER_FILES if not (folder / f).is_file()]
    if missing:
        raise HubError(f"{flag} {spec}: {where} without {' and '.join(missing)} (a PEFT LoRA adapter has both)")
    return folder


def pick_gguf(name: HubName, files: dict[str, int | None], revision: str | None, flag: str = "--model") -> str:
    """The one GGUF file of `files` that `name.file` names (a file) or tags (case-insensitive,
    as a whole word of the file name; no tag: Q4_K_M, else the repository's only model file).
    mmproj files (vision projectors) are never a tag's match."""
    ggufs = sorted(f for f in files if f.lower().endswith(".gguf"))
    models = [f for f in ggufs if "mmproj" not in f.rsplit("/", 1)[-1].lower()]
    at = f"at revision {revision or 'main'}"
    if not ggufs:
        what = "no .gguf file" if name.file else "neither config.json nor a .gguf file"
        raise HubError(f"{flag} {name}: the repository has {what} {at} (files: {_listed(files)})")
    wanted = name.file or DEFAULT_GGUF_TAG
    if wanted.lower().endswith(".gguf"):
        matches = [f for f in ggufs if f == wanted] or [f for f in ggufs if f.rsplit("/", 1)[-1] == wanted]
        what = f"file {wanted}"
    else:
        tag = re.compile(rf"(?<![A-Za-z0-9]){re.escape(wanted)}(?![A-Za-z0-9_])", re.IGNORECASE)
        matches = [f for f in models if tag.search(f.rsplit("/", 1)[-1][: -len(".gguf")])]
        if name.file is None and not matches and len(models) == 1:
            matches = models
        what = f"quantization {wanted}" + ("" if name.file else " (the default; name one: ORG/NAME:QUANT)")
    if len(matches) == 1:
        return matches[0]
    if not matches:
        raise HubError(f"{flag} {name}: no GGUF file matches the {what} {at}; its GGUF files: {_listed(ggufs)}")
    split = " (one split model: Pagoda reads one file; merge it with llama-gguf-split --merge)" if all(
        _SPLIT_GGUF.search(f) for f in matches) else "; name one as ORG/NAME:FILE.gguf"
    raise HubError(f"{flag} {name}: {len(matches)} GGUF files match the {what} {at}: {_listed(matches)}{split}")


def repo_files(repo_id: str, snapshot: Path) -> dict[str, int | None]:
    """The commit's files and sizes: the cached listing (written when online), else what the snapshot holds."""
    from huggingface_hub import get_cached_repo_tree
    from huggingface_hub.errors import CachedRepoTreeNotFoundError

    try:
        return {f.path: f.size for f in get_cached_repo_tree(repo_id, revision=snapshot.name,
                                                            cache_dir=snapshot.parent.parent.parent)}
    except CachedRepoTreeNotFoundError:
        pass
    if not snapshot.is_dir():
        return {}
    return {p.relative_to(snapshot).as_posix(): p.stat().st_size for p in sorted(snapshot.rglob("*")) if p.is_file()}


def listed_weights(model_dir: Path) -> dict[str, int]:
    """A hub snapshot's top-level *.safetensors and sizes from the cached listing, downloaded or not
    ({} for any other folder): the scheduler, which downloads no weights, fingerprints them too."""
    model_dir = Path(model_dir)
    repo = model_dir.parent.parent
    if model_dir.parent.name != "snapshots" or not repo.name.startswith("models--"):
        return {}
    repo_id = repo.name.removeprefix("models--").replace("--", "/")
    try:
        files = repo_files(repo_id, model_dir)
    except (OSError, ValueError):
        return {}
    return {f: size for f, size in files.items() if "/" not in f and f.endswith(".safetensors") and size is not None}


def _weight_files(name: HubName, snapshot: Path, files: dict[str, int | None], revision, flag: str) -> list[str]:
    index = snapshot / WEIGHTS_INDEX
    if index.is_file():
        import json

        return sorted(set(json.loads(index.read_text())["weight_map"].values()))
    weights = sorted(f for f in files if "/" not in f and f.endswith(".safetensors"))
    if not weights:
        raise HubError(f"{flag} {name}: config.json but no *.safetensors weights at revision {revision or 'main'} "
                       f"(files: {_listed(files)})")
    return weights


def _require(snapshot: Path, files: list[str], name: HubName, flag: str) -> None:
    """The files a download should have left in the snapshot (offline, with no cached listing, it checks none)."""
    missing = [f for f in files if not (snapshot / f).is_file()]
    if missing:
        why = "HF_HUB_OFFLINE is set: nothing is downloaded" if is_offline() else "the download left them out"
        raise HubError(f"{flag} {name}: the cached snapshot {snapshot} lacks {_listed(missing)} ({why})")


def _download(name: HubName, revision: str | None, patterns: list[str], flag: str) -> Path:
    """snapshot_download of `patterns` (offline: the cached snapshot); huggingface_hub's errors as HubError."""
    import httpx2
    from huggingface_hub import snapshot_download

    try:
        return Path(snapshot_download(
            name.repo_id, revision=revision, allow_patterns=patterns, cache_dir=hub_cache_dir(),
            local_files_only=is_offline(),
        ))
    except (OSError, ValueError, httpx2.HTTPError) as exc:
        raise _hub_error(exc, name, revision, flag) from None


def _hub_error(exc: Exception, name: HubName, revision: str | None, flag: str) -> HubError:
    from huggingface_hub.errors import (
        HFValidationError, IncompleteSnapshotError, LocalEntryNotFoundError, RepositoryNotFoundError,
        RevisionNotFoundError,
    )

    cache = hub_cache_dir()
    repo = cache / f"models--{name.repo_id.replace('/', '--')}"
    rev = revision or "main"
    if isinstance(exc, HFValidationError):
        return HubError(f"{flag} {name}: no such local path, and not a valid Hugging Face name ({_one_line(exc)})")
    if isinstance(exc, RevisionNotFoundError):
        return HubError(f"--revision {rev}: the Hub's {name.repo_id} has no such branch, tag or commit")
    if isinstance(exc, RepositoryNotFoundError):
        return HubError(f"{flag} {name}: no such local path, and the Hugging Face Hub has no such repository, or it is "
                        "private or gated (set HF_TOKEN to a token that may read it)")
    if isinstance(exc, IncompleteSnapshotError):
        missing = _one_line(exc).split(": ", 1)[-1]
        return HubError(f"{flag} {name}: the cached snapshot in {repo} is incomplete ({missing})")
    if isinstance(exc, LocalEntryNotFoundError):
        why = "HF_HUB_OFFLINE is set: nothing is downloaded" if is_offline() else "the Hub could not be reached"
        if repo.is_dir():
            cached = [p.name for folder in ("refs", "snapshots") for p in sorted((repo / folder).glob("*"))]
            return HubError(f"--revision {rev}: {name.repo_id} is in the Hugging Face cache {cache} but not at {rev} "
                            f"(cached: {', '.join(cached) or 'nothing'}; {why})")
        return HubError(f"{flag} {name}: no such local path, and not in the Hugging Face cache {cache} ({why})")
    return HubError(f"{flag} {name}: {_one_line(exc)}")


def _listed(names, limit: int = 20) -> str:
    names = list(names)
    more = f", ... ({len(names) - limit} more)" if len(names) > limit else ""
    return (", ".join(names[:limit]) or "none") + more


def _one_line(exc: Exception, limit: int = 300) -> str:
    text = " ".join(str(exc).split())
    return text if len(text) <= limit else text[: limit - 3] + "..."
