"""python -m gateway_svc: an OpenAI-compatible HTTP API in front of a Pagoda scheduler (see --help)."""

from __future__ import annotations

import argparse
import logging

import uvicorn

from gateway_svc.app import create_app
from pagoda.cli import add_flag
from pagoda.client import AsyncClient
from pagoda.client.flags import add_connection_flags, client_options


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m gateway_svc", description=__doc__)
    add_flag(p, "--host", default="127.0.0.1", help="HTTP bind address")
    add_flag(p, "--port", type=int, default=8000, help="HTTP port")
    add_flag(p, "--request-timeout", type=float, default=None, help="deadline of one request in seconds (default none)")
    add_flag(p, "--log-level", default="INFO")
    add_connection_flags(p)
    return p.parse_args(argv)


def main(argv=None) -> None:
    args = parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    client = AsyncClient(**client_options(args), timeout=args.request_timeout)
    app = create_app(client)
    logging.getLogger("gateway_svc").info("OpenAI API on http://%s:%d/v1 -> %s", args.host, args.port,
                                          ",".join(client.targets))
    uvicorn.run(app, host=args.host, port=args.port, log_level=args.log_level.lower())


if __name__ == "__main__":
    main()
