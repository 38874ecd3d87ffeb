"""This machine's limits for the model: matmul GFLOP/s at the model's shapes, memory bandwidth,
and what they allow in tokens/s.

    python bench/matmul_roofline.py                 # default model, torch's threads
    python bench/matmul_roofline.py --threads 2 --seconds 0.5

A Llama-family forward pass costs about 2 x params FLOPs per token (one multiply-add per
weight; attention adds 4 x context x hidden per layer). Tokens/s can be no higher than
    compute limit   = matmul FLOP/s / (2 x params)                (large batches, prefill)
    bandwidth limit = batch x memory bandwidth / weight bytes      (decode: every step reads all weights)
The numbers are best-of-several measurements on a machine others may be using too.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repository root, when run as a script

import torch  # noqa: E402

from bench.common import RequestSpec, format_table, machine_info, machine_line  # noqa: E402


@dataclass(frozen=True)
class ModelShape:
    name: str
    hidden: int
    intermediate: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    vocab: int

    @classmethod
    def from_config(cls, model: str | None) -> "ModelShape":
        from pagoda.model_files import model_name, resolve_model

        c = json.loads((resolve_model(model) / "config.json").read_text())
        head_dim = c.get("head_dim") or c["hidden_size"] // c["num_attention_heads"]
        return cls(model_name(model), c["hidden_size"], c["intermediate_size"], c["num_hidden_layers"],
                   c["num_attention_heads"], c.get("num_key_value_heads", c["num_attention_heads"]), head_dim,
                   c["vocab_size"])

    def linears(self) -> list[tuple[str, int, int]]:
        """(name, in, out) of each layer's matmuls, then the LM head."""
        q, kv = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        return [("qkv", self.hidden, q + 2 * kv), ("o", q, self.hidden),
                ("gate_up", self.hidden, 2 * self.intermediate), ("down", self.intermediate, self.hidden),
                ("lm_head", self.hidden, self.vocab)]

    def layer_params(self) -> int:
        return sum(i * o for name, i, o in self.linears() if name != "lm_head")

    def params(self) -> int:
        """Matmul weights (embedding = LM head, counted once) plus norms."""
        return self.num_layers * (self.layer_params() + 2 * self.hidden) + self.vocab * self.hidden + self.hidden

    def attention_flops(self, context: int) -> int:
        return 4 * context * self.num_heads * self.head_dim * self.num_layers

    def workload_flops(self, specs: list[RequestSpec]) -> int:
        """Every prompt token once (no LM head but the last), every output token with the LM head."""
        body, head = 2 * self.num_layers * self.layer_params(), 2 * self.hidden * self.vocab
        total = 0
        for s in specs:
            p, n = len(s.prompt_ids), s.max_tokens
            total += p * body + head + self.attention_flops(p * (p + 1) // 2)
            total += (n - 1) * (body + head) + self.attention_flops(sum(p + j for j in range(1, n)))
        return total


def time_best(fn, seconds: float) -> float:
    """Best time of one call of `fn`, repeated for about `seconds`."""
    fn()
    best, deadline = float("inf"), time.perf_counter() + seconds
    while time.perf_counter() < deadline:
        t = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t)
    return best


def measure_matmuls(shape: ModelShape, token_counts=(1, 16, 64, 256), seconds: float = 0.3) -> list[dict]:
    rows = []
    with torch.inference_mode():
        for m in token_counts:
            for name, k, n in shape.linears():
                x, w = torch.randn(m, k), torch.randn(n, k)
                t = time_best(lambda: torch.nn.functional.linear(x, w), seconds)
                rows.append({"tokens": m, "op": name, "k": k, "n": n, "gflops": 2 * m * k * n / t / 1e9,
                             "gbytes_per_s": 4 * (m * k + k * n + m * n) / t / 1e9})
    return rows


def measure_bandwidth(mbytes: int = 512, seconds: float = 1.0) -> float:
    """GB/s of reading one buffer and writing another (a copy), counted both ways."""
    src = torch.empty(mbytes * 2**20 // 4).normal_()
    dst = torch.empty_like(src)
    t = time_best(lambda: dst.copy_(src), seconds)
    return 2 * src.numel() * 4 / t / 1e9


def roofline(model: str | None = None, seconds: float = 0.3, specs: list[RequestSpec] | None = None) -> dict:
    shape = ModelShape.from_config(model)
    rows = measure_matmuls(shape, seconds=seconds)
    by_tokens: dict[int, float] = {}
    for m in sorted({r["tokens"] for r in rows}):
        ops = [r for r in rows if r["tokens"] == m]
        flops = sum(2 * m * r["k"] * r["n"] * (1 if r["op"] == "lm_head" else shape.num_layers) for r in ops)
        secs = sum(2 * m * r["k"] * r["n"] / (r["gflops"] * 1e9) * (1 if r["op"] == "lm_head" else shape.num_layers)
                   for r in ops)
        by_tokens[m] = flops / secs / 1e9  # a whole forward's matmuls at m tokens
    peak = max(by_tokens.values())
    bandwidth = measure_bandwidth(seconds=seconds * 3)
    flops_per_token = 2 * shape.params()
    weight_bytes = 4 * shape.params()
    result = {
        "model": shape.name, "params": shape.params(), "flops_per_token": flops_per_token,
        "weight_bytes_fp32": weight_bytes, "matmuls": rows, "forward_gflops_by_tokens": by_tokens,
        "peak_gflops": peak, "bandwidth_gb_per_s": bandwidth,
        "compute_limit_tokens_per_s": peak * 1e9 / flops_per_token,
        "decode_bandwidth_limit_steps_per_s": bandwidth * 1e9 / weight_bytes,
    }
    if specs is not None:
        flops = shape.workload_flops(specs)
        result["workload_gflop"] = flops / 1e9
        result["workload_compute_floor_s"] = flops / (peak * 1e9)
    return result


def roofline_lines(r: dict) -> list[str]:
    rates = ", ".join(f"{m} tok {g:.0f}" for m, g in r["forward_gflops_by_tokens"].items())
    lines = [
        f"model {r['model']}: {r['params'] / 1e6:.1f} M params -> {r['flops_per_token'] / 1e9:.2f} GFLOP/token; "
        f"{r['weight_bytes_fp32'] / 2**20:.0f} MiB of float32 weights",
        f"matmul GFLOP/s of a forward pass at (tokens per step): {rates}",
        f"compute limit: {r['peak_gflops']:.0f} GFLOP/s / {r['flops_per_token'] / 1e9:.2f} GFLOP = "
        f"{r['compute_limit_tokens_per_s']:.0f} tokens/s (prompt + output)",
        f"memory: {r['bandwidth_gb_per_s']:.1f} GB/s -> at most {r['decode_bandwidth_limit_steps_per_s']:.0f} decode "
        f"steps/s, i.e. {r['decode_bandwidth_limit_steps_per_s']:.0f} x batch output tokens/s",
    ]
    if "workload_gflop" in r:
        lines.append(f"this workload: {r['workload_gflop']:.0f} GFLOP (attention included) -> "
                     f"{r['workload_compute_floor_s']:.1f} s at {r['peak_gflops']:.0f} GFLOP/s, at best")
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None)
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    parser.add_argument("--seconds", type=float, default=0.3, help="time spent per shape")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    r = roofline(args.model, args.seconds)
    print(f"machine  {machine_line(machine_info())}\n")
    print(format_table(["tokens", "matmul", "k x n", "GFLOP/s", "GB/s"],
                       [[x["tokens"], x["op"], f"{x['k']}x{x['n']}", x["gflops"], x["gbytes_per_s"]]
                        for x in r["matmuls"]]))
    print()
    print("\n".join(roofline_lines(r)))


if __name__ == "__main__":
    main()
