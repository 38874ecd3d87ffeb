"""Fair share between tenants (issue #24): one tenant floods, another keeps its latency.

The flooder, with its own API key, sends requests from 16 threads without pause, resending at
once whatever is refused (tests/service/flood_client.py, a process of its own). It gets
RESOURCE_EXHAUSTED past its share (--max-requests-per-tenant) and never anything else; the
bystander, another tenant, is never refused, gets transformers' greedy tokens, and its requests
take at most twice as long as on the quiet server. Quiet and flooded rounds alternate and their
medians are compared, so a machine busy with other work slows both sides alike.

The executor runs one thread, leaving a core to the scheduler (and to the flooder, which here
shares the service's 2 cores, as no real attacker would): with two OpenMP threads spinning at
barriers on cores the scheduler needs for the flood's refusals (~1,200 a second, ~0.3 ms of
scheduler CPU each), the ratio measured the oversubscription, not the admission policy. On
2 cores, side by side: 2 threads 1.88-2.01x (GOMP_SPINCOUNT 3000, the executor's default),
1.46-1.55x (1000), 1.09-1.35x (300); 1 thread 1.11-1.53x (4 runs).
"""

from __future__ import annotations

import json
import signal
import statistics
import subprocess
import sys
import time

import pytest

from tests.service.harness import ROOT, Service, collect, greedy_request, hf_greedy
from tests.service.test_tiny_models import build_tiny

FLOODER = "flooder-key-0123456789abcdef"
BYSTANDER = "bystander-key-0123456789abcdef"
SHARE = 1
BYSTANDER_PROMPT = [1, 50, 51, 52]
BYSTANDER_TOKENS = 24
ROUNDS = 4


@pytest.fixture(scope="module")
def tiny(tmp_path_factory, default_model_dir):
    path = tmp_path_factory.mktemp("tiny-fair")
    reference = build_tiny("llama", path, default_model_dir, shard=False)
    return path, hf_greedy(reference, BYSTANDER_PROMPT, BYSTANDER_TOKENS, ignore_eos=True)


def bystander_latency(stub, expected: list[int]) -> float:
    t0 = time.monotonic()
    out = collect(stub.Generate(greedy_request(prompt_ids=BYSTANDER_PROMPT, max_tokens=BYSTANDER_TOKENS, ignore_eos=True), timeout=120))
    elapsed = time.monotonic() - t0
    assert out["outputs"][0]["token_ids"] == expected
    return elapsed


def flooded_round(svc: Service, measure) -> tuple[list, dict]:
    """`measure()` while the flooder floods, once it holds its whole share; (what it returned, the flood's statuses)."""
    flood = subprocess.Popen(
        ["nice", "-n", "19", sys.executable, "-m", "tests.service.flood_client", "--target", f"127.0.0.1:{svc.port}", "--api-key", FLOODER],
        cwd=ROOT, stdout=subprocess.PIPE, text=True,
    )
    try:
        assert flood.stdout.readline().strip() == "flooding"
        deadline = time.monotonic() + 60
        while svc.server_info().num_running < SHARE:
            assert time.monotonic() < deadline and flood.poll() is None
            time.sleep(0.05)
        measured = measure()
    finally:
        flood.send_signal(signal.SIGTERM)
        out, _ = flood.communicate(timeout=180)
    return measured, json.loads(out.strip().splitlines()[-1])


def test_one_tenant_floods_and_another_keeps_its_latency(tiny, tmp_path):
    model_dir, expected = tiny
    keys = tmp_path / "keys"
    keys.write_text(f"{FLOODER} flooder\n{BYSTANDER} bystander\n")
    args = ["--api-key-file", str(keys), "--max-requests-per-tenant", str(SHARE), "--max-num-seqs", "8"]
    with Service(model=str(model_dir), scheduler_args=args, executor_args=["--num-kv-blocks", "256", "--num-threads", "1"], api_key=BYSTANDER) as svc:
        bystander = svc.stub
        bystander_latency(bystander, expected)  # warm
        quiet, flooded, floods = [], [], []

        def measure():
            latencies, held = [], []
            for _ in range(2):
                latencies.append(bystander_latency(bystander, expected))
                info = svc.server_info()
                held.append(info.num_running + info.num_waiting)
            return latencies, held

        for _ in range(ROUNDS):
            quiet += [bystander_latency(bystander, expected) for _ in range(2)]
            (latencies, held), codes = flooded_round(svc, measure)
            flooded += latencies
            floods.append((held, codes))
        ratio = statistics.median(flooded) / statistics.median(quiet)
        print(f"bystander latency: quiet {quiet}, flooded {flooded}, ratio of medians {ratio:.2f}; floods {floods}")
        for held, codes in floods:
            assert max(held) <= SHARE  # the flooder's share (the bystander's request has ended)
            assert set(codes) == {"OK", "RESOURCE_EXHAUSTED", "details"}, codes
            assert all(f"--max-requests-per-tenant {SHARE}" in d for d in codes["details"]), codes
        assert ratio <= 2.0, (quiet, flooded)
