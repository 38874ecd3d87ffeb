"""A huggingface_hub cache folder written by hand, as downloads leave it (no network in the tests):

    <cache>/models--ORG--NAME/refs/<ref>               the commit, no newline
    <cache>/models--ORG--NAME/snapshots/<commit>/<f>   a relative link to ../../blobs/<hash>
    <cache>/models--ORG--NAME/blobs/<hash>             the content (or a link to a large file)
    <cache>/models--ORG--NAME/trees/<commit>.json      the commit's listing (only with `write_listing`)
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path


def repo_folder(cache: Path, repo_id: str) -> Path:
    return Path(cache) / f"models--{repo_id.replace('/', '--')}"


def write_snapshot(cache: Path, repo_id: str, commit: str, files: dict[str, bytes | str | Path],
                   refs: tuple[str, ...] = ("main",)) -> Path:
    """The snapshot folder of `commit` holding `files` (bytes or text; a Path: the blob links to
    that file), with each of `refs` pointing to it."""
    repo = repo_folder(cache, repo_id)
    (repo / "blobs").mkdir(parents=True, exist_ok=True)
    snapshot = repo / "snapshots" / commit
    for name, content in files.items():
        link = snapshot / name
        link.parent.mkdir(parents=True, exist_ok=True)
        if isinstance(content, Path):
            blob = repo / "blobs" / hashlib.sha256(str(content.resolve()).encode()).hexdigest()
            if not blob.exists():
                blob.symlink_to(content.resolve())
        else:
            data = content.encode() if isinstance(content, str) else content
            blob = repo / "blobs" / hashlib.sha256(data).hexdigest()
            blob.write_bytes(data)
        link.symlink_to(os.path.relpath(blob, link.parent))
    snapshot.mkdir(parents=True, exist_ok=True)
    (repo / "refs").mkdir(exist_ok=True)
    for ref in refs:
        (repo / "refs" / ref).write_text(commit)
    return snapshot


def write_listing(cache: Path, repo_id: str, commit: str, sizes: dict[str, int]) -> None:
    """The commit's file listing, as a download writes it (format_version 1 of huggingface_hub's tree cache)."""
    trees = repo_folder(cache, repo_id) / "trees"
    trees.mkdir(parents=True, exist_ok=True)
    files = {path: {"size": size, "blob_id": hashlib.sha1(path.encode()).hexdigest()} for path, size in sizes.items()}
    (trees / f"{commit}.json").write_text(json.dumps({"format_version": 1, "files": files}))
