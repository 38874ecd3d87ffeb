"""Fuzz the public API: hypothesis-generated GenerateRequests through the real gRPC server.

    python bench/fuzz.py --examples 10000                # spawns scheduler + executor on a tiny random model
    python bench/fuzz.py --target 127.0.0.1:50051 --examples 500

Every field is drawn, extremes included: huge, negative (where the type allows), NaN, +-Inf,
empty, duplicated request ids sent at once, any unicode. Some requests go out as raw bytes
that are no valid message: truncated, a byte flipped, a string field that is not UTF-8 (a
lone surrogate, a bare continuation byte). Each example is a batch of 1-4 requests sent
together, some cancelled early, all under a short client deadline. A merely bad
request must get INVALID_ARGUMENT (or ALREADY_EXISTS, RESOURCE_EXHAUSTED), a good one OK;
UNKNOWN, INTERNAL or UNAVAILABLE is a failure. Afterwards the service must be serving, with
every KV block free. Prints a table of the statuses seen and exits 1 on any failure.
"""

from __future__ import annotations

import argparse
import collections
import concurrent.futures
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repository root, when run as a script

import grpc  # noqa: E402
from hypothesis import HealthCheck, Phase, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from bench.common import exit_on_sigterm  # noqa: E402
from pagoda.v1 import generation_pb2 as pb  # noqa: E402
from pagoda.v1 import generation_pb2_grpc as pb_grpc  # noqa: E402

VOCAB = 49152
FAILURE_CODES = {grpc.StatusCode.UNKNOWN, grpc.StatusCode.INTERNAL, grpc.StatusCode.UNAVAILABLE}

_U32, _U64, _I32 = 2**32 - 1, 2**64 - 1, 2**31 - 1
_text = st.text(st.characters(exclude_categories=("Cs",)), max_size=40)  # protobuf strings are UTF-8: no lone surrogates
_any_float = st.one_of(
    st.floats(width=32, allow_nan=True, allow_infinity=True),
    st.sampled_from([float("nan"), float("inf"), float("-inf"), -0.0, 1e-30, -1.0, 1e30]),
)
_token_id = st.integers(3, VOCAB - 1)
_any_token_id = st.one_of(_token_id, st.sampled_from([0, 1, 2, VOCAB - 1, VOCAB, _U32]))

# field -> (values a well-behaved client sends, anything the type allows); None = leave unset
_FIELDS = {
    "request_id": (st.one_of(st.just(""), st.sampled_from(["dup", "dup-2"]), st.text(st.characters(exclude_categories=("Cs",)), max_size=12)),
                   st.one_of(_text, st.just("r" * 300), st.just("\u2603" * 1000))),
    "prompt": (st.one_of(st.tuples(st.just("text"), st.text(st.characters(exclude_categories=("Cs",)), min_size=1, max_size=60)),
                         st.tuples(st.just("token_ids"), st.lists(_token_id, min_size=1, max_size=40)),
                         st.tuples(st.just("chat"), st.lists(st.tuples(st.sampled_from(["user", "assistant", "system"]), _text), min_size=1, max_size=3))),
               st.one_of(st.just(("none", None)), st.tuples(st.just("text"), st.just("")),
                         st.tuples(st.just("token_ids"), st.lists(_any_token_id, max_size=40)),
                         st.tuples(st.just("token_ids"), st.sampled_from([[5] * 1000, [7] * 100_000])),
                         st.tuples(st.just("text"), st.sampled_from(["a" * 5000, "\u00e9" * 200_000, "\U0001f600" * 1_000_000])),
                         st.tuples(st.just("chat"), st.lists(st.tuples(st.sampled_from(["", "tool", "\u2603", "user"]), _text), max_size=4)))),
    "temperature": (st.floats(0, 2, width=32), _any_float),
    "top_p": (st.floats(0.0625, 1, width=32), _any_float),
    "min_p": (st.floats(0, 1, width=32), _any_float),
    "presence_penalty": (st.floats(-2, 2, width=32), _any_float),
    "frequency_penalty": (st.floats(-2, 2, width=32), _any_float),
    "repetition_penalty": (st.floats(0.5, 2, width=32), _any_float),
    "top_k": (st.integers(0, 100), st.sampled_from([-1, -(2**31), _I32, VOCAB, VOCAB + 1])),
    "seed": (st.integers(0, 100), st.just(_U64)),
    "n": (st.integers(1, 4), st.sampled_from([0, 17, _U32])),
    "beam_width": (st.integers(0, 4), st.sampled_from([17, 16, _U32])),
    "logit_bias": (st.dictionaries(_token_id, st.floats(-5, 5, width=32), max_size=4),
                   st.one_of(st.dictionaries(_any_token_id, _any_float, max_size=6), st.just("all"))),
    "max_tokens": (st.integers(1, 24), st.sampled_from([None, 0, 1023, 1024, _U32])),  # unset: up to max_model_len
    "min_tokens": (st.integers(0, 4), st.sampled_from([1000, _U32])),
    "stop": (st.lists(st.text(st.characters(exclude_categories=("Cs",)), min_size=1, max_size=8), max_size=3),
             st.one_of(st.lists(_text, max_size=18), st.just(["x" * 100_000]), st.just([""]))),
    "stop_token_ids": (st.lists(_token_id, max_size=8), st.sampled_from([list(range(VOCAB)), list(range(300)), [VOCAB], [_U32]])),
    "top_logprobs": (st.integers(0, 5), st.sampled_from([20, 21, _U32])),
    "priority": (st.integers(-3, 3), st.sampled_from([-(2**31), _I32])),
    # (kind, value): a constraint, or a tool's grammar as the gateway builds it (tool_choice "required")
    "constraint": (st.one_of(
                       st.tuples(st.just("json_schema"), st.sampled_from([
                           '{"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"]}',
                           '{"type": "array", "minItems": 1, "maxItems": 1, "items": {"anyOf": [{"type": "object", "properties": '
                           '{"name": {"type": "string", "enum": ["get_weather"]}, "parameters": {"type": "object", "properties": '
                           '{"city": {"type": "string"}}}}, "required": ["name", "parameters"], "additionalProperties": false}]}}',
                           '{"type": "integer", "minimum": 0, "maximum": 99}'])),
                       st.tuples(st.just("regex"), st.sampled_from([r"[0-9]{1,3}", r"(yes|no)", r"[a-z]+@[a-z]+\.com"])),
                       st.tuples(st.just("choice"), st.lists(st.text(st.characters(exclude_categories=("Cs",)), min_size=1, max_size=6), min_size=1, max_size=4)),
                       st.tuples(st.just("json_object"), st.just(True)),
                       st.tuples(st.just("grammar"), st.just('root ::= "a" | "b"'))),
                   st.one_of(
                       st.tuples(st.just("json_schema"), st.one_of(_text, st.sampled_from(['{"type": "foo"}', "{", "[]", '{"$ref": "#/x"}']))),
                       st.tuples(st.just("regex"), st.sampled_from(["(", "[z-a]", "a{5,2}", "\\"])),
                       st.tuples(st.just("choice"), st.sampled_from([[], [""], ["x" * 10_000], [str(i) for i in range(2000)]])),
                       st.tuples(st.just("grammar"), st.one_of(_text, st.just('rule ::= "a"'))),
                       st.tuples(st.just("structural_tag"), st.one_of(_text, st.just('{"type": "nope"}'))),
                       st.tuples(st.just("json_object"), st.just(False)))),
}
_SAMPLING = ("temperature", "top_p", "min_p", "presence_penalty", "frequency_penalty", "repetition_penalty", "top_k", "seed", "n", "beam_width")


# Bytes a string field may hold that are no UTF-8: a lone surrogate (CESU), a bare continuation
# byte, an overlong "/", a truncated 4-byte sequence.
_BAD_UTF8 = [b"\xed\xa0\x80", b"\x80", b"\xc0\xaf", b"\xf0\x9f\x98"]
_STRING_FIELDS = [1, 2]  # GenerateRequest.request_id, .text


@st.composite
def corrupt_requests(draw) -> bytes:
    """A serialized request made invalid: cut short, a byte flipped, or a string field that is not UTF-8."""
    raw = draw(generate_requests()).SerializeToString()
    how = draw(st.sampled_from(["truncate", "flip", "bad_utf8"]))
    if how == "truncate" and len(raw) > 1:
        return raw[: draw(st.integers(1, len(raw) - 1))]
    if how == "flip" and raw:
        i = draw(st.integers(0, len(raw) - 1))
        return raw[:i] + bytes([raw[i] ^ draw(st.integers(1, 255))]) + raw[i + 1 :]
    bad = draw(st.sampled_from(_BAD_UTF8))
    text = draw(st.binary(max_size=4)) + bad + draw(st.binary(max_size=4))
    return raw + bytes([draw(st.sampled_from(_STRING_FIELDS)) << 3 | 2, len(text)]) + text  # the last value wins


@st.composite
def generate_requests(draw) -> pb.GenerateRequest:
    """A request that is well-formed but for 0-3 fields drawn from anything their type allows."""
    bad = draw(st.sets(st.sampled_from(sorted(_FIELDS)), max_size=3))

    def value(name: str):
        good, extreme = _FIELDS[name]
        if name in bad:
            return draw(extreme)
        return draw(good) if name in ("prompt", "request_id", "max_tokens") else draw(st.one_of(st.none(), good))

    req = pb.GenerateRequest(request_id=value("request_id"))
    kind, prompt = value("prompt")
    if kind == "text":
        req.text = prompt
    elif kind == "token_ids":
        req.token_ids.SetInParent()
        req.token_ids.ids.extend(prompt)
    elif kind == "chat":
        req.chat.SetInParent()
        for role, content in prompt:
            req.chat.messages.add(role=role, content=content)
    for name in _SAMPLING:
        if (v := value(name)) is not None:
            setattr(req.sampling, name, v)
    if (bias := value("logit_bias")) is not None:
        req.sampling.logit_bias.update({i: 1.0 for i in range(VOCAB)} if bias == "all" else bias)
    for name in ("max_tokens", "min_tokens"):
        if (v := value(name)) is not None:
            setattr(req.stopping, name, v)
    req.stopping.stop.extend(value("stop") or [])
    req.stopping.stop_token_ids.extend(value("stop_token_ids") or [])
    req.stopping.ignore_eos = draw(st.booleans())
    req.stopping.include_stop_str_in_output = draw(st.booleans())
    req.response.logprobs = draw(st.booleans())
    req.response.top_logprobs = value("top_logprobs") or 0
    if (skip := draw(st.one_of(st.none(), st.booleans()))) is not None:
        req.response.skip_special_tokens = skip
    if (priority := value("priority")) is not None:
        req.priority = priority
    if (constraint := value("constraint")) is not None and (draw(st.integers(0, 3)) == 0 or "constraint" in bad):
        kind, body = constraint
        if kind == "choice":
            req.constraint.choice.choices.extend(body)
        elif kind == "json_object":
            req.constraint.json_object = body
        else:
            setattr(req.constraint, kind, body)
    return req


# one example: a few requests sent at once (one in ten as corrupt bytes), each maybe cancelled after its first message
_requests = st.integers(0, 9).flatmap(lambda i: corrupt_requests() if i == 0 else generate_requests())
batches = st.lists(st.tuples(_requests, st.booleans()), min_size=1, max_size=4)


@dataclass
class FuzzReport:
    examples: int = 0
    requests: int = 0
    statuses: collections.Counter = field(default_factory=collections.Counter)
    failures: list[str] = field(default_factory=list)


def _send(generate, req: pb.GenerateRequest | bytes, cancel: bool, timeout_s: float) -> tuple[grpc.StatusCode, str]:
    """`generate`: Generate taking a request or its bytes (a pass-through serializer)."""
    call = generate(req.SerializeToString() if isinstance(req, pb.GenerateRequest) else req, timeout=timeout_s)
    try:
        for _ in call:
            if cancel:
                call.cancel()
    except grpc.RpcError as exc:
        return exc.code(), exc.details() or ""
    return grpc.StatusCode.OK, ""


def run_fuzz(target: str, examples: int, timeout_s: float = 3.0, seed: int | None = 0, progress_every: int = 0) -> FuzzReport:
    """Send `examples` generated batches to `target`; a report of the statuses and the failures."""
    t0 = time.monotonic()
    report = FuzzReport()
    channel = grpc.insecure_channel(target, options=[("grpc.max_send_message_length", 64 * 2**20)])
    generate = channel.unary_stream("/pagoda.v1.Generation/Generate", response_deserializer=pb.GenerateResponse.FromString)
    pool = concurrent.futures.ThreadPoolExecutor(4)

    @settings(
        max_examples=examples, deadline=None, database=None, derandomize=seed is not None,
        phases=[Phase.generate], suppress_health_check=list(HealthCheck),
    )
    @given(batch=batches)
    def check(batch):
        report.examples += 1
        futures = [(req, pool.submit(_send, generate, req, cancel, timeout_s)) for req, cancel in batch]
        for req, future in futures:
            code, details = future.result()
            report.requests += 1
            report.statuses[code.name] += 1
            if code in FAILURE_CODES:
                report.failures.append(f"{code.name}: {details[:300]} <- {_describe(req)}")
        if progress_every and report.examples % progress_every == 0:
            print(f"{time.monotonic() - t0:6.0f} s: {report.examples} examples, {report.requests} requests, "
                  f"{len(report.failures)} failures, {dict(report.statuses)}", flush=True)

    try:
        check()
    finally:
        pool.shutdown()
        channel.close()
    return report


def _describe(req: pb.GenerateRequest | bytes) -> str:
    text = repr(req) if isinstance(req, bytes) else str(req).replace("\n", " ")
    return text if len(text) < 600 else text[:600] + "..."


def all_blocks_free(stub, timeout_s: float = 30.0) -> pb.ServerInfo:
    deadline = time.monotonic() + timeout_s
    while True:
        info = stub.GetServerInfo(pb.GetServerInfoRequest(), timeout=10)
        idle = info.num_running == 0 and info.num_waiting == 0
        if idle and all(e.num_free_blocks == e.num_total_blocks for e in info.executors) or time.monotonic() > deadline:
            return info


def tiny_model(out_dir: Path) -> Path:
    """A tiny random Llama with the default model's tokenizer (tests/service/test_tiny_models.py)."""
    from pagoda.model_files import resolve_model
    from tests.service.test_tiny_models import build_tiny

    build_tiny("llama", out_dir, resolve_model(None), shard=False)
    return out_dir


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--examples", type=int, default=500)
    parser.add_argument("--target", default=None, help="host:port of a running service (default: spawn one on a tiny model)")
    parser.add_argument("--timeout", type=float, default=3.0, help="client deadline of each request, s")
    parser.add_argument("--seed", type=int, default=None, help="derandomize (any value: hypothesis' fixed seed)")
    args = parser.parse_args()
    exit_on_sigterm()
    if args.target:
        return _report(run_fuzz(args.target, args.examples, args.timeout, args.seed, progress_every=500), args.target, None)
    from tests.service.harness import Service

    with tempfile.TemporaryDirectory() as tmp, Service(str(tiny_model(Path(tmp))), executor_args=["--num-kv-blocks", "512"]) as svc:
        t0 = time.monotonic()
        report = run_fuzz(f"127.0.0.1:{svc.port}", args.examples, args.timeout, args.seed, progress_every=500)
        print(f"{report.examples} examples, {report.requests} requests in {time.monotonic() - t0:.0f} s")
        return _report(report, f"127.0.0.1:{svc.port}", svc)


def _report(report: FuzzReport, target: str, svc) -> int:
    channel = grpc.insecure_channel(target)
    info = all_blocks_free(pb_grpc.GenerationStub(channel))
    channel.close()
    leaked = sum(e.num_total_blocks - e.num_free_blocks for e in info.executors)
    deaths = 0 if svc is None else sum(p.poll() is not None for p in [svc.scheduler, *svc.executors])
    print(f"{'status':<22}{'requests':>10}")
    for code, count in report.statuses.most_common():
        print(f"{code:<22}{count:>10}")
    print(f"failures {len(report.failures)}, process deaths {deaths}, leaked blocks {leaked}, executors {len(info.executors)}")
    for failure in report.failures[:20]:
        print("  " + failure)
    return 1 if report.failures or deaths or leaked or not info.executors else 0


if __name__ == "__main__":
    sys.exit(main())
