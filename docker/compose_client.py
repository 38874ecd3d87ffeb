"""Host-side gRPC client for scripts/compose_test.sh (runs with the repository's .venv).

    python docker/compose_client.py wait     --target 127.0.0.1:50051 --executors 2
    python docker/compose_client.py stream   --target ... [--max-tokens 32]
    python docker/compose_client.py failover --target ... --streams 6 --max-tokens 48 \
        --kill-project pagoda-compose-test --executors-after 2
    python docker/compose_client.py gateway  --target ... --gateway http://127.0.0.1:8000

Stubs: the repository's pagoda/v1 (`make protos`); when those are missing they are generated from
protos/ into a temporary folder. Every line of output starts with "client:"; the last line of
`stream` and `failover` is a one-line summary. Exit status 0 means every check passed.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def load_stubs():
    if (ROOT / "pagoda" / "v1" / "generation_pb2_grpc.py").is_file():
        sys.path.insert(0, str(ROOT))
    else:
        from grpc_tools import protoc

        out = tempfile.mkdtemp(prefix="pagoda-stubs-")
        protos = sorted(str(p.relative_to(ROOT / "protos")) for p in (ROOT / "protos").rglob("*.proto"))
        rc = protoc.main(["protoc", f"-I{ROOT / 'protos'}", f"--python_out={out}", f"--grpc_python_out={out}", *protos])
        if rc != 0:
            raise SystemExit(f"client: protoc failed ({rc})")
        sys.path.insert(0, out)
    from pagoda.v1 import generation_pb2, generation_pb2_grpc

    return generation_pb2, generation_pb2_grpc


import grpc  # noqa: E402
from grpc_health.v1 import health_pb2, health_pb2_grpc  # noqa: E402

pb, pb_grpc = load_stubs()

PROMPTS = [
    "Write a short story about a lighthouse keeper who finds a message in a bottle.",
    "Explain how a paged KV cache works in a language model server.",
    "List five facts about the planet Mars.",
    "Describe the water cycle to a ten year old.",
    "What are the benefits of unit tests? Answer in detail.",
    "Write a poem about autumn leaves and cold wind.",
    "Summarize the plot of a detective novel you invent.",
    "Give step by step instructions for brewing tea.",
]


def say(msg: str) -> None:
    print(f"client: {msg}", flush=True)


def server_info(stub, timeout=5.0):
    return stub.GetServerInfo(pb.GetServerInfoRequest(), timeout=timeout)


def healthy_executors(info) -> list:
    return [e for e in info.executors if e.healthy]


def health_status(channel) -> str:
    try:
        reply = health_pb2_grpc.HealthStub(channel).Check(
            health_pb2.HealthCheckRequest(service="pagoda.v1.Generation"), timeout=3
        )
        return health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)
    except grpc.RpcError as err:
        return err.code().name


def cmd_wait(args, channel, stub) -> int:
    deadline = time.monotonic() + args.timeout
    start = time.monotonic()
    last = None
    while time.monotonic() < deadline:
        status = health_status(channel)
        n = -1
        if status == "SERVING":
            try:
                n = len(healthy_executors(server_info(stub)))
            except grpc.RpcError as err:
                status = f"GetServerInfo {err.code().name}"
        state = (status, n)
        if state != last:
            say(f"wait: health={status} healthy_executors={n} (t={time.monotonic() - start:.1f}s)")
            last = state
        enough = n == args.executors if args.exact else n >= args.executors
        if status == "SERVING" and enough:
            say(f"wait: ready with {n} executor(s) after {time.monotonic() - start:.1f}s")
            return 0
        time.sleep(1.0)
    say(f"wait: FAILED, still health={last[0] if last else '?'} executors={last[1] if last else '?'} after {args.timeout}s")
    return 1


@dataclass
class StreamResult:
    prompt: str
    request_id: str
    max_tokens: int
    token_ids: list = field(default_factory=list)
    text: str = ""
    finish_reason: int = 0
    completion_tokens: int = -1
    messages: int = 0
    error: str = ""
    first_token_s: float = -1.0
    total_s: float = -1.0
    tokens_seen: threading.Event = field(default_factory=threading.Event)

    @property
    def finish_name(self) -> str:
        return pb.FinishReason.Name(self.finish_reason)

    def problems(self) -> list[str]:
        out = []
        if self.error:
            out.append(f"error {self.error}")
        if self.finish_reason != pb.FINISH_REASON_LENGTH:
            out.append(f"finish_reason {self.finish_name} (want FINISH_REASON_LENGTH)")
        if len(self.token_ids) != self.max_tokens:
            out.append(f"{len(self.token_ids)} streamed tokens (want {self.max_tokens})")
        if self.completion_tokens != len(self.token_ids):
            out.append(f"usage.completion_tokens {self.completion_tokens} != streamed {len(self.token_ids)}")
        return out


def make_request(prompt: str, max_tokens: int, request_id: str):
    return pb.GenerateRequest(
        request_id=request_id,
        chat=pb.Chat(messages=[pb.ChatMessage(role="user", content=prompt)]),
        sampling=pb.SamplingParams(temperature=0.0),
        stopping=pb.StoppingCriteria(max_tokens=max_tokens, ignore_eos=True),
    )


def run_stream(stub, res: StreamResult, timeout: float, notify_after: int) -> None:
    start = time.monotonic()
    try:
        for msg in stub.Generate(make_request(res.prompt, res.max_tokens, res.request_id), timeout=timeout):
            res.messages += 1
            for out in msg.outputs:
                if out.token_ids and res.first_token_s < 0:
                    res.first_token_s = time.monotonic() - start
                res.token_ids.extend(out.token_ids)
                res.text += out.text
                if out.finish_reason:
                    res.finish_reason = out.finish_reason
            if msg.HasField("usage"):
                res.completion_tokens = msg.usage.completion_tokens
            if len(res.token_ids) >= notify_after:
                res.tokens_seen.set()
    except grpc.RpcError as err:
        res.error = f"{err.code().name}: {err.details()}"
    finally:
        res.total_s = time.monotonic() - start
        res.tokens_seen.set()


def cmd_stream(args, channel, stub) -> int:
    res = StreamResult(prompt=args.prompt, request_id=f"compose-single-{uuid.uuid4().hex[:8]}", max_tokens=args.max_tokens)
    run_stream(stub, res, args.timeout, notify_after=1)
    problems = res.problems()
    say(f"stream: {len(res.token_ids)} tokens in {res.messages} messages, first token {res.first_token_s:.2f}s, "
        f"total {res.total_s:.2f}s, {res.finish_name}")
    say(f"stream: text {res.text[:160]!r}")
    say(f"SUMMARY stream: {'PASS' if not problems else 'FAIL ' + '; '.join(problems)}")
    return 0 if not problems else 1


def find_container(project: str, executor_id: str) -> tuple[str, str]:
    """The executor container of compose `project` whose log registered `executor_id`."""
    ids = subprocess.run(
        ["docker", "ps", "-q", "--filter", f"label=com.docker.compose.project={project}",
         "--filter", "label=com.docker.compose.service=executor"],
        capture_output=True, text=True, check=True,
    ).stdout.split()
    for cid in ids:
        logs = subprocess.run(["docker", "logs", cid], capture_output=True, text=True)
        if executor_id in logs.stdout or executor_id in logs.stderr:
            name = subprocess.run(["docker", "inspect", "--format", "{{.Name}}", cid],
                                  capture_output=True, text=True).stdout.strip().lstrip("/")
            return cid, f"{name}, matched by its log"
    return ids[0], "NOT matched by log: first executor container"


def cmd_failover(args, channel, stub) -> int:
    before = server_info(stub)
    say("failover: executors before: " + ", ".join(
        f"{e.executor_id}({'ok' if e.healthy else 'dead'}, running {e.num_running})" for e in before.executors))
    # Reference outputs (greedy) for the same prompts, one at a time, before anything is killed.
    prompts = [PROMPTS[i % len(PROMPTS)] for i in range(args.streams)]
    reference = {}
    if args.reference:
        t0 = time.monotonic()
        refs = [StreamResult(prompt=p, request_id=f"compose-ref-{uuid.uuid4().hex[:8]}", max_tokens=args.max_tokens)
                for p in sorted(set(prompts))]
        ref_threads = [threading.Thread(target=run_stream, args=(stub, r, args.timeout, 1), daemon=True) for r in refs]
        for t in ref_threads:
            t.start()
        for t in ref_threads:
            t.join(timeout=args.timeout)
        for ref in refs:
            if ref.problems():
                say(f"failover: reference run failed: {'; '.join(ref.problems())}")
                say("SUMMARY failover: FAIL reference runs failed")
                return 1
            reference[ref.prompt] = ref.token_ids
        say(f"failover: {len(reference)} reference stream(s), concurrent, in {time.monotonic() - t0:.1f}s")

    results = [StreamResult(prompt=p, request_id=f"compose-{i}-{uuid.uuid4().hex[:8]}", max_tokens=args.max_tokens)
               for i, p in enumerate(prompts)]
    threads = [threading.Thread(target=run_stream, args=(stub, r, args.timeout, args.kill_after_tokens), daemon=True)
               for r in results]
    t0 = time.monotonic()
    for t in threads:
        t.start()
    # Mid-stream: every stream has produced some tokens and none has finished.
    for r in results:
        r.tokens_seen.wait(timeout=args.timeout)
    mid = server_info(stub)
    say(f"failover: all {len(results)} streams mid-flight after {time.monotonic() - t0:.1f}s "
        f"(tokens so far: {[len(r.token_ids) for r in results]}); load: " + ", ".join(
            f"{e.executor_id}:{e.num_running}" for e in mid.executors))
    finished_early = [r.request_id for r in results if r.finish_reason]
    if finished_early:
        say(f"failover: WARNING {len(finished_early)} stream(s) had already finished at kill time")
    busiest = max(mid.executors, key=lambda e: e.num_running)
    t_kill = time.monotonic()
    if args.kill_project:
        victim, how = find_container(args.kill_project, busiest.executor_id)
        kill_cmd = f"docker kill {victim}"
        say(f"failover: victim {busiest.executor_id} (running {busiest.num_running}/{len(results)} streams) "
            f"is container {victim} ({how})")
    else:
        kill_cmd = args.kill_cmd.replace("{executor_id}", busiest.executor_id)
    kill = subprocess.run(kill_cmd, shell=True, capture_output=True, text=True)
    say(f"failover: killed: `{kill_cmd}` rc={kill.returncode} {kill.stdout.strip()} {kill.stderr.strip()}")
    # Detection: the scheduler should drop the dead executor within seconds.
    detected = None
    while time.monotonic() - t_kill < args.detect_timeout:
        try:
            n = len(healthy_executors(server_info(stub)))
        except grpc.RpcError:
            n = -1
        if n == args.executors_after:
            detected = time.monotonic() - t_kill
            break
        time.sleep(0.25)
    say(f"failover: dead executor detected after {detected:.1f}s" if detected is not None
        else f"failover: scheduler still reports != {args.executors_after} healthy executors after {args.detect_timeout}s")
    for t in threads:
        t.join(timeout=args.timeout)
    elapsed = time.monotonic() - t0

    failures = 0
    mismatches = 0
    for r in results:
        problems = r.problems()
        same = None
        if r.prompt in reference:
            same = r.token_ids == reference[r.prompt]
            if not same:
                mismatches += 1
        failures += bool(problems)
        say(f"failover: {r.request_id}: {len(r.token_ids)}/{r.max_tokens} tokens, {r.finish_name}, "
            f"{r.total_s:.1f}s, same-as-reference={same}" + (f", PROBLEMS: {'; '.join(problems)}" if problems else ""))
    after = server_info(stub)
    say("failover: executors after: " + ", ".join(
        f"{e.executor_id}({'ok' if e.healthy else 'dead'})" for e in after.executors)
        + f"; preemptions={after.num_preemptions}")
    ok = failures == 0 and detected is not None and kill.returncode == 0 and busiest.num_running > 0
    if args.strict_reference and mismatches:
        ok = False
    say(f"SUMMARY failover: {'PASS' if ok else 'FAIL'} {len(results) - failures}/{len(results)} streams complete "
        f"({args.max_tokens} tokens each, {elapsed:.1f}s), killed the executor running {busiest.num_running} of them "
        f"mid-stream, "
        f"detected in {detected if detected is None else round(detected, 1)}s, "
        f"{len(results) - mismatches if reference else '-'}/{len(results) if reference else '-'} identical to reference")
    return 0 if ok else 1


def cmd_gateway(args, channel, stub) -> int:
    """The gateway's greedy chat answer (openai package, streamed and not) equals the gRPC API's."""
    import openai

    deadline = time.monotonic() + args.timeout
    oai = openai.OpenAI(base_url=f"{args.gateway}/v1", api_key="compose", max_retries=0, timeout=args.timeout)
    while True:
        try:
            models = [m.id for m in oai.models.list().data]
            break
        except openai.APIError as err:
            if time.monotonic() > deadline:
                say(f"SUMMARY gateway: FAIL not reachable: {err}")
                return 1
            time.sleep(1.0)
    messages = [{"role": "user", "content": args.prompt}]
    res = StreamResult(prompt=args.prompt, request_id=f"compose-gw-{uuid.uuid4().hex[:8]}", max_tokens=args.max_tokens)
    run_stream(stub, res, args.timeout, notify_after=1)
    reply = oai.chat.completions.create(model=models[0], messages=messages, max_tokens=args.max_tokens, temperature=0,
                                        extra_body={"ignore_eos": True})
    streamed = "".join(
        e.choices[0].delta.content or "" for e in oai.chat.completions.create(
            model=models[0], messages=messages, max_tokens=args.max_tokens, temperature=0, stream=True,
            extra_body={"ignore_eos": True}) if e.choices)
    text = reply.choices[0].message.content
    ok = text == res.text == streamed and not res.error
    say(f"gateway: models {models}; answer {text[:120]!r}")
    say(f"SUMMARY gateway: {'PASS' if ok else 'FAIL'} /v1/chat/completions (openai package, streamed and not) "
        f"{'equals' if ok else 'differs from'} the gRPC API's greedy answer ({reply.usage.completion_tokens} tokens)")
    return 0 if ok else 1


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("command", choices=["wait", "stream", "failover", "gateway"])
    parser.add_argument("--gateway", default="http://127.0.0.1:8000", help="gateway: its base URL")
    parser.add_argument("--target", default=f"127.0.0.1:{os.environ.get('PAGODA_PORT', '50051')}")
    parser.add_argument("--timeout", type=float, default=300.0)
    parser.add_argument("--executors", type=int, default=1, help="wait: this many healthy executors")
    parser.add_argument("--exact", action="store_true", help="wait: exactly --executors")
    parser.add_argument("--prompt", default=PROMPTS[0])
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--streams", type=int, default=6)
    parser.add_argument("--kill-after-tokens", type=int, default=4)
    parser.add_argument("--kill-cmd", default="true", help="shell command; {executor_id} = the busiest executor")
    parser.add_argument("--kill-project", default="",
                        help="docker kill the container of this compose project running the busiest executor")
    parser.add_argument("--executors-after", type=int, default=2)
    parser.add_argument("--detect-timeout", type=float, default=30.0)
    parser.add_argument("--no-reference", dest="reference", action="store_false")
    parser.add_argument("--strict-reference", action="store_true",
                        help="fail when a resumed stream differs from its greedy reference")
    args = parser.parse_args()
    with grpc.insecure_channel(args.target) as channel:
        stub = pb_grpc.GenerationStub(channel)
        return {"wait": cmd_wait, "stream": cmd_stream, "failover": cmd_failover,
                "gateway": cmd_gateway}[args.command](args, channel, stub)


if __name__ == "__main__":
    sys.exit(main())
