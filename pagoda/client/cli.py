"""`pagoda`: the command line of the client library (also `python -m pagoda`).

    pagoda generate "Once upon a time" --max-tokens 64 --temperature 0
    pagoda generate "Is it sunny?" --chat --choice yes,no   # also --json-schema FILE, --regex, --grammar FILE
    pagoda chat --system "You are terse."          # interactive; /reset, /exit
    pagoda info                                     # model, LoRA adapters, executors, blocks, load
    pagoda load-lora sql-lora ./sql-adapter         # a LoRA adapter (PEFT folder or ORG/NAME) at run time
    pagoda generate "SELECT" --model sql-lora       # ... selected per request (chat takes --model too)
    pagoda unload-lora sql-lora
    pagoda bench --num-requests 16 --output-len 64  # bench/loadgen.py against --target
    pagoda embed "a query" "a passage"              # a pooling model's vectors, one JSON line each
    pagoda rerank "a query" "doc one" "doc two"     # a cross-encoder's scores, best first

Every command takes the connection flags (`--target`, `--api-key`, `--ssl-*`; each also
reads its `PAGODA_*` variable, `--target` ← `PAGODA_TARGET`). When no target accepts a connection
within `--connect-timeout` seconds (3), the command fails at once with one line naming them.
"""

from __future__ import annotations

import argparse
import base64
import json
import mimetypes
import sys
import time
from dataclasses import asdict
from pathlib import Path

import grpc

from pagoda.cli import add_flag
from pagoda.client import Client, GenerateParams, PagodaError
from pagoda.client.flags import add_connection_flags, client_options

REPO_ROOT = Path(__file__).resolve().parents[2]


def _parent() -> argparse.ArgumentParser:
    parent = argparse.ArgumentParser(add_help=False)
    add_connection_flags(parent)
    parent.add_argument("--timeout", type=float, default=None, help="deadline of each call in seconds")
    add_flag(parent, "--connect-timeout", type=float, default=3.0,
             help="give up when no target accepts a connection within this many seconds (0: wait as calls do)")
    return parent


def wait_connected(client: Client, timeout: float) -> str | None:
    """The first target whose channel becomes ready within `timeout` seconds, else None."""
    channels = [client.connection.channel(t) for t in client.targets]
    try:
        ready = [grpc.channel_ready_future(c) for c in channels]
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            for target, future in zip(client.targets, ready):
                if future.done():
                    return target
            time.sleep(0.02)
        return None
    finally:
        for c in channels:
            c.close()


def _add_sampling_flags(p: argparse.ArgumentParser) -> None:
    # Not PAGODA_MODEL: that is the scheduler's and executors' --model (the base's weights).
    p.add_argument("--model", metavar="NAME", help="the LoRA adapter to apply, by name (default: the base model)")
    g = p.add_argument_group("sampling and stopping")
    g.add_argument("--max-tokens", type=int, default=256)
    g.add_argument("--temperature", type=float, default=None, help="0 = greedy (server default 1)")
    g.add_argument("--top-p", type=float)
    g.add_argument("--top-k", type=int)
    g.add_argument("--min-p", type=float)
    g.add_argument("--seed", type=int)
    g.add_argument("--presence-penalty", type=float)
    g.add_argument("--frequency-penalty", type=float)
    g.add_argument("--repetition-penalty", type=float)
    g.add_argument("--min-tokens", type=int)
    g.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    g.add_argument("--stop-token-id", action="append", type=int, default=[], help="stop token id (repeatable)")
    g.add_argument("--ignore-eos", action="store_true")
    c = p.add_argument_group("structured output (at most one)").add_mutually_exclusive_group()
    c.add_argument("--json-schema", metavar="FILE", type=Path, help="the output is JSON matching this JSON Schema file")
    c.add_argument("--json-object", action="store_true", help="the output is a JSON object")
    c.add_argument("--regex", help="the output matches this regular expression")
    c.add_argument("--choice", metavar="A,B,C", help="the output is one of these comma-separated strings")
    c.add_argument("--grammar", metavar="FILE", type=Path, help="the output follows this EBNF (GBNF) grammar file, rule root")


def _params(args: argparse.Namespace, **extra) -> GenerateParams:
    return GenerateParams(
        max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p, top_k=args.top_k,
        min_p=args.min_p, seed=args.seed, presence_penalty=args.presence_penalty,
        frequency_penalty=args.frequency_penalty, repetition_penalty=args.repetition_penalty,
        min_tokens=args.min_tokens, stop=args.stop, stop_token_ids=args.stop_token_id, ignore_eos=args.ignore_eos,
        json_schema=args.json_schema.read_text() if args.json_schema else None, json_object=args.json_object,
        regex=args.regex, choice=args.choice.split(",") if args.choice else None,
        grammar=args.grammar.read_text() if args.grammar else None, model=args.model,
        **extra,
    )


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="pagoda", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    parent = _parent()

    gen = sub.add_parser("generate", parents=[parent], help="stream a completion of a prompt")
    gen.add_argument("prompt", help='the prompt text ("-" reads standard input)')
    gen.add_argument("--chat", action="store_true", help="send the prompt as a user message (chat template)")
    gen.add_argument("--system", help="system message (with --chat)")
    gen.add_argument("--n", type=int, default=None, help="samples (printed one after another)")
    gen.add_argument("--logprobs", type=int, default=None, metavar="K", help="print tokens with logprobs and top K")
    gen.add_argument("--json", action="store_true", help="print each chunk as a JSON line")
    gen.add_argument("--usage", action="store_true", help="print token counts to standard error")
    _add_sampling_flags(gen)

    chat = sub.add_parser("chat", parents=[parent], help="interactive chat (history kept; /reset, /exit)")
    chat.add_argument("--system", help="system message")
    chat.add_argument("--image", action="append", default=[], metavar="FILE",
                      help="an image (PNG, JPEG, WebP, GIF) sent with the first message, for a vision-language model; repeatable")
    _add_sampling_flags(chat)

    sub.add_parser("info", parents=[parent], help="model, LoRA adapters, executors, KV blocks and load")

    load = sub.add_parser("load-lora", parents=[parent], help="load a LoRA adapter on the scheduler at run time")
    load.add_argument("lora_name", metavar="NAME", help="the name requests select it by (--model NAME)")
    load.add_argument("lora_path", metavar="PATH",
                      help="a PEFT folder on the scheduler's host, or ORG/NAME on the Hugging Face hub")
    unload = sub.add_parser("unload-lora", parents=[parent], help="unload a LoRA adapter (requests in flight finish)")
    unload.add_argument("lora_name", metavar="NAME")

    embed = sub.add_parser("embed", parents=[parent], help="embed texts with a pooling model (--runner pooling)")
    embed.add_argument("texts", nargs="+", metavar="TEXT", help='texts to embed ("-": one per line of standard input)')
    embed.add_argument("--normalize", action=argparse.BooleanOptionalAction, default=None,
                       help="L2-normalize the vectors (default: as the model's folder says)")
    embed.add_argument("--dimensions", type=int, help="cut a Matryoshka model's vectors to this size")
    embed.add_argument("--truncate-prompt-tokens", type=int, metavar="K", help="cut texts longer than the model to K tokens")
    embed.add_argument("--usage", action="store_true", help="print the token count to standard error")
    rerank = sub.add_parser("rerank", parents=[parent], help="score documents against a query with a cross-encoder")
    rerank.add_argument("query")
    rerank.add_argument("documents", nargs="+", metavar="DOCUMENT")
    rerank.add_argument("--top-n", type=int, help="only the best N")

    sub.add_parser("bench", parents=[parent], add_help=False,
                   help="the load generator, bench/loadgen.py (its flags pass through; --help lists them)")
    args, rest = parser.parse_known_args(argv)
    if rest and args.command != "bench":
        parser.error(f"unrecognized arguments: {' '.join(rest)}")
    args.loadgen_args = rest
    return args


# -- commands ------------------------------------------------------------------------


def cmd_generate(client: Client, args: argparse.Namespace) -> int:
    prompt = sys.stdin.read() if args.prompt == "-" else args.prompt
    params = _params(args, n=args.n, logprobs=args.logprobs is not None, top_logprobs=args.logprobs or 0)
    if args.chat:
        messages = ([{"role": "system", "content": args.system}] if args.system else []) + \
            [{"role": "user", "content": prompt}]
        stream = client.chat(messages, params)
    else:
        stream = client.generate(prompt, params)
    if args.json:
        for chunk in stream:
            print(json.dumps(asdict(chunk), default=str), flush=True)
    elif args.n and args.n > 1:
        for out in stream.collect().outputs:
            print(f"--- [{out.index}] ({out.finish_reason.value if out.finish_reason else '?'})\n{out.text}")
    else:
        for chunk in stream:
            if args.logprobs is not None:
                for lp in chunk.logprobs:
                    top = ", ".join(f"{t.token_id}:{t.logprob:.3f}" for t in lp.top)
                    print(f"{lp.token_id}\t{lp.logprob:.4f}\t[{top}]", file=sys.stderr)
            print(chunk.text, end="", flush=True)
        print()
    if args.usage and stream.usage:
        u = stream.usage
        print(f"[{u.prompt_tokens} prompt ({u.cached_prompt_tokens} cached) + {u.completion_tokens} generated tokens]",
              file=sys.stderr)
    return 0


def _image_part(path: str) -> dict:
    """An image file as OpenAI's image_url part (a data: URL; the scheduler checks the format)."""
    data = Path(path).read_bytes()
    kind = mimetypes.guess_type(path)[0] or "application/octet-stream"
    return {"type": "image_url", "image_url": {"url": f"data:{kind};base64,{base64.b64encode(data).decode()}"}}


def cmd_chat(client: Client, args: argparse.Namespace) -> int:
    system = [{"role": "system", "content": args.system}] if args.system else []
    history: list[dict] = []
    try:
        images = [_image_part(path) for path in args.image]
    except OSError as exc:
        print(f"pagoda chat: --image {exc.filename}: {exc.strerror}", file=sys.stderr)
        return 2
    interactive = sys.stdin.isatty()
    while True:
        try:
            line = input("you> " if interactive else "")
        except EOFError:
            return 0
        text = line.strip()
        if not text:
            continue
        if text in ("/exit", "/quit"):
            return 0
        if text == "/reset":
            history.clear()
            continue
        if images and not history:  # the first message carries the images, before its text
            history.append({"role": "user", "content": [*images, {"type": "text", "text": text}]})
        else:
            history.append({"role": "user", "content": text})
        answer = ""
        if interactive:
            print("assistant> ", end="", flush=True)
        for chunk in client.chat(system + history, _params(args)):
            answer += chunk.text
            print(chunk.text, end="", flush=True)
        print(flush=True)
        history.append({"role": "assistant", "content": answer})


def table(rows: list[list[str]]) -> str:
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    return "\n".join("  ".join(cell.ljust(w) for cell, w in zip(row, widths)).rstrip() for row in rows)


def cmd_info(client: Client, args: argparse.Namespace) -> int:
    model, server = client.model_info(), client.server_info()
    print(table([
        ["model", model.name],
        ["max model len", str(model.max_model_len)],
        ["vocab size", str(model.vocab_size)],
        ["block size", str(model.block_size)],
        ["eos token ids", ", ".join(map(str, model.eos_token_ids))],
        ["lora adapters", ", ".join(model.lora_adapters) or "-"],
        ["server version", server.version],
        ["running / waiting", f"{server.num_running} / {server.num_waiting}"],
        ["preemptions", str(server.num_preemptions)],
    ]))
    print()
    rows = [["executor", "device", "healthy", "blocks", "free", "cached", "running", "waiting"]]
    for e in server.executors:
        rows.append([e.executor_id, e.device, "yes" if e.healthy else "NO", str(e.num_total_blocks),
                     str(e.num_free_blocks), str(e.num_cached_blocks), str(e.num_running), str(e.num_waiting)])
    print(table(rows))
    return 0


def cmd_load_lora(client: Client, args: argparse.Namespace) -> int:
    client.load_lora_adapter(args.lora_name, args.lora_path)
    print(f"loaded LoRA adapter {args.lora_name!r} from {args.lora_path}")
    return 0


def cmd_unload_lora(client: Client, args: argparse.Namespace) -> int:
    client.unload_lora_adapter(args.lora_name)
    print(f"unloaded LoRA adapter {args.lora_name!r}")
    return 0


def cmd_embed(client: Client, args: argparse.Namespace) -> int:
    """One JSON line per text: {"index", "embedding"}."""
    texts = [line for text in args.texts for line in (sys.stdin.read().splitlines() if text == "-" else [text])]
    reply = client.embed(texts, normalize=args.normalize, dimensions=args.dimensions,
                         truncate_prompt_tokens=args.truncate_prompt_tokens)
    for index, vector in enumerate(reply.vectors):
        print(json.dumps({"index": index, "embedding": list(vector)}))
    if args.usage:
        print(f"prompt tokens: {reply.usage.prompt_tokens}", file=sys.stderr)
    return 0


def cmd_rerank(client: Client, args: argparse.Namespace) -> int:
    """One line per document, best first: score, index, text."""
    reply = client.rerank(args.query, args.documents, top_n=args.top_n)
    for result in reply.results:
        print(f"{result.relevance_score:.6f}\t{result.index}\t{args.documents[result.index]}")
    return 0


def cmd_bench(args: argparse.Namespace) -> int:
    """bench/loadgen.py itself, with `--target` from the connection flags unless given."""
    if not (REPO_ROOT / "bench" / "loadgen.py").is_file():
        print("pagoda bench runs bench/loadgen.py from a checkout of the repository; none found", file=sys.stderr)
        return 2
    if str(REPO_ROOT) not in sys.path:
        sys.path.insert(0, str(REPO_ROOT))
    from bench import loadgen

    rest = list(args.loadgen_args)
    if not any(a in ("--target", "--spawn") or a.startswith("--target=") for a in rest):
        rest = ["--target", client_options(args)["targets"].split(",")[0], *rest]
    argv, sys.argv = sys.argv, ["pagoda bench", *rest]
    try:
        loadgen.main()
    finally:
        sys.argv = argv
    return 0


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.command == "bench":
        return cmd_bench(args)
    commands = {"generate": cmd_generate, "chat": cmd_chat, "info": cmd_info, "load-lora": cmd_load_lora,
                "unload-lora": cmd_unload_lora, "embed": cmd_embed, "rerank": cmd_rerank}
    try:
        with Client(**client_options(args), timeout=args.timeout) as client:
            if args.connect_timeout > 0 and wait_connected(client, args.connect_timeout) is None:
                print(f"pagoda: cannot connect to {','.join(client.targets)} within {args.connect_timeout:g} s "
                      "(is the scheduler running there? --target / PAGODA_TARGET)", file=sys.stderr)
                return 1
            return commands[args.command](client, args)
    except PagodaError as err:
        print(f"pagoda: {err}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130
