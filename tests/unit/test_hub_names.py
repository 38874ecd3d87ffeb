"""`--model ORG/NAME[:FILE.gguf|:QUANT]` and adapters by name, from a huggingface_hub cache written by hand
(`tests/hub_cache.py`; offline: nothing is fetched)."""

from __future__ import annotations

import json

import huggingface_hub
import pytest

from pagoda import hub, model_files
from tests.hub_cache import write_listing, write_snapshot

C1, C2, C3 = "1" * 40, "2" * 40, "3" * 40
CONFIG = json.dumps({"model_type": "llama", "vocab_size": 32})
META = {"config.json": CONFIG, "tokenizer.json": "{}", "tokenizer_config.json": "{}"}


@pytest.fixture
def cache(tmp_path, monkeypatch):
    """HF_HOME in tmp_path, offline; the hub cache folder under it."""
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.delenv("HF_HUB_CACHE", raising=False)
    monkeypatch.delenv("HUGGINGFACE_HUB_CACHE", raising=False)
    monkeypatch.chdir(tmp_path)
    return tmp_path / "hf" / "hub"


@pytest.fixture
def downloads(monkeypatch):
    """The allow_patterns of every snapshot_download call (the real one runs)."""
    calls = []
    real = huggingface_hub.snapshot_download

    def recording(repo_id, **kw):
        calls.append(list(kw["allow_patterns"]))
        return real(repo_id, **kw)

    monkeypatch.setattr(huggingface_hub, "snapshot_download", recording)
    return calls


def two_revisions(cache):
    """org/tiny: main and v1 at C1, v2 at C2 (another config)."""
    first = write_snapshot(cache, "org/tiny", C1, {**META, "model.safetensors": b"w" * 10}, refs=("main", "v1"))
    second = write_snapshot(cache, "org/tiny", C2, {**META, "config.json": CONFIG.replace("32", "64"),
                                                    "model.safetensors": b"w" * 12}, refs=("v2",))
    return first, second


def test_a_name_resolves_to_the_snapshot_main_points_to(cache):
    first, _ = two_revisions(cache)
    assert model_files.resolve_model("org/tiny", weights=False) == first
    assert model_files.resolve_model("org/tiny", weights=False, tokenizer_only=True) == first
    assert model_files.model_name("org/tiny") == "org/tiny"  # served as vLLM serves it


def test_revision_picks_a_branch_or_tag_or_a_commit(cache):
    first, second = two_revisions(cache)
    assert model_files.resolve_model("org/tiny", weights=False, revision="v2") == second
    assert model_files.resolve_model("org/tiny", weights=False, revision=C2) == second
    assert model_files.resolve_model("org/tiny", weights=False, revision="v1") == first
    assert model_files.fingerprint(first) != model_files.fingerprint(second)


def test_an_unknown_revision_is_one_line_naming_the_flag_and_what_is_cached(cache):
    two_revisions(cache)
    with pytest.raises(model_files.HubError) as error:
        model_files.resolve_model("org/tiny", weights=False, revision="v9")
    message = str(error.value)
    assert message.startswith("--revision v9: org/tiny is in the Hugging Face cache")
    assert str(cache) in message and all(name in message for name in ("main", "v1", "v2", C1, C2))
    assert "\n" not in message


def test_a_missing_model_is_one_line_naming_the_cache_and_the_flag(cache):
    with pytest.raises(model_files.HubError) as error:
        model_files.resolve_model("org/absent", weights=False)
    message = str(error.value)
    assert message == (f"--model org/absent: no such local path, and not in the Hugging Face cache {cache} "
                       "(HF_HUB_OFFLINE is set: nothing is downloaded)")


@pytest.mark.parametrize("service", ["scheduler_svc", "executor_svc"])
def test_a_service_given_a_missing_model_exits_with_that_line(service, cache, capsys):
    if service == "scheduler_svc":
        from scheduler_svc.__main__ import main

        argv = ["--insecure-executor-link", "--port", "0", "--metrics-port", "0"]
    else:
        from executor_svc.__main__ import main

        argv = ["--device", "cpu"]
    assert main(["--model", "org/absent", *argv]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1] == (f"{service}: error: --model org/absent: no such local path, and not in the Hugging Face cache "
                       f"{cache} (HF_HUB_OFFLINE is set: nothing is downloaded)")
    assert not any("Traceback" in line for line in err)


def test_a_local_path_that_exists_wins_over_the_name(cache):
    two_revisions(cache)
    local = cache.parent.parent / "org" / "tiny"  # ./org/tiny, the same spelling as the hub name
    local.mkdir(parents=True)
    (local / "config.json").write_text(CONFIG)
    assert model_files.resolve_model("org/tiny", weights=False).resolve() == local.resolve()
    assert model_files.model_name("org/tiny") == "tiny"


def test_the_scheduler_downloads_no_weights_and_the_executor_only_the_index_shards(cache, downloads):
    shards = ["model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"]
    index = json.dumps({"weight_map": {"a.weight": shards[0], "b.weight": shards[1]}})
    files = {**META, "model.safetensors.index.json": index, shards[0]: b"a", shards[1]: b"b",
             "consolidated.safetensors": b"ab", "original/model.safetensors": b"ab"}
    snapshot = write_snapshot(cache, "org/sharded", C1, files)

    assert model_files.resolve_model("org/sharded", weights=False, tokenizer_only=True) == snapshot
    assert len(downloads) == 1 and not any(p.endswith((".safetensors", ".gguf")) for p in downloads[0])
    assert "config.json" in downloads[0] and "tokenizer.json" in downloads[0]

    downloads.clear()
    assert model_files.resolve_model("org/sharded", weights=False) == snapshot
    assert downloads[1] == shards


def test_without_an_index_the_top_level_safetensors_are_the_weights(cache, downloads):
    write_snapshot(cache, "org/flat", C1, {**META, "model.safetensors": b"w", "original/other.safetensors": b"x"})
    model_files.resolve_model("org/flat", weights=False)
    assert downloads[1] == ["model.safetensors"]


def test_the_scheduler_fingerprints_weights_it_did_not_download(cache, tmp_path):
    """With the commit's listing cached (a download writes it), a snapshot without its weights
    (the scheduler's) and with them (the executor's) have the fingerprint of a local copy."""
    scheduler_view = write_snapshot(cache, "org/tiny", C1, META)
    write_listing(cache, "org/tiny", C1, {"config.json": len(CONFIG), "model.safetensors": 10})
    local = tmp_path / "copy"
    local.mkdir()
    (local / "config.json").write_text(CONFIG)
    (local / "model.safetensors").write_bytes(b"w" * 10)
    assert model_files.fingerprint(scheduler_view) == model_files.fingerprint(local)
    executor_view = write_snapshot(cache, "org/tiny", C1, {"model.safetensors": b"w" * 10})
    assert model_files.fingerprint(executor_view) == model_files.fingerprint(local)
    (local / "model.safetensors").write_bytes(b"w" * 11)
    assert model_files.fingerprint(scheduler_view) != model_files.fingerprint(local)


def test_an_offline_snapshot_without_its_weights_is_one_line_naming_them(cache):
    write_snapshot(cache, "org/tiny", C1, META)
    write_listing(cache, "org/tiny", C1, {**{name: len(text) for name, text in META.items()}, "model.safetensors": 10})
    assert model_files.resolve_model("org/tiny", weights=False, tokenizer_only=True).name == C1
    with pytest.raises(model_files.HubError) as error:
        model_files.resolve_model("org/tiny", weights=False)
    message = str(error.value)
    assert message.startswith("--model org/tiny: the cached snapshot") and "model.safetensors" in message
    assert str(cache) in message and "\n" not in message


GGUF_FILES = ["tiny-Q4_K_M.gguf", "tiny-Q8_0.gguf", "tiny-IQ4_XS.gguf", "mmproj-tiny-Q8_0.gguf"]


@pytest.mark.parametrize("spec, picked", [
    ("org/tiny-GGUF:tiny-Q8_0.gguf", "tiny-Q8_0.gguf"),
    ("org/tiny-GGUF:mmproj-tiny-Q8_0.gguf", "mmproj-tiny-Q8_0.gguf"),  # named, even a projector
    ("org/tiny-GGUF:q4_k_m", "tiny-Q4_K_M.gguf"),  # case-insensitive
    ("org/tiny-GGUF:Q8_0", "tiny-Q8_0.gguf"),  # not the mmproj file
    ("org/tiny-GGUF:iq4_xs", "tiny-IQ4_XS.gguf"),
    ("org/tiny-GGUF", "tiny-Q4_K_M.gguf"),  # llama.cpp's default tag
])
def test_a_gguf_file_name_or_quantization_tag_picks_one_file(cache, downloads, spec, picked):
    snapshot = write_snapshot(cache, "org/tiny-GGUF", C1, {name: b"GGUF" + name.encode() for name in GGUF_FILES})
    name = hub.parse_hub_name(spec)
    assert hub.resolve_hub_model(name, tokenizer_only=True) == snapshot / picked
    assert downloads[-1] == [picked]


@pytest.mark.parametrize("files, spec, expected", [
    (GGUF_FILES, "org/r:Q4_K", "no GGUF file matches the quantization Q4_K at revision main; its GGUF files: "
     + ", ".join(sorted(GGUF_FILES))),  # Q4_K is not Q4_K_M
    (GGUF_FILES, "org/r:Q5_K_M", "no GGUF file matches the quantization Q5_K_M"),
    (GGUF_FILES, "org/r:tiny-Q5_K_M.gguf", "no GGUF file matches the file tiny-Q5_K_M.gguf"),
    (["a-Q4_K_M.gguf", "b-Q4_K_M.gguf", "a-Q8_0.gguf"], "org/r:Q4_K_M",
     "2 GGUF files match the quantization Q4_K_M at revision main: a-Q4_K_M.gguf, b-Q4_K_M.gguf; name one as "
     "ORG/NAME:FILE.gguf"),
    (["a-Q8_0.gguf", "b-Q8_0.gguf"], "org/r", "no GGUF file matches the quantization Q4_K_M (the default; "
     "name one: ORG/NAME:QUANT) at revision main; its GGUF files: a-Q8_0.gguf, b-Q8_0.gguf"),
    (["Q4_K_M/m-Q4_K_M-00001-of-00002.gguf", "Q4_K_M/m-Q4_K_M-00002-of-00002.gguf"], "org/r:Q4_K_M",
     "merge it with llama-gguf-split --merge"),
    (["README.md"], "org/r", "the repository has neither config.json nor a .gguf file at revision main "
     "(files: README.md)"),
])
def test_no_or_several_gguf_matches_are_one_line_listing_the_candidates(cache, files, spec, expected):
    write_snapshot(cache, "org/r", C1, {name: b"GGUF" for name in files})
    with pytest.raises(model_files.HubError) as error:
        model_files.resolve_model(spec, weights=False)
    message = str(error.value)
    assert message.startswith(f"--model {spec}: ") and expected in message and "\n" not in message


def test_a_lone_gguf_file_is_the_default_when_no_file_has_the_default_tag(cache):
    snapshot = write_snapshot(cache, "org/one", C1, {"one-Q8_0.gguf": b"GGUF", "mmproj-one-f16.gguf": b"GGUF"})
    assert hub.resolve_hub_model(hub.parse_hub_name("org/one")) == snapshot / "one-Q8_0.gguf"


def test_a_gguf_name_resolves_to_the_same_model_as_that_file(cache):
    """The default model's GGUF file in the cache as org/smol-GGUF at v1 (main lacks it): the
    name with --revision v1 gives the metadata folder, and fingerprint, of the file itself."""
    gguf = model_files.default_gguf_path()  # SmolLM2-135M-Instruct.Q4_1.gguf
    write_snapshot(cache, "org/smol-GGUF", C1, {"smol-Q8_0.gguf": b"GGUF", gguf.name: gguf}, refs=("v1",))
    write_snapshot(cache, "org/smol-GGUF", C2, {"smol-Q8_0.gguf": b"GGUF"})
    with pytest.raises(model_files.HubError, match="no GGUF file matches the quantization Q4_1 at revision main"):
        model_files.resolve_model("org/smol-GGUF:Q4_1", weights=False)
    model_dir = model_files.resolve_model("org/smol-GGUF:Q4_1", weights=False, revision="v1")
    assert model_files.fingerprint(model_dir) == model_files.fingerprint(model_files.resolve_model(None, weights=False))
    assert model_files.gguf_source(model_dir).read_bytes()[:4] == b"GGUF"


ADAPTER = {"adapter_config.json": json.dumps({"peft_type": "LORA", "r": 4}), "adapter_model.safetensors": b"lora"}


def test_an_adapter_name_resolves_to_its_snapshot_with_only_its_two_files(cache, downloads):
    first = write_snapshot(cache, "org/lora", C1, {**ADAPTER, "README.md": "card"})
    second = write_snapshot(cache, "org/lora", C3, ADAPTER, refs=("v2",))
    assert model_files.resolve_adapter("org/lora") == first
    assert downloads == [["adapter_config.json", "adapter_model.safetensors"]]
    assert model_files.resolve_adapter("org/lora", revision="v2") == second


def test_an_adapter_without_its_weights_or_missing_names_the_flag(cache):
    write_snapshot(cache, "org/half", C1, {"adapter_config.json": "{}"})
    with pytest.raises(model_files.HubError) as error:
        model_files.resolve_adapter("org/half")
    assert str(error.value) == (f"--lora-modules org/half: revision main (commit {C1}) in {cache} without "
                                "adapter_model.safetensors (a PEFT LoRA adapter has both)")
    with pytest.raises(model_files.HubError) as error:
        model_files.resolve_adapter("org/absent")
    assert str(error.value).startswith("--lora-modules org/absent: no such local path, and not in the Hugging Face "
                                       f"cache {cache}")
    with pytest.raises(model_files.HubError) as error:
        model_files.resolve_adapter("./absent")
    assert str(error.value) == "--lora-modules ./absent: no such local folder, and not a Hugging Face name ORG/ADAPTER"


def test_a_local_adapter_folder_wins_over_the_name(cache):
    write_snapshot(cache, "org/lora", C1, ADAPTER)
    local = cache.parent.parent / "org" / "lora"
    local.mkdir(parents=True)
    for name, content in ADAPTER.items():
        (local / name).write_bytes(content.encode() if isinstance(content, str) else content)
    assert model_files.resolve_adapter("org/lora").resolve() == local.resolve()
    (local / "adapter_model.safetensors").unlink()
    with pytest.raises(model_files.HubError, match="^--lora-modules org/lora: a local folder without "
                       "adapter_model.safetensors"):
        model_files.resolve_adapter("org/lora")


@pytest.mark.parametrize("spec, parsed", [
    ("org/name", ("org/name", None)), ("Org-1/Name_2.5:Q4_K_M", ("Org-1/Name_2.5", "Q4_K_M")),
    ("org/name:sub/file.gguf", ("org/name", "sub/file.gguf")),
    ("/abs/path", None), ("./rel/path", None), ("~/model", None), ("model.gguf", None), ("a/b/c", None),
])
def test_what_reads_as_a_hugging_face_name(spec, parsed):
    name = hub.parse_hub_name(spec)
    assert (None if name is None else (name.repo_id, name.file)) == parsed


@pytest.mark.parametrize("service", ["scheduler_svc", "executor_svc"])
def test_both_services_take_revision_and_read_pagoda_revision(service, monkeypatch):
    if service == "scheduler_svc":
        from scheduler_svc.__main__ import parse_args
    else:
        from executor_svc.__main__ import parse_args
    monkeypatch.delenv("PAGODA_REVISION", raising=False)
    assert parse_args([]).revision is None
    assert parse_args(["--revision", "v2"]).revision == "v2"
    monkeypatch.setenv("PAGODA_REVISION", C1)
    assert parse_args([]).revision == C1
