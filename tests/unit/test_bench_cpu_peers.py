"""bench/bench_cpu_peers.py's pure parts: name lists, the requests every system gets, ratios and aims.
No server is started."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from bench.bench_cpu_peers import (
    PARTS,
    SYSTEMS,
    LlamaCpp,
    Vllm,
    aims,
    figures,
    parse_names,
    prefill_spec,
    stream_specs,
    w48_specs,
)


def test_parse_names_keeps_the_order_given_and_refuses_unknown_names():
    assert parse_names("llama.cpp, pagoda-bf16,llama.cpp", SYSTEMS, "--systems") == ["llama.cpp", "pagoda-bf16"]
    assert parse_names("prefill,w48", PARTS, "--parts") == ["prefill", "w48"]
    with pytest.raises(ValueError, match="--systems: vllm not among"):
        parse_names("vllm", SYSTEMS, "--systems")
    with pytest.raises(ValueError, match=r"--parts: \(empty\)"):
        parse_names(" , ", PARTS, "--parts")


def test_requests_are_the_same_for_every_system_and_new_every_round():
    args = SimpleNamespace(w48_requests=48, w48_prompt_len="32:384", w48_output_len="16:160", seed=0, prefill_len=1500)
    first, again, second = w48_specs(args, 0), w48_specs(args, 0), w48_specs(args, 1)
    assert [s.prompt_ids for s in first] == [s.prompt_ids for s in again]
    assert len(first) == 48 and all(32 <= len(s.prompt_ids) <= 384 and 16 <= s.max_tokens <= 160 for s in first)
    assert first[0].prompt_ids != second[0].prompt_ids
    assert prefill_spec(args, 0) == prefill_spec(args, 0) and len(prefill_spec(args, 0).prompt_ids) == 1500
    assert prefill_spec(args, 0).max_tokens == 1 and prefill_spec(args, 0) != prefill_spec(args, 1)
    chat = list(range(2000, 2064))
    streams = stream_specs(chat, 0, 4) + stream_specs(chat, 1, 4)
    assert all(len(s.prompt_ids) == 64 and s.prompt_ids[1:] == chat[:63] and s.max_tokens == 256 for s in streams)
    assert len({s.prompt_ids[0] for s in streams}) == 8  # no two streams, in any round, share a prefix


def test_event_token_ids_of_each_server():
    assert Vllm.event_ids({"choices": [{"text": "a", "token_ids": [30]}]}) == [30]
    assert Vllm.event_ids({"choices": [], "usage": {"completion_tokens": 5}}) == []
    assert LlamaCpp.event_ids({"content": "a", "tokens": [30], "stop": False}) == [30]
    assert LlamaCpp.event_ids({"content": "", "tokens": [], "stop": True}) is None


def summary(**values):
    return {"summary": values}


def test_ratios_and_aims():
    results = {
        "pagoda-bf16": {"w48": summary(duration_s=10.0, output_tokens_per_s=390.0),
                        "one": summary(output_tokens_per_s=90.0, decode_tokens_per_s=95.0),
                        "prefill": summary(ttft_p50_ms=500.0)},
        "vllm-bf16": {"w48": summary(duration_s=13.0, output_tokens_per_s=300.0)},
        "llama.cpp": {"one": summary(output_tokens_per_s=100.0), "prefill": summary(ttft_p50_ms=1500.0)},
    }
    rows = figures(results)
    assert rows["pagoda-bf16"]["w48_vs_vllm_bf16"] == pytest.approx(1.3)
    assert rows["pagoda-bf16"]["one_vs_llama"] == pytest.approx(0.9)
    assert rows["pagoda-bf16"]["prefill_vs_llama"] == pytest.approx(3.0)  # llama.cpp's TTFT over ours
    assert rows["pagoda-bf16"]["four_vs_llama"] is None and rows["llama.cpp"]["w48_vs_vllm_bf16"] is None
    lines = aims(rows)
    assert "W48 output tok/s, Pagoda bf16 / vLLM bf16 >= 1.3x: 1.30x -> MET" in lines[0]
    assert any("one stream" in line and "0.90x -> NOT MET" in line for line in lines)
    assert len(lines) == 3  # only the aims with both sides measured
