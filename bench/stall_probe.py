"""Stall probe (issue 43): can one tenant stall the others through grammars or running slots?

    python bench/stall_probe.py                        # the default model, every scenario, full size
    python bench/stall_probe.py --quick                # a tiny random model, small loads (CI's size)
    python bench/stall_probe.py --scenarios hostile --max-length 100000
    python bench/stall_probe.py --quick --scenarios quiet,tools   # 128 tools, tool_choice "required"

One scheduler with three API-key tenants and one executor (tests/service/harness.py). In each
scenario the *attacker* tenant starts its load (from a process of its own: its replies keep
that process busy, not the one that times the others), then the *bystander* tenant streams an
unconstrained request and the *third* tenant sends a one-field JSON schema request. Reported per
scenario: the bystander's first-token wait and its largest gap between two streamed messages,
the third tenant's first-token wait, and the attacker's statuses. Scenarios:

    quiet    no attacker (the baseline of the same run)
    hostile  `--hostile` JSON schemas of eight strings with maxLength `--max-length`, distinct
    short    `--short-streams` short streams (max_tokens 4) at once
    long     `--long-streams` long streams (max_tokens `--long-tokens`, ignore_eos) at once
    texts    `--texts` Tokenize calls of `--text-chars` characters each at once (work for the
             prompt worker's threads, which every Generate passes through)
    tools    `--tool-requests` chat requests of `--tools` tools each (three-parameter functions,
             distinct names) with tool_choice "required", as the gateway sends them (Chat.tools
             and the constraint of gateway_svc/tools.py: the hermes calls' structural tag); 128
             tools with --quick, whose tiny model's context is set to hold their ~11,600 prompt
             tokens; 64 by default (~5,800), as the default model's 8,192 hold no more. The third
             tenant's request is then one tool's "required" call instead of a schema. Reported too: each
             tool request's own time to answer (`attacker.calls`); the attacker's requests run
             to their end here (`--max-tool-answer` bounds them)

Writes bench/out/stall_probe-<timestamp>.json. Exits 1 when a bystander's or third tenant's
request failed, or under attack (not `quiet`, which also pays the compile processes' cold
start) a first token took longer than `--max-first-token` or a bystander's token gap longer than
`--max-gap` (tests/service/test_stall_probe.py runs `--quick` with generous bounds). Timings on a shared machine are noisy: compare runs
of the same machine, side by side.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repository root, when run as a script

import grpc  # noqa: E402

from bench.common import OUT_DIR, exit_on_sigterm, format_table, timestamp, write_json  # noqa: E402
from pagoda.v1 import generation_pb2 as pb  # noqa: E402
from pagoda.v1 import generation_pb2_grpc as pb_grpc  # noqa: E402

KEYS = {"attacker": "attacker-key-0123456789abcdef", "bystander": "bystander-key-0123456789abcdef", "third": "third-key-0123456789abcdef"}
STREAMS_PER_CONNECTION = 200
SCENARIOS = ("quiet", "hostile", "short", "long", "texts", "tools")
# texts is left out of --quick (CI): its Tokenize calls keep both cores busy, and the third tenant's
# compiles then wait for CPU (6.6 s once); tests/unit/test_fair_prompts.py tests its queue's turns
QUICK_SCENARIOS = ("quiet", "hostile", "short", "long", "tools")
FULL_SIZES = {"hostile": 3, "max_length": 100000, "short_streams": 3000, "long_streams": 256, "long_tokens": 512,
              "texts": 1000, "text_chars": 90000, "bystander_tokens": 32, "tool_requests": 2, "tools": 64}
QUICK_SIZES = {"hostile": 2, "max_length": 1000, "short_streams": 300, "long_streams": 48, "long_tokens": 500,
               "texts": 100, "text_chars": 90000, "bystander_tokens": 200, "tool_requests": 1, "tools": 128}


def hostile_schema(max_length: int, tag: int) -> str:
    props = {f"s{tag}_{i}": {"type": "string", "maxLength": max_length} for i in range(8)}
    return json.dumps({"type": "object", "properties": props, "required": list(props)})


VERBS = ("get", "set", "list", "create", "delete", "update", "search", "send", "check", "book", "cancel", "convert",
         "schedule", "find", "count", "rate")
NOUNS = ("weather", "stock", "event", "email", "invoice", "flight", "hotel", "order")
PARAMS = (("city", {"type": "string"}), ("days", {"type": "integer", "minimum": 1, "maximum": 14}),
          ("unit", {"type": "string", "enum": ["metric", "imperial"]}), ("query", {"type": "string"}),
          ("limit", {"type": "integer"}), ("urgent", {"type": "boolean"}), ("amount", {"type": "number"}))
TOOL_MAX_TOKENS = 48
TINY_CONTEXT = 16384


def many_tools(n: int, tag: int) -> list[dict]:
    """`n` functions of three parameters each (one required), in OpenAI's shape; names distinct
    within and across tags (no two requests' grammars alike)."""
    tools = []
    for i in range(n):
        verb, noun = VERBS[i % len(VERBS)], NOUNS[(i // len(VERBS)) % len(NOUNS)]
        props = dict(PARAMS[(i + k) % len(PARAMS)] for k in range(3))
        tools.append({"type": "function", "function": {
            "name": f"{verb}_{noun}_{tag}_{i}", "description": f"{verb.capitalize()} {noun}s.",
            "parameters": {"type": "object", "properties": props, "required": list(props)[:1]}}})
    return tools


def tools_request(request_id: str, tools: list[dict], max_tokens: int = TOOL_MAX_TOKENS) -> pb.GenerateRequest:
    """A chat request with `tools` and tool_choice "required", with the constraint the gateway
    sends for it (gateway_svc/tools.py: the hermes calls' structural tag)."""
    from gateway_svc.schemas import ChatCompletionRequest
    from gateway_svc.tools import structured

    content = "What is the weather in Paris for the next three days?"
    body = ChatCompletionRequest(model="m", messages=[{"role": "user", "content": content}], tools=tools,
                                 tool_choice="required")
    ((kind, value),) = structured(body).params.items()
    req = pb.GenerateRequest(request_id=request_id)
    req.chat.messages.add(role="user", content=content)
    for t in tools:
        f = t["function"]
        req.chat.tools.add(name=f["name"], description=f["description"], parameters=json.dumps(f["parameters"]))
    req.sampling.temperature = 0.0
    req.stopping.max_tokens = max_tokens
    setattr(req.constraint, kind, value if isinstance(value, str) else json.dumps(value))
    return req


def request(request_id: str, prompt: list[int], max_tokens: int, schema: str | None = None, ignore_eos: bool = False) -> pb.GenerateRequest:
    req = pb.GenerateRequest(request_id=request_id)
    req.token_ids.ids.extend(prompt)
    req.sampling.temperature = 0.0
    req.stopping.max_tokens = max_tokens
    req.stopping.ignore_eos = ignore_eos
    if schema is not None:
        req.constraint.json_schema = schema
    return req


async def stream(stub, req: pb.GenerateRequest, key: str, timeout: float) -> dict:
    """One Generate stream: its first-token wait, largest gap between messages, status."""
    t0 = time.monotonic()
    times = []
    code = "OK"
    error = None
    try:
        async for message in stub.Generate(req, metadata=(("authorization", f"Bearer {key}"),), timeout=timeout):
            if any(out.token_ids for out in message.outputs):
                times.append(time.monotonic())
    except grpc.aio.AioRpcError as exc:
        code = exc.code().name
        error = (exc.details() or "")[:300]
    except asyncio.CancelledError:
        code = "CANCELLED"
    gaps = [b - a for a, b in zip(times, times[1:])]
    return {
        "status": code,
        "first_token_s": round(times[0] - t0, 3) if times else None,
        "max_gap_s": round(max(gaps), 3) if gaps else None,
        "tokens": len(times),
        "total_s": round(time.monotonic() - t0, 3),
        **({"error": error} if error else {}),
    }


async def call(stub, req, key: str, timeout: float) -> dict:
    """One attacker call: a Generate stream, or a Tokenize call."""
    if isinstance(req, pb.GenerateRequest):
        return await stream(stub, req, key, timeout)
    try:
        await stub.Tokenize(req, metadata=(("authorization", f"Bearer {key}"),), timeout=timeout)
    except grpc.aio.AioRpcError as exc:
        return {"status": exc.code().name}
    except asyncio.CancelledError:
        return {"status": "CANCELLED"}
    return {"status": "OK"}


def attacker_requests(scenario: str, args) -> list[pb.GenerateRequest | pb.TokenizeRequest]:
    if scenario == "texts":  # distinct words: no two texts alike
        return [pb.TokenizeRequest(text=" ".join(f"w{i}x{j}" for j in range(args.text_chars // 9))) for i in range(args.texts)]
    if scenario == "hostile":
        return [request(f"h{i}", [1, 20, 30, 40], 16, hostile_schema(args.max_length, i)) for i in range(args.hostile)]
    if scenario == "short":
        return [request(f"s{i}", [1, 21 + i % 50, 31, 41], 4, ignore_eos=True) for i in range(args.short_streams)]
    if scenario == "tools":
        return [tools_request(f"tools{i}", many_tools(args.tools, i)) for i in range(args.tool_requests)]
    if scenario == "long":
        return [request(f"l{i}", [1, 22 + i % 50, 32, 42], args.long_tokens, ignore_eos=True) for i in range(args.long_streams)]
    return []


async def attack(target: str, scenario: str, args) -> None:
    """The attacker's load, in a process of its own (`--attack`): its streams' replies keep this
    process busy, not the probe's, so the bystander's figures are the service's alone. Its calls
    go over as many connections as it takes to have them all open at once. Prints
    `started` once every stream is sent, then on a line (or EOF) on stdin cancels the rest and
    prints their statuses as one JSON line (with `calls`, each call's figures, for tools). On
    `wait` instead of a line it lets every call end first."""
    reqs = attacker_requests(scenario, args)
    # a connection of its own per STREAMS_PER_CONNECTION calls (the server's limit per connection is 256)
    channels = [
        grpc.aio.insecure_channel(target, options=[("grpc.use_local_subchannel_pool", 1)])
        for _ in range(-(-len(reqs) // STREAMS_PER_CONNECTION))
    ]
    try:
        stubs = [pb_grpc.GenerationStub(channel) for channel in channels]
        tasks = [
            asyncio.ensure_future(call(stubs[i // STREAMS_PER_CONNECTION], req, KEYS["attacker"], args.timeout))
            for i, req in enumerate(reqs)
        ]
        await asyncio.sleep(0)
        print("started", flush=True)
        loop = asyncio.get_running_loop()
        line = await loop.run_in_executor(None, sys.stdin.readline)
        if line.strip() != "wait":
            for task in tasks:
                task.cancel()
        results = await asyncio.gather(*tasks, return_exceptions=True)
    finally:
        for channel in channels:
            await channel.close()
    statuses: dict[str, int] = {}
    for r in results:
        name = r["status"] if isinstance(r, dict) else "CANCELLED"
        statuses[name] = statuses.get(name, 0) + 1
    calls = [r for r in results if isinstance(r, dict)] if scenario == "tools" else None
    print(json.dumps(statuses if calls is None else {**statuses, "calls": calls}), flush=True)


async def scenario_run(target: str, scenario: str, args) -> dict:
    attacker = None
    if attacker_requests(scenario, args):
        sizes = [f"--{name.replace('_', '-')}={getattr(args, name)}" for name in FULL_SIZES]
        attacker = await asyncio.create_subprocess_exec(
            sys.executable, __file__, f"--attack={scenario}", f"--target={target}", f"--timeout={args.timeout}", *sizes,
            stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE,
        )
        if (await attacker.stdout.readline()).strip() != b"started":
            raise RuntimeError(f"the attacker process of {scenario!r} did not start (exit {await attacker.wait()})")
        await asyncio.sleep(args.head_start)
    async with grpc.aio.insecure_channel(target) as channel:
        stub = pb_grpc.GenerationStub(channel)
        bystander_req = request(f"b-{scenario}", [1, 50, 51, 52], args.bystander_tokens, ignore_eos=True)
        field = f"ok_{scenario}"  # a schema of its own in each scenario: never a cached verdict
        third_req = request(f"t-{scenario}", [1, 60, 61, 62], 16, json.dumps({"type": "object", "properties": {field: {"type": "boolean"}}, "required": [field]}))
        if scenario == "tools":  # one small tool call of its own
            third_req = tools_request("t-tools", many_tools(1, 1000))
        bystander, third = await asyncio.gather(
            stream(stub, bystander_req, KEYS["bystander"], args.timeout),
            stream(stub, third_req, KEYS["third"], args.timeout),
        )
    statuses: dict[str, int] = {}
    if attacker is not None:
        out, _ = await attacker.communicate(b"wait\n" if scenario == "tools" else b"stop\n")
        statuses = json.loads(out.decode().strip().splitlines()[-1])
    return {"bystander": bystander, "third": third, "attacker": statuses}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None, help="model to serve (default: the default model; --quick: a tiny random one)")
    parser.add_argument("--target", default=None, help="host:port of a running service with KEYS' tenants (default: spawn one)")
    parser.add_argument("--scenarios", default=None, help=f"default {','.join(SCENARIOS)}, --quick: {','.join(QUICK_SCENARIOS)}")
    parser.add_argument("--hostile", type=int, default=None, help=f"default {FULL_SIZES['hostile']}, --quick: {QUICK_SIZES['hostile']}")
    parser.add_argument("--max-length", type=int, default=None, help=f"default {FULL_SIZES['max_length']}, --quick: {QUICK_SIZES['max_length']}")
    parser.add_argument("--short-streams", type=int, default=None, help=f"default {FULL_SIZES['short_streams']}, --quick: {QUICK_SIZES['short_streams']}")
    parser.add_argument("--long-streams", type=int, default=None, help=f"default {FULL_SIZES['long_streams']}, --quick: {QUICK_SIZES['long_streams']}")
    parser.add_argument("--long-tokens", type=int, default=None, help=f"default {FULL_SIZES['long_tokens']}, --quick: {QUICK_SIZES['long_tokens']}")
    parser.add_argument("--texts", type=int, default=None, help=f"default {FULL_SIZES['texts']}, --quick: {QUICK_SIZES['texts']}")
    parser.add_argument("--text-chars", type=int, default=None, help=f"default {FULL_SIZES['text_chars']}, --quick: {QUICK_SIZES['text_chars']}")
    parser.add_argument("--bystander-tokens", type=int, default=None, help=f"default {FULL_SIZES['bystander_tokens']}, --quick: {QUICK_SIZES['bystander_tokens']}")
    parser.add_argument("--tool-requests", type=int, default=None, help=f"default {FULL_SIZES['tool_requests']}, --quick: {QUICK_SIZES['tool_requests']}")
    parser.add_argument("--tools", type=int, default=None, help=f"tools of each, default {FULL_SIZES['tools']}")
    parser.add_argument("--max-tool-answer", type=float, default=None,
                        help="exit 1 past this time to answer (s) of a tool request")
    parser.add_argument("--head-start", type=float, default=2.0, help="seconds the attacker's load runs before the others send")
    parser.add_argument("--timeout", type=float, default=180.0, help="client deadline of every request, s")
    parser.add_argument("--max-first-token", type=float, default=None, help="exit 1 past this first-token wait (s) under attack")
    parser.add_argument("--max-gap", type=float, default=None, help="exit 1 past this bystander token gap (s) under attack")
    parser.add_argument("--quick", action="store_true", help="tiny model, 2 hostile schemas of maxLength 1000, 300 short, "
                        "48 long streams of 500 tokens, a bystander of 200 tokens, one request of 128 tools (the random model's "
                        f"context set to {TINY_CONTEXT}); no texts scenario unless named")
    parser.add_argument("--attack", default=None, help=argparse.SUPPRESS)  # the attacker's process (scenario_run)
    parser.add_argument("--scheduler-arg", action="append", default=[], help="extra scheduler flag (repeatable), e.g. --max-num-seqs=64")
    args = parser.parse_args()
    exit_on_sigterm()  # the service is stopped on SIGTERM too
    sizes = QUICK_SIZES if args.quick else FULL_SIZES
    for name, value in sizes.items():  # a size given on the command line wins over --quick's
        if getattr(args, name) is None:
            setattr(args, name, value)
    if args.attack:
        asyncio.run(attack(args.target, args.attack, args))
        return 0
    if args.scenarios is None:
        args.scenarios = ",".join(QUICK_SCENARIOS if args.quick else SCENARIOS)
    scenarios = [s for s in args.scenarios.split(",") if s]
    if unknown := set(scenarios) - set(SCENARIOS):
        parser.error(f"unknown scenarios {sorted(unknown)}")

    report: dict = {"args": vars(args), "scenarios": {}}
    with tempfile.TemporaryDirectory() as tmp:
        if args.target:
            target = args.target
            ctx = None
        else:
            from tests.service.harness import Service

            model = args.model
            if model is None and args.quick:
                from bench.fuzz import tiny_model

                model = str(tiny_model(Path(tmp) / "tiny"))
                # 128 tools' descriptions are ~11,600 prompt tokens: a context that holds them
                # (the random model's rotary positions go on past its 1,024)
                config = json.loads((Path(model) / "config.json").read_text())
                config["max_position_embeddings"] = TINY_CONTEXT
                (Path(model) / "config.json").write_text(json.dumps(config))
            keys = Path(tmp) / "keys"
            keys.write_text("".join(f"{key} {tenant}\n" for tenant, key in KEYS.items()))
            ctx = Service(
                model, scheduler_args=["--api-key-file", str(keys), *args.scheduler_arg],
                executor_args=["--num-kv-blocks", "2048"], api_key=KEYS["bystander"],
            )
            ctx.start()
            target = f"127.0.0.1:{ctx.port}"
        try:
            for scenario in scenarios:
                t0 = time.monotonic()
                result = asyncio.run(scenario_run(target, scenario, args))
                result["wall_s"] = round(time.monotonic() - t0, 1)
                report["scenarios"][scenario] = result
                print(f"{scenario}: {json.dumps(result)}", flush=True)
                time.sleep(1.0)
        finally:
            if ctx is not None:
                ctx.stop()
    rows = [
        [s, r["bystander"]["first_token_s"], r["bystander"]["max_gap_s"], r["bystander"]["status"],
         r["third"]["first_token_s"], r["third"]["status"],
         json.dumps({k: v for k, v in r["attacker"].items() if k != "calls"}), r["wall_s"]]
        for s, r in report["scenarios"].items()
    ]
    print(format_table(["scenario", "bystander first token s", "bystander max gap s", "bystander", "third first token s", "third", "attacker", "wall s"], rows))
    path = write_json(OUT_DIR / f"stall_probe-{timestamp()}.json", report)
    print(f"wrote {path}")
    bad = [
        (s, who, r[who]) for s, r in report["scenarios"].items() for who in ("bystander", "third")
        if r[who]["status"] != "OK" or r[who]["first_token_s"] is None
        or (s != "quiet" and args.max_first_token is not None and r[who]["first_token_s"] > args.max_first_token)
        or (s != "quiet" and who == "bystander" and args.max_gap is not None and (r[who]["max_gap_s"] or 0) > args.max_gap)
    ]
    for s, r in report["scenarios"].items():
        for i, c in enumerate(r["attacker"].get("calls", [])):
            print(f"{s}: tool request {i} ({args.tools} tools): {c['status']}, first token {c['first_token_s']} s, "
                  f"answered in {c['total_s']} s")
            if c["status"] != "OK" or (args.max_tool_answer is not None and c["total_s"] > args.max_tool_answer):
                bad.append((s, f"tool request {i}", c))
    if bad:
        print(f"failed, or over --max-first-token {args.max_first_token} / --max-gap {args.max_gap} / --max-tool-answer "
              f"{args.max_tool_answer} under attack: {bad}")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
