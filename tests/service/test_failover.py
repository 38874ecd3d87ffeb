"""Executors die, stall, join, drain; the scheduler drains: client streams go on (issue #6).

Every test runs the real processes (one scheduler, N executors on the CPU) and compares the
greedy streams with transformers' greedy continuation of the same chat prompt: a request
moved from a dead executor resumes on a survivor by recomputing its tokens so far, so its
stream must be exactly the reference, nothing lost or repeated.
"""

from __future__ import annotations

import signal
import threading
import time

import grpc
import pytest
from grpc_health.v1 import health_pb2

from pagoda.v1 import generation_pb2 as pb
from tests.service.harness import chat_ids, collect, greedy_request, hf_greedy, SERVICE, Service, one_torch_thread

CHATS = [  # greedy answers of natural text; the first ones run past 32 tokens
    "Tell me about the history of Rome.",
    "Write a haiku about the sea.",
    "Give me three tips for learning Python.",
    "Explain photosynthesis in one sentence.",
    "Name a famous painting by Leonardo da Vinci.",
    "How do I boil an egg?",
    "Why is the sky blue?",
    "Describe a cat in two sentences.",
    "What are the benefits of regular exercise?",
    "How does a rainbow form?",
    "Give me a recipe for pancakes.",
    "What is the water cycle?",
]
MAX_TOKENS = 48
EOS = 2
# One torch thread per executor: several executors share two cores here (more threads thrash).
EXECUTOR_ARGS = ["--num-threads", "1"]
FAST_DETECTION = ["--executor-timeout", "1.0"]


@pytest.fixture(scope="module")
def reference(hf_reference):
    """content -> (prompt ids, transformers' greedy ids for MAX_TOKENS), computed before any service runs."""
    model, tokenizer = hf_reference
    with one_torch_thread():
        out = {}
        for content in CHATS:
            prompt = chat_ids(tokenizer, content)
            out[content] = (prompt, hf_greedy(model, prompt, MAX_TOKENS))
        return out


class Stream:
    """One Generate call read by a thread: tokens as they arrive, then the whole result or the error."""

    def __init__(self, stub, content: str, max_tokens: int = MAX_TOKENS, timeout: float = 300, request=None):
        self.content = content
        if request is None:
            request = greedy_request(chat=[("user", content)], max_tokens=max_tokens)
        self.call = stub.Generate(request, timeout=timeout)
        self.messages: list[pb.GenerateResponse] = []
        self.num_tokens = 0
        self.error: grpc.RpcError | None = None
        self.ended_at: float | None = None
        self._cond = threading.Condition()
        self._thread = threading.Thread(target=self._read, daemon=True)
        self._thread.start()

    def _read(self) -> None:
        try:
            for message in self.call:
                with self._cond:
                    self.messages.append(message)
                    self.num_tokens += sum(len(o.token_ids) for o in message.outputs)
                    self._cond.notify_all()
        except grpc.RpcError as exc:
            self.error = exc
        finally:
            with self._cond:
                self.ended_at = time.monotonic()
                self._cond.notify_all()

    @property
    def done(self) -> bool:
        return self.ended_at is not None

    def wait_tokens(self, n: int, timeout: float = 120) -> None:
        with self._cond:
            if not self._cond.wait_for(lambda: self.num_tokens >= n or self.done, timeout):
                raise TimeoutError(f"{self.content!r}: {self.num_tokens} tokens after {timeout} s")

    def finish(self, timeout: float = 300) -> None:
        self._thread.join(timeout)
        if self._thread.is_alive():
            raise TimeoutError(f"{self.content!r} still streaming after {timeout} s")

    def result(self, timeout: float = 300) -> dict:
        self.finish(timeout)
        if self.error is not None:
            raise AssertionError(f"{self.content!r} failed: {self.error.code()} {self.error.details()}")
        return collect(self.messages)


def assert_is_reference(stream: Stream, reference, tokenizer, max_tokens: int = MAX_TOKENS) -> None:
    prompt, expected = reference[stream.content]
    expected = expected[:max_tokens]
    result = stream.result()
    out = result["outputs"][0]
    assert result["first"].prompt_info.num_prompt_tokens == len(prompt)
    assert out["token_ids"] == expected, stream.content  # nothing lost, nothing repeated
    assert out["text"] == tokenizer.decode(expected, skip_special_tokens=True), stream.content
    usage = result["last"].usage
    assert usage.prompt_tokens == len(prompt) and usage.completion_tokens == len(out["token_ids"])
    reason = pb.FINISH_REASON_EOS if expected[-1] == EOS else pb.FINISH_REASON_LENGTH
    assert out["finish_reason"] == reason, stream.content


def start_streams(svc: Service, contents, max_tokens: int = MAX_TOKENS, min_tokens: int = 3) -> list[Stream]:
    """Start one stream per content and return once each has received `min_tokens` tokens (mid-stream)."""
    streams = [Stream(svc.stub, content, max_tokens) for content in contents]
    for stream in streams:
        stream.wait_tokens(min_tokens)
    return streams


def executor_id_of(proc) -> str:
    """Executors started without --executor-id are named `host-pid-random`."""
    return f"-{proc.pid}-"


def info_of(svc: Service, proc) -> pb.ExecutorInfo | None:
    for info in svc.server_info().executors:
        if executor_id_of(proc) in f"-{info.executor_id}":
            return info
    return None


def wait_until(predicate, timeout: float, what: str, interval: float = 0.1):
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise TimeoutError(f"{what}: not within {timeout} s")
        time.sleep(interval)


def health_status(svc: Service) -> int:
    return svc.health.Check(health_pb2.HealthCheckRequest(service=SERVICE), timeout=5).status


def assert_idle(svc: Service, num_executors: int) -> None:
    info = svc.wait_all_blocks_free()
    assert len(info.executors) == num_executors and all(e.healthy for e in info.executors), info
    assert info.num_running == 0 and info.num_waiting == 0, info
    assert all(e.num_free_blocks == e.num_total_blocks for e in info.executors), info


def seeded_request(content: str, seed: int) -> pb.GenerateRequest:
    req = greedy_request(chat=[("user", content)], max_tokens=MAX_TOKENS)
    req.sampling.temperature = 0.8
    req.sampling.seed = seed
    return req


def test_sigkill_of_one_executor_mid_stream_loses_and_repeats_nothing(reference, hf_reference):
    _, tokenizer = hf_reference
    with Service(num_executors=2, scheduler_args=FAST_DETECTION, executor_args=EXECUTOR_ARGS) as svc:
        # Seeded sampling draws from (seed, position): a resumed stream is the same as an unbroken one.
        seeded = {seed: seeded_request(CHATS[seed], seed) for seed in (6, 7)}
        unbroken = {seed: collect(svc.stub.Generate(req, timeout=120))["outputs"][0] for seed, req in seeded.items()}
        streams = start_streams(svc, CHATS)
        sampled = {seed: Stream(svc.stub, CHATS[seed], request=req) for seed, req in seeded.items()}
        for stream in sampled.values():
            stream.wait_tokens(3)
        victim, survivor = svc.executors
        victim_info = info_of(svc, victim)
        assert victim_info is not None and victim_info.num_running > 0, svc.server_info()  # mid-stream
        victim.send_signal(signal.SIGKILL)
        victim.wait(timeout=10)
        for stream in streams:
            assert_is_reference(stream, reference, tokenizer)
        for seed, stream in sampled.items():
            out = stream.result()["outputs"][0]
            assert (out["token_ids"], out["text"]) == (unbroken[seed]["token_ids"], unbroken[seed]["text"])
        assert "moving its requests" in (svc.logdir / "scheduler.log").read_text()
        assert_idle(svc, 1)
        assert info_of(svc, survivor) is not None and info_of(svc, victim) is None


class Load:
    """Keeps `concurrency` greedy streams in flight (a new one as soon as one ends) until stopped."""

    def __init__(self, svc: Service, contents, concurrency: int):
        self.svc = svc
        self.contents = contents
        self.finished: list[Stream] = []
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._next = 0
        self._threads = [threading.Thread(target=self._run, daemon=True) for _ in range(concurrency)]
        for thread in self._threads:
            thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            with self._lock:
                content = self.contents[self._next % len(self.contents)]
                self._next += 1
            stream = Stream(self.svc.stub, content)
            stream.finish()
            with self._lock:
                self.finished.append(stream)

    def stop(self) -> list[Stream]:
        self._stop.set()
        for thread in self._threads:
            thread.join(300)
        return self.finished


def test_executor_started_under_load_receives_work(reference, hf_reference):
    _, tokenizer = hf_reference
    with Service(num_executors=1, executor_args=EXECUTOR_ARGS) as svc:
        first = svc.executors[0]
        load = Load(svc, CHATS, concurrency=6)
        try:
            wait_until(lambda: info_of(svc, first).num_running >= 4, 60, "the first executor is loaded")
            newcomer = svc.add_executor()
            svc.wait_serving(2)
            assert info_of(svc, first).num_running > 0  # still under load when the newcomer arrived
            # Least loaded: the load's next requests go to the newcomer.
            busy = wait_until(lambda: (info_of(svc, newcomer).num_running > 0) and info_of(svc, newcomer), 60,
                              "the newcomer runs requests")
            assert busy.healthy
        finally:
            streams = load.stop()
        assert len(streams) >= 6
        for stream in streams:
            assert_is_reference(stream, reference, tokenizer)
        info = svc.wait_all_blocks_free()
        assert all(e.num_cached_blocks > 0 for e in info.executors), info  # both served prompts
        assert_idle(svc, 2)


def test_sigstop_is_a_death_and_sigcont_a_new_registration(reference, hf_reference):
    _, tokenizer = hf_reference
    with Service(num_executors=2, scheduler_args=FAST_DETECTION, executor_args=EXECUTOR_ARGS) as svc:
        streams = start_streams(svc, CHATS[:8])
        stalled, survivor = svc.executors
        stalled_id = info_of(svc, stalled).executor_id
        assert info_of(svc, stalled).num_running > 0
        stalled.send_signal(signal.SIGSTOP)
        try:
            stopped_at = time.monotonic()
            wait_until(lambda: info_of(svc, stalled) is None, 10, "the stalled executor is declared dead")
            detected_in = time.monotonic() - stopped_at
            assert detected_in < 5, detected_in
            assert health_status(svc) == health_pb2.HealthCheckResponse.SERVING
            # Its streams complete on the survivor while it is still stopped.
            for stream in streams:
                assert_is_reference(stream, reference, tokenizer)
        finally:
            stalled.send_signal(signal.SIGCONT)
        # Resumed, it hears it is unknown (ExecutorConfig again) and registers anew under its id.
        wait_until(lambda: (i := info_of(svc, stalled)) is not None and i.healthy, 30, "the resumed executor registers")
        assert info_of(svc, stalled).executor_id == stalled_id
        assert "registering again" in (svc.logdir / "executor0.log").read_text()
        assert_idle(svc, 2)
        # And it is used again.
        again = [Stream(svc.stub, content) for content in CHATS[8:12]]
        wait_until(lambda: info_of(svc, stalled).num_running > 0 or all(s.done for s in again), 60,
                   "new work reaches the resumed executor")
        assert info_of(svc, stalled).num_running > 0, "every new request went to the survivor"
        for stream in again:
            assert_is_reference(stream, reference, tokenizer)
        assert stalled.poll() is None and survivor.poll() is None
        assert_idle(svc, 2)


def test_with_every_executor_gone_requests_end_unavailable_after_the_wait(reference):
    wait_s = 3.0
    with Service(
        num_executors=2,
        scheduler_args=[*FAST_DETECTION, "--no-executor-wait", str(wait_s)],
        executor_args=EXECUTOR_ARGS,
    ) as svc:
        running = start_streams(svc, CHATS[:1], max_tokens=MAX_TOKENS)[0]
        for proc in svc.executors:
            proc.send_signal(signal.SIGKILL)
        killed_at = time.monotonic()
        for proc in svc.executors:
            proc.wait(timeout=10)
        wait_until(lambda: health_status(svc) == health_pb2.HealthCheckResponse.NOT_SERVING, 5, "NOT_SERVING")
        # The stream that was running: UNAVAILABLE once it has waited `wait_s` for an executor.
        running.finish(60)
        assert running.error is not None, "the stream finished without an executor"
        assert running.error.code() == grpc.StatusCode.UNAVAILABLE, running.error
        assert 0 < running.num_tokens < len(reference[running.content][1])
        took = running.ended_at - killed_at
        assert wait_s - 0.3 <= took <= wait_s + 1.0 + 5, took
        # A request arriving now waits, then ends the same way.
        started = time.monotonic()
        with pytest.raises(grpc.RpcError) as err:
            list(svc.stub.Generate(greedy_request(chat=[("user", CHATS[1])], max_tokens=8), timeout=60))
        took = time.monotonic() - started
        assert err.value.code() == grpc.StatusCode.UNAVAILABLE, err.value
        assert "no executor" in err.value.details()
        assert wait_s - 0.3 <= took <= wait_s + 5, took
        info = svc.server_info()
        assert len(info.executors) == 0 and info.num_running == 0 and info.num_waiting == 0, info
        assert health_status(svc) == health_pb2.HealthCheckResponse.NOT_SERVING


def test_requests_waiting_for_an_executor_run_on_the_next_one_to_register(reference, hf_reference):
    """The only executor dies mid-stream; it and new requests wait, then resume on a newcomer."""
    _, tokenizer = hf_reference
    with Service(
        num_executors=1, scheduler_args=[*FAST_DETECTION, "--no-executor-wait", "120"], executor_args=EXECUTOR_ARGS
    ) as svc:
        running = start_streams(svc, CHATS[:2])
        svc.executors[0].send_signal(signal.SIGKILL)
        svc.executors[0].wait(timeout=10)
        wait_until(lambda: health_status(svc) == health_pb2.HealthCheckResponse.NOT_SERVING, 5, "NOT_SERVING")
        waiting = [Stream(svc.stub, content) for content in CHATS[2:5]]
        wait_until(lambda: svc.server_info().num_waiting == 5, 10, "five requests wait for an executor")
        assert not any(s.done for s in running + waiting)
        svc.add_executor()
        svc.wait_serving(1)
        for stream in running + waiting:
            assert_is_reference(stream, reference, tokenizer)
        assert_idle(svc, 1)


def test_sigterm_drains_an_executor_under_load(reference, hf_reference):
    _, tokenizer = hf_reference
    with Service(num_executors=2, executor_args=EXECUTOR_ARGS) as svc:
        streams = start_streams(svc, CHATS)
        leaving, staying = svc.executors
        assert info_of(svc, leaving).num_running > 0
        leaving.send_signal(signal.SIGTERM)
        assert leaving.wait(timeout=30) == 0
        for stream in streams:
            assert_is_reference(stream, reference, tokenizer)
        assert "said goodbye" in (svc.logdir / "scheduler.log").read_text()
        assert_idle(svc, 1)
        assert info_of(svc, staying) is not None


def test_sigterm_to_the_scheduler_lets_streams_in_flight_finish(reference, hf_reference):
    _, tokenizer = hf_reference
    with Service(num_executors=1, executor_args=EXECUTOR_ARGS) as svc:
        streams = start_streams(svc, CHATS[:4], max_tokens=32)
        # and one that outlasts the probe below however fast the others finish: once every stream
        # has ended the server is gone, and a late probe would find no grace period to be refused in
        long = Stream(svc.stub, CHATS[4], request=greedy_request(chat=[("user", CHATS[4])], max_tokens=400,
                                                                 ignore_eos=True))
        long.wait_tokens(3)
        svc.scheduler.send_signal(signal.SIGTERM)
        log = svc.logdir / "scheduler.log"
        wait_until(lambda: "INFO scheduler_svc: stopping" in log.read_text(), 10, "the scheduler stops")
        # New work is refused during the grace period.
        with pytest.raises(grpc.RpcError) as err:
            list(svc.stub.Generate(greedy_request(chat=[("user", CHATS[5])], max_tokens=8), timeout=10))
        assert err.value.code() == grpc.StatusCode.UNAVAILABLE, err.value
        # The streams in flight end normally, whole.
        for stream in streams:
            assert_is_reference(stream, reference, tokenizer, max_tokens=32)
        result = long.result()
        assert len(result["outputs"][0]["token_ids"]) == 400  # whole
        assert svc.scheduler.wait(timeout=20) == 0
        # The executor outlives it (weights and cache kept), waiting for the next scheduler (#16); it
        # learns of the stop from the notice, or from the drop when the notice is lost to it.
        wait_until(lambda: "waiting for the next one" in (svc.logdir / "executor0.log").read_text(), 10, "the executor waits")
        assert svc.executors[0].poll() is None
