"""Structured output end to end (issue #22): one service (a scheduler, two executors, async
scheduling on) serves every test here, the failover last.

Constrained greedy streams equal transformers + xgrammar's logits processor token for
token; 200 seeded draws (`n` = 8 samples, one matcher each) all satisfy their
constraint; bad constraints are INVALID_ARGUMENT naming `constraint.<kind>`; the client
library and the CLI take constraints; a constrained stream whose executor is killed
mid-stream resumes on the survivor (its matcher rebuilt from its tokens) and ends as the
reference does.
"""

from __future__ import annotations

import signal
import threading

import grpc
import pytest

from pagoda import wire
from pagoda.client import Client
from pagoda.constraint import Constraint
from pagoda.v1 import generation_pb2 as pb
from tests.client.test_cli import pagoda
from tests.service.harness import Service, collect, greedy_request
from tests.service.test_failover import FAST_DETECTION, Stream, info_of
from tests.structured_reference import CASES, PERSON_SCHEMA, SAMPLED_CASES, Reference

pytestmark = pytest.mark.timeout(900)
EOS = 2
NUM_SAMPLES = 8  # per request: 25 requests of 8 samples are the 200 draws


@pytest.fixture(scope="module")
def reference(hf_reference):
    return Reference(*hf_reference)


@pytest.fixture(scope="module")
def expected(reference):
    """case name -> (prompt ids, the reference's greedy tokens), computed before the service starts."""
    from tests.service.harness import one_torch_thread

    with one_torch_thread():
        out = {}
        for case in CASES:
            prompt = reference.prompt_ids(case.prompt)
            out[case.name] = (prompt, reference.greedy(prompt, case.constraint, case.max_tokens))
        failover = CASES[-1]  # json_object: long enough to break mid-stream
        prompt = reference.prompt_ids(failover.prompt)
        out["failover"] = (prompt, reference.greedy(prompt, failover.constraint, 48))
        return out


@pytest.fixture(scope="module")
def svc(expected):
    with Service(num_executors=2, scheduler_args=FAST_DETECTION, executor_args=["--num-threads", "1"]) as service:
        yield service


def constrained_request(prompt_ids, constraint: Constraint, max_tokens: int) -> pb.GenerateRequest:
    req = greedy_request(prompt_ids=prompt_ids, max_tokens=max_tokens)
    wire.constraint_to_proto(constraint, req.constraint)
    return req


def test_constrained_greedy_streams_equal_transformers_with_xgrammar(svc, expected, reference):
    results: dict[str, dict] = {}

    def run(case):
        prompt = expected[case.name][0]
        results[case.name] = collect(svc.stub.Generate(constrained_request(prompt, case.constraint, case.max_tokens), timeout=300))

    threads = [threading.Thread(target=run, args=(case,)) for case in CASES]  # one batch: they share steps
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    for case in CASES:
        out = results[case.name]["outputs"][0]
        want = expected[case.name][1]
        assert out["token_ids"] == want, case.name
        if want[-1] == EOS:
            assert out["finish_reason"] == pb.FINISH_REASON_EOS and case.valid(out["text"]), (case.name, out["text"])
        else:  # cut by max_tokens: a LENGTH finish, not an error, and a valid prefix
            assert out["finish_reason"] == pb.FINISH_REASON_LENGTH and reference.is_valid_prefix(case.constraint, want)


def test_a_stop_string_cuts_a_constrained_output_to_a_valid_prefix(svc, expected, reference):
    person = next(c for c in CASES if c.name == "json_schema")
    prompt, want = expected[person.name]
    full = reference.tokenizer.decode(want, skip_special_tokens=True)
    req = constrained_request(prompt, person.constraint, person.max_tokens)
    req.stopping.stop.append('"age"')
    out = collect(svc.stub.Generate(req, timeout=300))["outputs"][0]
    assert out["finish_reason"] == pb.FINISH_REASON_STOP_SEQUENCE and out["matched_stop"] == '"age"'
    assert out["text"] == full[: full.index('"age"')]
    assert reference.is_valid_prefix(person.constraint, out["token_ids"])


def test_200_seeded_draws_all_satisfy_their_constraint(svc, reference):
    requests = []
    for i in range(200 // NUM_SAMPLES):
        case = SAMPLED_CASES[i % len(SAMPLED_CASES)]
        req = constrained_request(reference.prompt_ids(case.prompt), case.constraint, case.max_tokens)
        req.sampling.temperature, req.sampling.top_p, req.sampling.seed, req.sampling.n = 1.0, 0.95, 1000 + i, NUM_SAMPLES
        requests.append((case, req))
    results = [None] * len(requests)

    def run(i):
        results[i] = collect(svc.stub.Generate(requests[i][1], timeout=600))

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(requests))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    num_draws = num_cut = 0
    for (case, _), result in zip(requests, results):
        assert len(result["outputs"]) == NUM_SAMPLES
        for out in result["outputs"].values():
            num_draws += 1
            if out["finish_reason"] == pb.FINISH_REASON_EOS:
                assert case.valid(out["text"]), (case.name, out["text"])
            else:
                assert out["finish_reason"] == pb.FINISH_REASON_LENGTH, out
                assert reference.is_valid_prefix(case.constraint, out["token_ids"]), (case.name, out["text"])
                num_cut += 1
    assert num_draws == 200
    assert num_cut <= 10, f"{num_cut} of 200 draws ran out of tokens"
    texts = {out["text"] for result in results for out in result["outputs"].values()}
    assert len(texts) > 20  # sampled, not one answer repeated


BAD = [
    ("json_schema", '{"type": "foo"}', 'constraint.json_schema: does not compile: Unsupported type "foo"'),
    ("json_schema", "{oops", "constraint.json_schema: is not valid JSON"),
    ("regex", "(a", "constraint.regex: does not compile: Regex parsing error"),
    ("grammar", 'root ::= "a" |', "constraint.grammar: does not compile: EBNF parser error"),
    ("structural_tag", '{"type": "nope"}', "constraint.structural_tag: does not compile: Invalid structural tag"),
]


@pytest.mark.parametrize("kind,value,message", BAD)
def test_a_bad_constraint_is_invalid_argument_before_any_work(svc, expected, kind, value, message):
    req = greedy_request(prompt_ids=expected["choice"][0], max_tokens=4)
    setattr(req.constraint, kind, value)
    with pytest.raises(grpc.RpcError) as info:
        collect(svc.stub.Generate(req, timeout=120))
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert info.value.details().startswith(message), info.value.details()


def test_constraints_with_beam_search_or_ignore_eos_are_refused_and_the_service_serves_on(svc, expected):
    for field, value, message in (("beam_width", 2, "constraint: is not supported with beam search"),
                                  ("ignore_eos", True, "stopping.ignore_eos: cannot be combined with a constraint")):
        req = constrained_request(expected["choice"][0], Constraint.choice(["a", "b"]), 4)
        setattr(req.sampling if field == "beam_width" else req.stopping, field, value)
        with pytest.raises(grpc.RpcError) as info:
            collect(svc.stub.Generate(req, timeout=60))
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT and info.value.details().startswith(message)
    assert svc.wait_all_blocks_free().num_running == 0


def test_the_client_library_and_the_cli_take_a_constraint(svc, expected, tmp_path):
    target = f"127.0.0.1:{svc.port}"
    choice = next(c for c in CASES if c.name == "choice")
    person = next(c for c in CASES if c.name == "json_schema")
    with Client(target) as client:
        got = client.chat([{"role": "user", "content": person.prompt}], max_tokens=person.max_tokens,
                          temperature=0.0, json_schema=PERSON_SCHEMA).collect()
        assert got.outputs[0].token_ids == expected["json_schema"][1] and person.valid(got.outputs[0].text)
    run = pagoda("generate", choice.prompt, "--chat", "--temperature", "0", "--max-tokens", "8",
                 "--choice", ",".join(choice.constraint.choices), "--target", target)
    assert run.returncode == 0, run.stderr
    assert run.stdout.strip() in choice.constraint.choices
    schema = tmp_path / "person.json"
    schema.write_text(person.constraint.value)
    run = pagoda("generate", person.prompt, "--chat", "--temperature", "0", "--max-tokens", "32",
                 "--json-schema", str(schema), "--target", target)
    assert run.returncode == 0, run.stderr
    assert person.valid(run.stdout.strip()), run.stdout


def test_failover_mid_stream_keeps_the_constrained_output_valid(svc, expected, reference):
    """Last: it kills one of the two executors."""
    prompt, want = expected["failover"]
    constraint = CASES[-1].constraint
    stream = Stream(svc.stub, "failover", request=constrained_request(prompt, constraint, 48))
    stream.wait_tokens(6)
    assert not stream.done
    victim = next(p for p in svc.executors if (info_of(svc, p) or pb.ExecutorInfo()).num_running > 0)
    victim.send_signal(signal.SIGKILL)
    victim.wait(timeout=10)
    out = stream.result()["outputs"][0]
    assert 6 <= stream.num_tokens and out["token_ids"] == want  # nothing lost or repeated, the grammar followed
    assert reference.is_valid_prefix(constraint, out["token_ids"])
    assert "moving its requests" in (svc.logdir / "scheduler.log").read_text()
