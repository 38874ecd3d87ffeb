"""Hostile but well-formed requests and peers (issue #16), against real processes on a tiny model.

Every bad request gets its status, naming the field, before any work; the event loop never
freezes on a huge prompt; beam search never crash-loops an executor; start-up failures are
one clear line; executors outlive a scheduler restart without reloading their model.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time

import grpc
import pytest

from pagoda.v1 import generation_pb2 as pb
from tests.service.harness import ROOT, Service, collect, free_port, frozen_client_heap, greedy_request
from tests.service.test_tiny_models import build_tiny

VOCAB = 49152  # the tiny model's, as the default model's
MAX_MODEL_LEN = 1024


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory, default_model_dir):
    path = tmp_path_factory.mktemp("tiny-robust")
    build_tiny("llama", path, default_model_dir, shard=False)
    return path


@pytest.fixture(scope="module")
def svc(tiny_dir):
    with Service(model=str(tiny_dir), executor_args=["--num-kv-blocks", "256"]) as service:
        yield service


def _code(call) -> tuple[grpc.StatusCode, str]:
    try:
        call()
    except grpc.RpcError as exc:
        return exc.code(), exc.details()
    return grpc.StatusCode.OK, ""


def _canary(svc) -> list[int]:
    result = collect(svc.stub.Generate(greedy_request(prompt_ids=[1, 500, 600, 700], max_tokens=12, ignore_eos=True), timeout=60))
    return result["outputs"][0]["token_ids"]


def _req(**fields) -> pb.GenerateRequest:
    req = greedy_request(prompt_ids=[1, 2000, 3000], max_tokens=4)
    for path, value in fields.items():
        target = req
        *parents, leaf = path.split("__")
        for parent in parents:
            target = getattr(target, parent)
        if value is None:
            target.ClearField(leaf)
        elif isinstance(value, dict):
            getattr(target, leaf).update(value)
        elif isinstance(value, list):
            getattr(target, leaf).extend(value)
        else:
            setattr(target, leaf, value)
    return req


BAD = {
    "request_id 1 MB": (_req(request_id="x" * 1_000_000), "request_id"),
    "stop string 1 MB": (_req(stopping__stop=["y" * 1_000_000]), "stopping.stop[0]"),
    "17 stop strings": (_req(stopping__stop=[f"s{i}" for i in range(17)]), "stopping.stop"),
    "every id a stop token": (_req(stopping__stop_token_ids=list(range(VOCAB))), "stopping.stop_token_ids"),
    "beam search, every id a stop token": (
        _req(sampling__beam_width=2, stopping__stop_token_ids=list(range(VOCAB))), "stopping.stop_token_ids"),
    "logit_bias of every id": (_req(sampling__temperature=1.0, sampling__logit_bias={i: 1.0 for i in range(VOCAB)}), "sampling.logit_bias"),
    "logit_bias 1e30": (_req(sampling__temperature=1.0, sampling__logit_bias={5: 1e30}), "sampling.logit_bias"),
    "temperature +inf": (_req(sampling__temperature=float("inf")), "sampling.temperature"),
    "temperature nan": (_req(sampling__temperature=float("nan")), "sampling.temperature"),
    "repetition_penalty +inf": (_req(sampling__repetition_penalty=float("inf")), "sampling.repetition_penalty"),
    "top_p -inf": (_req(sampling__top_p=float("-inf")), "sampling.top_p"),
    "min_p nan": (_req(sampling__min_p=float("nan")), "sampling.min_p"),
    "presence_penalty -inf": (_req(sampling__presence_penalty=float("-inf")), "sampling.presence_penalty"),
    "frequency_penalty +inf": (_req(sampling__frequency_penalty=float("inf")), "sampling.frequency_penalty"),
    "4 MB text": (pb.GenerateRequest(text="hello world " * 340_000), "prompt.text"),
    "too many token ids": (_req(token_ids__ids=list(range(3, 3 + MAX_MODEL_LEN))), "prompt.token_ids"),
    "max_tokens 2**32-1": (_req(stopping__max_tokens=2**32 - 1), "stopping.max_tokens"),
    "min_tokens 2**32-1": (_req(stopping__max_tokens=None, stopping__min_tokens=2**32 - 1), "stopping.min_tokens"),
}


def test_each_bad_request_gets_its_status_and_the_service_is_unchanged(svc):
    before = _canary(svc)
    for name, (req, field) in BAD.items():
        code, details = _code(lambda: list(svc.stub.Generate(req, timeout=60)))
        assert code == grpc.StatusCode.INVALID_ARGUMENT, (name, code, details)
        assert details.startswith(field), (name, details)
    # a request over --max-request-bytes (4 MiB by default) is refused by gRPC itself
    code, _ = _code(lambda: list(svc.stub.Generate(pb.GenerateRequest(text="z" * (4 * 2**20 + 10)), timeout=60)))
    assert code == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert _canary(svc) == before
    info = svc.wait_all_blocks_free()
    assert all(e.num_free_blocks == e.num_total_blocks for e in info.executors)


def test_beam_search_with_many_stop_tokens_never_restarts_an_executor(svc):
    executors = [e.executor_id for e in svc.server_info().executors]
    req = greedy_request(prompt_ids=[1, 900, 901, 902], max_tokens=6, ignore_eos=True)
    req.sampling.beam_width = 16
    req.stopping.stop_token_ids.extend(range(1000, 1256))  # the most allowed: 16 + 256 candidates per beam
    result = collect(svc.stub.Generate(req, timeout=120))
    assert len(result["outputs"][0]["token_ids"]) > 0
    assert [e.executor_id for e in svc.server_info().executors] == executors
    assert svc.executors[0].poll() is None
    assert (svc.logdir / "executor0.log").read_text().count("registered ") == 1


def _token_gaps(svc, num_gaps: int = 0, beside: threading.Thread | None = None) -> list[float]:
    """Inter-token gaps of one long stream: `num_gaps` of them, or as many as it takes `beside` to finish."""
    req = greedy_request(prompt_ids=[1, 42, 43], max_tokens=MAX_MODEL_LEN - 8, ignore_eos=True)
    gaps: list[float] = []
    while True:  # a new stream when one ends first: the gap between two is not counted
        call, last = svc.stub.Generate(req, timeout=120), None
        for _ in call:
            now = time.monotonic()
            if last is not None:
                gaps.append(now - last)
            last = now
            if (beside is not None and not beside.is_alive()) or (beside is None and len(gaps) >= num_gaps):
                call.cancel()
                return gaps


def test_a_huge_prompt_and_tokenize_do_not_freeze_running_streams(svc):
    """Beside a 4 MB prompt and a 4 MB Tokenize, a running stream's largest gap stays within 2x its quiet one.

    A stream runs through the whole of both requests (a Tokenize of 4 MB takes the tokenizer
    3-10 s here), then twice as many gaps are measured quiet, in two windows as long as the
    loaded one (the largest of n gaps grows with n); the quiet gap is the smaller of the two
    windows' largest, so that one stall of a shared machine does not widen the bound. The bound
    is 2x that, but not under 50 ms: on the 2-core test machine the quiet largest gap of 150
    tokens measured 6-14 ms (median gap 3 ms) when calm, and 50-500 ms while other tests ran
    beside it: CPU it did not get, which no change here can give back (those stalls hit quiet
    and loaded windows alike). Three tries, the first in bound passes: a loop frozen 0.1 s fails
    every try whose quiet gap is under 50 ms, i.e. unless the machine stalls all three quiet
    windows too. Before prompts.py sent huge texts to a child process, building the Tokenize
    reply held the GIL 30-130 ms (measured), and this test saw 0.545 s beside a quiet 0.106 s.
    """
    text = "hello world " * 340_000  # 4.08 MB: just under gRPC's 4 MiB
    svc.stub.Tokenize(pb.TokenizeRequest(text=text[:400_000]), timeout=120)  # starts the child process, once
    tries = []
    with frozen_client_heap():  # the largest gap counts: see frozen_client_heap
        for _ in range(3):
            statuses: dict[str, grpc.StatusCode] = {}

            def hostile():
                statuses["generate"] = _code(lambda: list(svc.stub.Generate(pb.GenerateRequest(text=text), timeout=120)))[0]
                statuses["tokenize"] = _code(lambda: svc.stub.Tokenize(pb.TokenizeRequest(text=text), timeout=120))[0]

            thread = threading.Thread(target=hostile)
            thread.start()
            loaded = _token_gaps(svc, beside=thread)
            thread.join()
            quiet = min(max(_token_gaps(svc, num_gaps=len(loaded))) for _ in range(2))
            tries.append((round(quiet, 3), round(max(loaded), 3), len(loaded)))
            print(f"largest inter-token gap of {len(loaded)}: quiet {quiet:.3f} s, "
                  f"beside a 4 MB prompt and a 4 MB Tokenize {max(loaded):.3f} s")
            # Tokenize: more than MAX_TOKENIZE_TOKENS, found after tokenizing a fifth of it (issue #43)
            assert statuses == {"generate": grpc.StatusCode.INVALID_ARGUMENT, "tokenize": grpc.StatusCode.INVALID_ARGUMENT}
            if max(loaded) <= max(2 * quiet, 0.05):
                return
    pytest.fail(f"(quiet, loaded, gaps) in each try: {tries}")


def test_tokenize_still_answers_a_long_text(svc):
    reply = svc.stub.Tokenize(pb.TokenizeRequest(text="hello world " * 20_000), timeout=60)
    assert len(reply.token_ids) == 40_001 and len(reply.tokens) == 40_001


# ---- start-up failures ----------------------------------------------------------------------

def _start(module: str, *args: str, ready: bool = False, timeout: float = 120):
    proc = subprocess.Popen(
        [sys.executable, "-m", module, *args], cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    if ready:  # wait for PAGODA_READY, then hand it back running
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            line = proc.stdout.readline()
            if "PAGODA_READY" in line:
                return proc
            if proc.poll() is not None:
                raise RuntimeError(proc.stderr.read())
        raise TimeoutError(module)
    _, err = proc.communicate(timeout=timeout)
    return proc.returncode, err


@pytest.fixture(scope="module")
def first_scheduler(tiny_dir):
    ports = {"--port": str(free_port()), "--executor-bind": f"tcp://127.0.0.1:{free_port()}", "--metrics-port": str(free_port())}
    proc = _start("scheduler_svc", "--model", str(tiny_dir), *[x for kv in ports.items() for x in kv], ready=True)
    yield ports
    proc.terminate()
    proc.wait(30)


@pytest.mark.parametrize("flag", ["--metrics-port", "--port", "--executor-bind"])
def test_a_second_scheduler_on_a_taken_port_exits_with_one_line_naming_the_flag(tiny_dir, first_scheduler, flag):
    ports = {"--port": str(free_port()), "--executor-bind": f"tcp://127.0.0.1:{free_port()}", "--metrics-port": str(free_port())}
    ports[flag] = first_scheduler[flag]
    code, err = _start("scheduler_svc", "--model", str(tiny_dir), *[x for kv in ports.items() for x in kv])
    lines = [line for line in err.strip().splitlines() if " INFO " not in line]  # log records before the failure
    assert code != 0 and len(lines) == 1 and flag in lines[0] and "Traceback" not in err, err


@pytest.mark.parametrize("module", ["scheduler_svc", "executor_svc"])
def test_a_missing_model_is_one_line_naming_model(module, tmp_path):
    code, err = _start(module, "--model", str(tmp_path / "nowhere"))
    lines = [line for line in err.strip().splitlines() if " INFO " not in line]
    assert code != 0 and len(lines) == 1 and "--model" in lines[0] and "Traceback" not in err, err


@pytest.mark.parametrize("module", ["scheduler_svc", "executor_svc"])
def test_a_weak_or_shared_cluster_secret_file_stops_the_start_naming_the_override(module, tmp_path):
    """Issue #43: a world-readable secret was only warned about, one of a repeated character accepted."""
    weak, shared = tmp_path / "weak.secret", tmp_path / "shared.secret"
    weak.write_text("x" * 64 + "\n")
    weak.chmod(0o600)
    shared.write_text(os.urandom(32).hex() + "\n")
    shared.chmod(0o644)
    for path, why in ((weak, "repeats a pattern"), (shared, "every user may read")):
        code, err = _start(module, "--cluster-secret-file", str(path), timeout=60)
        assert code == 2 and why in err and "--allow-insecure-cluster-secret" in err and "Traceback" not in err, err


def test_an_invalid_flag_is_one_line_naming_it():
    code, err = _start("scheduler_svc", "--max-num-seqs", "0")
    assert code != 0 and err.strip().splitlines() == ["python -m scheduler_svc: error: --max-num-seqs must be positive, got 0"]


# ---- scheduler restarts ---------------------------------------------------------------------

@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGKILL], ids=["sigterm", "sigkill"])
def test_executors_outlive_a_scheduler_restart_without_reloading(tiny_dir, sig):
    with Service(model=str(tiny_dir), executor_args=["--num-kv-blocks", "128"]) as svc:
        before = _canary(svc)
        executor = svc.executors[0]
        svc.restart_scheduler(sig)
        started = time.monotonic()
        svc.wait_serving(1, timeout=120)
        assert _canary(svc) == before
        log = (svc.logdir / "executor0.log").read_text()
        assert executor.poll() is None and svc.executors == [executor]
        assert log.count("registered ") == 2, log
        assert log.count(" KV blocks of ") == 1, log  # the model was loaded once
        assert time.monotonic() - started < 120
