"""The `pagoda` command line (`python -m pagoda`) against the real service."""

from __future__ import annotations

import importlib
import json
import os
import subprocess
import sys
import time
import tomllib

import pytest

from pagoda.client import Client
from tests.client.services import EXECUTOR_ARGS, target
from tests.service.harness import ROOT, Service, free_port

pytestmark = pytest.mark.timeout(600)


@pytest.fixture(scope="module")
def svc():
    with Service(executor_args=EXECUTOR_ARGS) as service:
        yield service


def pagoda(*args: str, stdin: str = "", env: dict | None = None) -> subprocess.CompletedProcess:
    env = {**{k: v for k, v in os.environ.items() if not k.startswith("PAGODA_")}, **(env or {})}
    return subprocess.run([sys.executable, "-m", "pagoda", *args], cwd=ROOT, input=stdin, capture_output=True,
                          text=True, timeout=300, env=env)


def test_the_console_script_is_declared_and_resolves():
    scripts = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["scripts"]
    module, _, func = scripts["pagoda"].partition(":")
    assert callable(getattr(importlib.import_module(module), func))


def test_generate_prints_the_stream_and_reads_pagoda_target(svc):
    with Client(target(svc)) as c:
        want = c.generate("The sky is", max_tokens=12, temperature=0.0).collect()
    run = pagoda("generate", "The sky is", "--max-tokens", "12", "--temperature", "0", "--usage",
                 env={"PAGODA_TARGET": target(svc)})
    assert run.returncode == 0, run.stderr
    assert run.stdout == want.text + "\n"
    assert f"+ {want.usage.completion_tokens} generated tokens" in run.stderr


def test_generate_json_chunks_and_stop(svc):
    run = pagoda("generate", "Count: one, two,", "--max-tokens", "20", "--temperature", "0", "--stop", "five",
                 "--json", "--target", target(svc))
    assert run.returncode == 0, run.stderr
    chunks = [json.loads(line) for line in run.stdout.splitlines()]
    assert all(set(c) >= {"index", "text", "token_ids", "finish_reason"} for c in chunks)
    assert chunks[-1]["finish_reason"] == "stop_sequence" and chunks[-1]["matched_stop"] == "five"
    assert "five" not in "".join(c["text"] for c in chunks)


def test_chat_keeps_the_history(svc):
    first, second = "My name is Ada.", "What is my name?"
    with Client(target(svc)) as c:
        a1 = c.chat([("user", first)], max_tokens=24, temperature=0.0).collect().text
        a2 = c.chat([("user", first), ("assistant", a1), ("user", second)], max_tokens=24,
                    temperature=0.0).collect().text
    run = pagoda("chat", "--max-tokens", "24", "--temperature", "0", "--target", target(svc),
                 stdin=f"{first}\n{second}\n/exit\n")
    assert run.returncode == 0, run.stderr
    assert run.stdout == f"{a1}\n{a2}\n"


def test_info_shows_model_and_executors(svc):
    run = pagoda("info", "--target", target(svc))
    assert run.returncode == 0, run.stderr
    info = svc.server_info()
    assert "SmolLM2" in run.stdout and info.executors[0].executor_id in run.stdout
    assert str(info.executors[0].num_total_blocks) in run.stdout


def test_errors_are_reported_with_their_status(svc):
    run = pagoda("generate", "hi", "--top-p", "1.5", "--target", target(svc))
    assert run.returncode == 1 and "INVALID_ARGUMENT: sampling.top_p" in run.stderr


def test_bench_runs_the_load_generator(svc, tmp_path):
    out = tmp_path / "bench.json"
    run = pagoda("bench", "--target", target(svc), "--num-requests", "2", "--prompt-len", "16", "--output-len", "4",
                 "--warmup", "0", "--no-plot", "--out", str(out))
    assert run.returncode == 0, run.stderr
    assert "tokens/s" in run.stdout
    assert json.loads(out.read_text())["summary"]


def test_nothing_listening_fails_at_once_with_one_line_naming_the_target():
    """Before: 40 s of silent retries, then UNAVAILABLE. Now: --connect-timeout (3 s), one line."""
    dead = f"127.0.0.1:{free_port()}"
    start = time.monotonic()
    pagoda("--help")
    startup = time.monotonic() - start  # the interpreter's start-up, measured beside it
    for command in (["info"], ["generate", "hi"]):
        start = time.monotonic()
        run = pagoda(*command, "--target", dead, "--connect-timeout", "1")
        took = time.monotonic() - start
        assert run.returncode == 1 and run.stdout == ""
        assert run.stderr.count("\n") == 1 and dead in run.stderr and "cannot connect" in run.stderr, run.stderr
        assert took < 2 * startup + 1 + 5, (took, startup)  # the retries alone took 40 s


def test_chat_sends_image_files_with_the_first_message(tmp_path):
    """`pagoda chat --image FILE`: the first message's parts are the image (a data: URL of the file) then its text."""
    import base64

    from tests.client.keyed_server import KEY, KeyedServicer, insecure_keyed_server

    class Recording(KeyedServicer):
        requests = []

        def Generate(self, request, context):
            self.requests.append(request)
            yield from super().Generate(request, context)

    image = tmp_path / "cat.png"
    image.write_bytes(b"\x89PNG not really")
    servicer = Recording()
    with insecure_keyed_server(servicer) as address:
        run = pagoda("chat", "--image", str(image), "--target", address, "--api-key", KEY, stdin="What is it?\nAnd now?\n")
        missing = pagoda("chat", "--image", str(tmp_path / "absent.png"), "--target", address, "--api-key", KEY, stdin="hi\n")
    assert run.returncode == 0, run.stderr
    first, second = (r.chat.messages for r in servicer.requests)
    assert [(p.WhichOneof("kind"), p.text or p.image.url) for p in first[0].parts] == [
        ("image", "data:image/png;base64," + base64.b64encode(b"\x89PNG not really").decode()), ("text", "What is it?")]
    assert list(second[0].parts) == list(first[0].parts) and second[-1].content == "And now?"
    assert missing.returncode == 2 and "absent.png" in missing.stderr
