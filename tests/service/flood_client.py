"""`python -m tests.service.flood_client --target H:P --api-key K [--threads 16]`: one tenant's flood.

Each thread sends greedy requests without pause and sends again at once whatever ends or is
refused, until SIGTERM; then the process prints one JSON line: {status name: count, "details":
[distinct error messages]}. Its own process, so that its threads take no time from the client
whose latency a test measures beside it (tests/service/test_fair_share.py).
"""

from __future__ import annotations

import argparse
import collections
import json
import signal
import threading

import grpc

from tests.service.harness import BearerKey, collect, greedy_request
from pagoda.v1 import generation_pb2_grpc as pb_grpc


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--target", required=True)
    parser.add_argument("--api-key", required=True)
    parser.add_argument("--threads", type=int, default=16)
    parser.add_argument("--max-tokens", type=int, default=48)
    args = parser.parse_args()
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    stub = pb_grpc.GenerationStub(grpc.intercept_channel(grpc.insecure_channel(args.target), BearerKey(args.api_key)))
    codes: collections.Counter = collections.Counter()
    details: set[str] = set()

    def run(i: int) -> None:
        n = 0
        while not stop.is_set():
            n += 1
            req = greedy_request(prompt_ids=[1, 60 + i, 61, n % 500 + 100], max_tokens=args.max_tokens, ignore_eos=True)
            try:
                collect(stub.Generate(req, timeout=120))
                codes["OK"] += 1
            except grpc.RpcError as exc:
                codes[exc.code().name] += 1
                details.add(exc.details() or "")

    threads = [threading.Thread(target=run, args=(i,)) for i in range(args.threads)]
    for thread in threads:
        thread.start()
    print("flooding", flush=True)
    # Polled: the kernel may deliver SIGTERM to one of gRPC's threads, and then a main thread
    # blocked in an untimed wait never runs the Python handler (make test's CI hung here once).
    while not stop.wait(0.2):
        pass
    for thread in threads:
        thread.join(180)
    print(json.dumps({**codes, "details": sorted(details)}), flush=True)


if __name__ == "__main__":
    main()
