"""Command-line flags for the connection to the scheduler, shared by `pagoda` and `gateway_svc`.

Each flag reads its `PAGODA_*` variable (`--target` ← `PAGODA_TARGET`). The `--ssl-*` flags
are the client side of the scheduler's own: the CA that signed the scheduler's certificate,
and a client certificate and key for mutual TLS.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from pagoda.cli import add_bool_flag, add_flag
from pagoda.client.connection import DEFAULT_TARGET, TLSConfig


def add_connection_flags(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("connection to the scheduler")
    add_flag(g, "--target", default=DEFAULT_TARGET, help="scheduler host:port; several, comma-separated, are tried in order")
    add_flag(g, "--api-key", help="sent as `authorization: Bearer <key>`")
    add_flag(g, "--api-key-file", help="file holding the API key")
    add_bool_flag(g, "--tls", default=False, help="TLS with the system's root certificates (implied by --ssl-*)")
    add_flag(g, "--ssl-ca-certs", help="CA bundle that signed the scheduler's certificate")
    add_flag(g, "--ssl-certfile", help="client certificate (mutual TLS)")
    add_flag(g, "--ssl-keyfile", help="client certificate's private key")
    add_flag(g, "--ssl-server-name", help="name to check the scheduler's certificate against")


def client_options(args: argparse.Namespace) -> dict:
    """Keyword arguments of Client / AsyncClient from the parsed flags."""
    api_key = args.api_key
    if args.api_key_file:
        api_key = Path(args.api_key_file).read_text().strip()
    tls = None
    if args.tls or args.ssl_ca_certs or args.ssl_certfile or args.ssl_server_name:
        tls = TLSConfig.from_files(args.ssl_ca_certs, args.ssl_certfile, args.ssl_keyfile, args.ssl_server_name)
    return {"targets": args.target, "api_key": api_key, "tls": tls}
