"""Exit 0 when the scheduler's gRPC health service reports SERVING (or, with --http, when the
gateway's /health answers 200; with --link, when this executor's link to the scheduler is up:
an established TCP connection to the port of PAGODA_SCHEDULER), else 1.

Usage: python docker/healthcheck.py [HOST:PORT] [--service NAME] [--timeout SECONDS] [--http | --link]
Defaults: the local service at PAGODA_HOST and PAGODA_PORT, with --http PAGODA_GATEWAY_PORT
(0.0.0.0 and :: are probed as 127.0.0.1), service "pagoda.v1.Generation" (SERVING once an
executor is registered).
Only grpcio and grpcio-health-checking are needed: no grpc_health_probe binary.
"""

from __future__ import annotations

import argparse
import os
import sys
import urllib.error
import urllib.request
from urllib.parse import urlsplit

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc


def default_target(http: bool) -> str:
    host = os.environ.get("PAGODA_HOST", "127.0.0.1")
    if host in ("", "0.0.0.0", "::", "[::]"):
        host = "127.0.0.1"
    port = os.environ.get("PAGODA_GATEWAY_PORT", "8000") if http else os.environ.get("PAGODA_PORT", "50051")
    return f"{host}:{port}"


def http_check(url: str, timeout: float) -> int:
    try:
        with urllib.request.urlopen(url, timeout=timeout) as reply:
            print(f"{url}: {reply.status}")
            return 0 if reply.status == 200 else 1
    except (OSError, urllib.error.URLError) as err:
        print(f"{url}: {err}")
        return 1


def link_check(scheduler: str) -> int:
    """0 if this network namespace holds an ESTABLISHED TCP connection to the scheduler's port."""
    port = urlsplit(scheduler.replace("tcp://", "//", 1)).port
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            rows = open(table).read().splitlines()[1:]
        except OSError:
            continue
        for row in rows:
            fields = row.split()
            if fields[3] == "01" and int(fields[2].rsplit(":", 1)[1], 16) == port:  # 01: ESTABLISHED
                print(f"linked to {scheduler}")
                return 0
    print(f"no connection to {scheduler}")
    return 1


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("target", nargs="?")
    parser.add_argument("--service", default=os.environ.get("PAGODA_HEALTH_SERVICE", "pagoda.v1.Generation"))
    parser.add_argument("--timeout", type=float, default=3.0)
    parser.add_argument("--http", action="store_true", help="probe http://HOST:PORT/health (the gateway)")
    parser.add_argument("--link", action="store_true", help="an executor's link to PAGODA_SCHEDULER is up")
    args = parser.parse_args()
    if args.link:
        return link_check(args.target or os.environ.get("PAGODA_SCHEDULER", "tcp://127.0.0.1:5557"))
    args.target = args.target or default_target(args.http)
    if args.http:
        return http_check(f"http://{args.target}/health", args.timeout)
    with grpc.insecure_channel(args.target) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        try:
            reply = stub.Check(health_pb2.HealthCheckRequest(service=args.service), timeout=args.timeout)
        except grpc.RpcError as err:
            print(f"{args.target} {args.service!r}: {err.code().name} {err.details()}")
            return 1
    status = health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)
    print(f"{args.target} {args.service!r}: {status}")
    return 0 if reply.status == health_pb2.HealthCheckResponse.SERVING else 1


if __name__ == "__main__":
    sys.exit(main())
