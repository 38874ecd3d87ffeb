"""python -m gateway_svc: an OpenAI-compatible HTTP API (/v1/completions, /v1/chat/completions,
/v1/responses, /v1/models; vLLM's /v1/load_lora_adapter and /v1/unload_lora_adapter) and
Anthropic's /v1/messages in front of a Pagoda scheduler's gRPC API. Every flag also reads its
PAGODA_* variable."""

from __future__ import annotations

import argparse
import logging

import uvicorn

from gateway_svc.app import DEFAULT_MAX_REQUEST_BYTES, create_app
from gateway_svc.response_store import DEFAULT_MAX_AGE_S, DEFAULT_MAX_COUNT, ResponseStore, default_path
from pagoda.cli import add_flag
from pagoda.client import AsyncClient
from pagoda.client.flags import add_connection_flags, client_options
from pagoda.reasoning import reasoning_parser_names
from pagoda.tool_parsers import TOOL_PARSERS


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m gateway_svc", description=__doc__,
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    add_flag(p, "--host", default="127.0.0.1", help="HTTP bind address")
    # Its own variable: PAGODA_PORT is the scheduler's gRPC port, often set in the same shell.
    add_flag(p, "--port", type=int, default=8000, env="PAGODA_GATEWAY_PORT", help="HTTP port")
    add_flag(p, "--request-timeout", type=float, default=None, help="deadline of one request in seconds (none: no deadline)")
    add_flag(p, "--max-request-bytes", type=int, default=DEFAULT_MAX_REQUEST_BYTES,
             help="largest request body (413 past it); the scheduler's flag of the same name and default")
    add_flag(p, "--log-level", default="INFO")
    add_flag(p, "--reasoning-parser", default=None, choices=reasoning_parser_names(),
             help="split the reasoning (`reasoning_content`) with this parser (default: the scheduler's, chosen "
                  "from the chat template; none: no split)")
    add_flag(p, "--tool-call-parser", default=None, choices=list(TOOL_PARSERS),
             help="the models' tool-call format, read and constrained (default: the scheduler's, chosen from the "
                  "chat template; hermes when it says nothing)")
    g = p.add_argument_group("stored responses (/v1/responses with store: true)")
    add_flag(g, "--responses-db", default=str(default_path()), help="SQLite file of the stored responses")
    add_flag(g, "--responses-max-count", type=int, default=DEFAULT_MAX_COUNT,
             help="most responses kept (all tenants together); the oldest go first")
    add_flag(g, "--responses-max-age", type=float, default=DEFAULT_MAX_AGE_S, help="seconds a stored response is kept")
    add_connection_flags(p)
    args = p.parse_args(argv)
    if args.max_request_bytes < 1:
        p.error(f"--max-request-bytes: must be positive, got {args.max_request_bytes}")
    if args.responses_max_count < 1 or not args.responses_max_age > 0:
        p.error(f"--responses-max-count and --responses-max-age: must be positive, got "
                f"{args.responses_max_count} and {args.responses_max_age}")
    return args


def main(argv=None) -> None:
    args = parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    client = AsyncClient(**client_options(args), timeout=args.request_timeout)
    store = ResponseStore(args.responses_db, args.responses_max_count, args.responses_max_age)
    app = create_app(client, max_request_bytes=args.max_request_bytes, reasoning_parser=args.reasoning_parser,
                     tool_call_parser=args.tool_call_parser, response_store=store)
    logging.getLogger("gateway_svc").info("OpenAI API on http://%s:%d/v1 -> %s", args.host, args.port,
                                          ",".join(client.targets))
    uvicorn.run(app, host=args.host, port=args.port, log_level=args.log_level.lower())


if __name__ == "__main__":
    main()
