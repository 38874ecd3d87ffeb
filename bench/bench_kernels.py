"""Kernel benchmarks: paged-attention bandwidth, prefill, a tuning sweep, and a Llama-3-8B decode step.

    python bench/bench_kernels.py                   # on a CUDA GPU (written for an H200)
    python bench/bench_kernels.py --smoke           # CPU, Triton interpreter, tiny shapes: checks it runs
    python bench/bench_kernels.py --skip-model --json out.json

Tables:
  decode attention   GB/s = bytes of K/V (+ q, out) read / kernel time, for batch x context,
                     beside the GPU's peak (--peak-gbs, 4800 for an H200); bf16 and fp8 caches.
  prefill attention  causal prefill TFLOP/s of the unified kernel beside torch SDPA (flash).
  tuning             decode time for tile_n x num_warps x num_segments on two shapes.
  model decode       tokens/s of one decode step of a Llama-3-8B-shaped model (random bf16 weights
                     from a config, no download) at a fixed context: Pagoda's kernels (paged
                     attention, fused norm / rotary / SiLU, torch matmuls) beside plain torch with
                     SDPA over a contiguous cache, plus how far their logits agree.
Times are triton.testing.do_bench means on CUDA, best-of wall clock under --smoke.
"""

from __future__ import annotations

import argparse
import math
import os
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repository root, when run as a script

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from bench.common import OUT_DIR, format_table, machine_info, machine_line, timestamp, write_json  # noqa: E402

FP8 = torch.float8_e4m3fn


@dataclass(frozen=True)
class Heads:
    num_heads: int
    num_kv_heads: int
    head_dim: int
    block_size: int


@dataclass(frozen=True)
class Plan:
    """What one run measures; `--smoke` swaps in tiny shapes."""

    heads: Heads
    batches: tuple[int, ...]
    contexts: tuple[int, ...]
    prefills: tuple[tuple[int, int], ...]  # (num_seqs, tokens each)
    tuning_shapes: tuple[tuple[int, int], ...]  # (batch, context)
    tile_ns: tuple[int, ...]
    warps: tuple[int, ...]
    segments: tuple[int, ...]
    model_batches: tuple[int, ...]
    model_context: int


FULL = Plan(Heads(32, 8, 128, 16), (64, 128, 256), (1024, 2048, 4096, 8192), ((1, 4096), (4, 1024), (16, 512)),
            ((64, 4096), (4, 8192)), (32, 64, 128), (4, 8), (1, 4, 16), (1, 64, 256), 1024)
SMOKE = Plan(Heads(4, 2, 16, 16), (2,), (32, 64), ((1, 32),), ((2, 64),), (16, 32), (4,), (1, 2), (1, 2), 32)


def main() -> int:
    args = parse_args()
    if args.smoke:
        os.environ["TRITON_INTERPRET"] = "1"  # before kernels/ is imported
    elif not torch.cuda.is_available():
        print("no CUDA device: run with --smoke to check the script on the CPU", file=sys.stderr)
        return 2
    plan = SMOKE if args.smoke else FULL
    device = torch.device("cpu" if args.smoke else "cuda")
    info = machine_info()
    print(machine_line(info))
    results: dict = {"machine": info, "smoke": args.smoke, "peak_gbs": args.peak_gbs}

    results["decode_attention"] = bench_decode_attention(plan, device, args.peak_gbs)
    results["prefill_attention"] = bench_prefill_attention(plan, device)
    results["tuning"] = bench_tuning(plan, device)
    if not args.skip_model:
        results["model_decode"] = bench_model(plan, device, args.smoke)
    path = write_json(Path(args.json) if args.json else OUT_DIR / f"bench_kernels-{timestamp()}.json", results)
    print(f"\nwrote {path}")
    return 0


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--smoke", action="store_true", help="tiny shapes on the CPU under the Triton interpreter")
    p.add_argument("--skip-model", action="store_true", help="kernels only, no Llama-3-8B step")
    p.add_argument("--peak-gbs", type=float, default=4800.0, help="the GPU's memory bandwidth, GB/s (H200: 4800)")
    p.add_argument("--json", default=None, help="results file (default bench/out/bench_kernels-<time>.json)")
    return p.parse_args()


def time_ms(fn: Callable[[], object], device: torch.device) -> float:
    if device.type == "cuda":
        import triton.testing

        return triton.testing.do_bench(fn, warmup=25, rep=200)
    fn()  # the interpreter has nothing to warm up, but keep the shape of a warm-up
    best = math.inf
    for _ in range(2):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return 1000 * best


# ---------------------------------------------------------------- paged decode batches


@dataclass
class PagedBatch:
    q: torch.Tensor
    k_cache: torch.Tensor
    v_cache: torch.Tensor
    query_start_loc: torch.Tensor
    seq_lens: torch.Tensor
    block_table: torch.Tensor
    slot_mapping: torch.Tensor  # the last position of each sequence
    max_seq_len: int

    def attend(self, **kwargs) -> torch.Tensor:
        from kernels.paged_attention import paged_attention

        return paged_attention(self.q, self.k_cache, self.v_cache, self.query_start_loc, self.seq_lens,
                               self.block_table, self.q.shape[-1] ** -0.5, 1, self.max_seq_len, **kwargs)


def decode_batch(heads: Heads, batch: int, seq_len: int, device: torch.device, cache_dtype: torch.dtype,
                 num_layers: int = 1) -> tuple[PagedBatch, torch.Tensor, torch.Tensor]:
    """`batch` decodes at `seq_len`, each owning blocks scattered at random over a cache of exactly that size.

    Returns the batch (caches of layer 0) and the [num_layers, num_blocks, ...] K and V caches.
    """
    blocks_per_seq = math.ceil(seq_len / heads.block_size)
    num_blocks = 1 + batch * blocks_per_seq
    shape = (num_layers, num_blocks, heads.block_size, heads.num_kv_heads, heads.head_dim)
    k_caches = torch.randn(shape, dtype=torch.bfloat16, device=device).to(cache_dtype)
    v_caches = torch.randn(shape, dtype=torch.bfloat16, device=device).to(cache_dtype)
    block_table = (torch.randperm(num_blocks - 1, device=device) + 1).view(batch, blocks_per_seq).int()
    last = seq_len - 1
    slot_mapping = block_table[:, last // heads.block_size].long() * heads.block_size + last % heads.block_size
    paged = PagedBatch(
        q=torch.randn(batch, heads.num_heads, heads.head_dim, dtype=torch.bfloat16, device=device),
        k_cache=k_caches[0],
        v_cache=v_caches[0],
        query_start_loc=torch.arange(batch + 1, dtype=torch.int32, device=device),
        seq_lens=torch.full((batch,), seq_len, dtype=torch.int32, device=device),
        block_table=block_table,
        slot_mapping=slot_mapping,
        max_seq_len=seq_len,
    )
    return paged, k_caches, v_caches


def bench_decode_attention(plan: Plan, device: torch.device, peak_gbs: float) -> list[dict]:
    from kernels.paged_attention import choose_num_segments

    h = plan.heads
    num_sms = torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 0
    rows = []
    for cache_dtype in (torch.bfloat16, FP8):
        for batch in plan.batches:
            for context in plan.contexts:
                paged, _, _ = decode_batch(h, batch, context, device, cache_dtype)
                ms = time_ms(paged.attend, device)
                kv_bytes = 2 * batch * context * h.num_kv_heads * h.head_dim * paged.k_cache.element_size()
                io_bytes = 2 * paged.q.numel() * paged.q.element_size()
                gbs = (kv_bytes + io_bytes) / ms / 1e6
                segments = choose_num_segments(batch, h.num_kv_heads, 1, context, 64, num_sms)
                rows.append(dict(cache=str(cache_dtype).removeprefix("torch."), batch=batch, context=context,
                                 segments=segments, us=1000 * ms, gbs=gbs, peak_pct=100 * gbs / peak_gbs))
                del paged
    print(f"\n## decode attention: {h.num_heads} heads, {h.num_kv_heads} KV heads, head_dim {h.head_dim}, "
          f"block {h.block_size}, bf16 q; peak {peak_gbs:.0f} GB/s")
    print(format_table(["cache", "batch", "context", "segments", "us", "GB/s", "% of peak"],
                       [[r["cache"], r["batch"], r["context"], r["segments"], r["us"], r["gbs"], r["peak_pct"]]
                        for r in rows]))
    return rows


def bench_prefill_attention(plan: Plan, device: torch.device) -> list[dict]:
    from kernels.paged_attention import paged_attention

    h = plan.heads
    rows = []
    for num_seqs, length in plan.prefills:
        num_tokens = num_seqs * length
        blocks_per_seq = math.ceil(length / h.block_size)
        num_blocks = 1 + num_seqs * blocks_per_seq
        k = torch.randn(num_tokens, h.num_kv_heads, h.head_dim, dtype=torch.bfloat16, device=device)
        v = torch.randn_like(k)
        q = torch.randn(num_tokens, h.num_heads, h.head_dim, dtype=torch.bfloat16, device=device)
        block_table = torch.arange(1, num_blocks, device=device, dtype=torch.int32).view(num_seqs, blocks_per_seq)
        k_cache = torch.zeros(num_blocks, h.block_size, h.num_kv_heads, h.head_dim, dtype=torch.bfloat16,
                              device=device)
        v_cache = torch.zeros_like(k_cache)
        for cache, x in ((k_cache, k), (v_cache, v)):  # sequence i in blocks 1 + i * blocks_per_seq onwards
            per_seq = cache[1:].view(num_seqs, -1, h.num_kv_heads, h.head_dim)
            per_seq[:, :length] = x.view(num_seqs, length, h.num_kv_heads, h.head_dim)
        query_start_loc = torch.arange(0, num_tokens + 1, length, dtype=torch.int32, device=device)
        seq_lens = torch.full((num_seqs,), length, dtype=torch.int32, device=device)
        scale = h.head_dim**-0.5

        def ours():
            return paged_attention(q, k_cache, v_cache, query_start_loc, seq_lens, block_table, scale, length, length)

        qs, ks, vs = (x.view(num_seqs, length, -1, h.head_dim).transpose(1, 2) for x in (q, k, v))

        def sdpa():
            return F.scaled_dot_product_attention(qs, ks, vs, is_causal=True, scale=scale, enable_gqa=True)

        error = (ours().float() - sdpa().transpose(1, 2).reshape(q.shape).float()).abs().max().item()
        flops = 4 * num_seqs * h.num_heads * h.head_dim * length * (length + 1) / 2  # causal: half the square
        ms_ours, ms_sdpa = time_ms(ours, device), time_ms(sdpa, device)
        rows.append(dict(num_seqs=num_seqs, length=length, us=1000 * ms_ours, tflops=flops / ms_ours / 1e9,
                         sdpa_us=1000 * ms_sdpa, sdpa_tflops=flops / ms_sdpa / 1e9, max_abs_diff=error))
    print("\n## prefill attention (causal, no context): unified kernel vs torch SDPA")
    print(format_table(["seqs", "tokens each", "us", "TFLOP/s", "SDPA us", "SDPA TFLOP/s", "max |diff|"],
                       [[r["num_seqs"], r["length"], r["us"], r["tflops"], r["sdpa_us"], r["sdpa_tflops"],
                         r["max_abs_diff"]] for r in rows]))
    return rows


def bench_tuning(plan: Plan, device: torch.device) -> list[dict]:
    h = plan.heads
    rows = []
    for batch, context in plan.tuning_shapes:
        paged, _, _ = decode_batch(h, batch, context, device, torch.bfloat16)
        kv_bytes = 2 * batch * context * h.num_kv_heads * h.head_dim * 2
        for tile_n in plan.tile_ns:
            for num_warps in plan.warps:
                for segments in plan.segments:
                    ms = time_ms(lambda: paged.attend(tile_n=tile_n, num_warps=num_warps, num_segments=segments),
                                 device)
                    rows.append(dict(batch=batch, context=context, tile_n=tile_n, num_warps=num_warps,
                                     segments=segments, us=1000 * ms, gbs=kv_bytes / ms / 1e6))
        del paged
    print("\n## tuning: decode attention, bf16 cache (the launcher's defaults: tile_n 64, 4 warps, segments auto)")
    print(format_table(["batch", "context", "tile_n", "warps", "segments", "us", "GB/s"],
                       [[r["batch"], r["context"], r["tile_n"], r["num_warps"], r["segments"], r["us"], r["gbs"]]
                        for r in rows]))
    return rows


# ---------------------------------------------------------------- a Llama-3-8B decode step


@dataclass
class Weights:
    embed: torch.Tensor
    layers: list[dict[str, torch.Tensor]]
    final_norm: torch.Tensor
    lm_head: torch.Tensor


def llama_config(smoke: bool):
    from transformers import LlamaConfig

    rope = {"rope_type": "default", "rope_theta": 500000.0}  # Llama 3's theta; its long-context scaling is left out
    if smoke:
        return LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                           num_key_value_heads=2, vocab_size=256, rms_norm_eps=1e-5, rope_parameters=rope)
    return LlamaConfig(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
                       num_key_value_heads=8, vocab_size=128256, rms_norm_eps=1e-5,
                       max_position_embeddings=8192, rope_parameters=rope)


def random_weights(config, device: torch.device) -> Weights:
    def w(*shape: int) -> torch.Tensor:
        return torch.randn(shape, dtype=torch.bfloat16, device=device) * 0.02

    def norm() -> torch.Tensor:
        return 1 + 0.1 * torch.randn(config.hidden_size, dtype=torch.bfloat16, device=device)

    hidden, head_dim = config.hidden_size, config.head_dim
    qkv = (config.num_attention_heads + 2 * config.num_key_value_heads) * head_dim
    layers = [
        dict(input_norm=norm(), qkv=w(qkv, hidden), o=w(hidden, hidden), post_norm=norm(),
             gate_up=w(2 * config.intermediate_size, hidden), down=w(hidden, config.intermediate_size))
        for _ in range(config.num_hidden_layers)
    ]
    return Weights(w(config.vocab_size, hidden), layers, norm(), w(config.vocab_size, hidden))


def bench_model(plan: Plan, device: torch.device, smoke: bool) -> list[dict]:
    from executor_svc.attention.base import AttentionMetadata
    from executor_svc.attention.triton_backend import TritonBackend
    from kernels.activation import silu_and_mul
    from kernels.rms_norm import fused_add_rms_norm, rms_norm
    from kernels.rotary import rotary_embedding

    config = llama_config(smoke)
    weights = random_weights(config, device)
    num_heads, num_kv_heads = config.num_attention_heads, config.num_key_value_heads
    head_dim, eps, context = config.head_dim, config.rms_norm_eps, plan.model_context
    q_size, kv_size = num_heads * head_dim, num_kv_heads * head_dim
    scale = head_dim**-0.5
    exponents = torch.arange(0, head_dim, 2, dtype=torch.float32, device=device) / head_dim
    inv_freq = 1.0 / config.rope_parameters["rope_theta"] ** exponents
    freqs = torch.outer(torch.arange(context + 1, dtype=torch.float32, device=device), inv_freq)
    cos_sin_cache = torch.cat([freqs.cos(), freqs.sin()], dim=-1)
    backend = TritonBackend(device)
    heads = Heads(num_heads, num_kv_heads, head_dim, plan.heads.block_size)
    rows = []
    for batch in plan.model_batches:
        # Contiguous caches for the torch step; the paged caches hold the same K/V through the block table.
        paged, k_caches, v_caches = decode_batch(heads, batch, context + 1, device, torch.bfloat16,
                                                 num_layers=config.num_hidden_layers)
        flat_slots = _slots(paged.block_table, context + 1, heads.block_size)
        k_dense = torch.empty(config.num_hidden_layers, batch, num_kv_heads, context + 1, head_dim,
                              dtype=torch.bfloat16, device=device)
        v_dense = torch.empty_like(k_dense)
        for layer in range(config.num_hidden_layers):
            for paged_cache, dense in ((k_caches[layer], k_dense[layer]), (v_caches[layer], v_dense[layer])):
                dense.copy_(paged_cache.flatten(0, 1)[flat_slots].view(batch, context + 1, num_kv_heads, head_dim)
                            .transpose(1, 2))
        input_ids = torch.randint(0, config.vocab_size, (batch,), device=device)
        positions = torch.full((batch,), context, dtype=torch.int64, device=device)
        meta = AttentionMetadata(paged.slot_mapping, paged.query_start_loc, paged.seq_lens, paged.block_table,
                                 max_query_len=1, max_seq_len=context + 1)

        def kernel_step() -> torch.Tensor:
            x, residual = weights.embed[input_ids], None
            for layer, lw in enumerate(weights.layers):
                if residual is None:
                    h, residual = rms_norm(x, lw["input_norm"], eps), x
                else:
                    h, residual = fused_add_rms_norm(x, residual, lw["input_norm"], eps)
                qkv = h @ lw["qkv"].T
                q = qkv[:, :q_size].view(batch, num_heads, head_dim)
                k = qkv[:, q_size : q_size + kv_size].view(batch, num_kv_heads, head_dim)
                v = qkv[:, q_size + kv_size :].view(batch, num_kv_heads, head_dim)
                rotary_embedding(positions, q, k, cos_sin_cache)
                attn = backend.forward(q, k, v, k_caches[layer], v_caches[layer], meta, scale)
                h, residual = fused_add_rms_norm(attn.view(batch, q_size) @ lw["o"].T, residual, lw["post_norm"], eps)
                x = silu_and_mul(h @ lw["gate_up"].T) @ lw["down"].T
            h, _ = fused_add_rms_norm(x, residual, weights.final_norm, eps)
            return h @ weights.lm_head.T

        cos = cos_sin_cache[positions, : head_dim // 2].repeat(1, 2)[:, None].to(torch.bfloat16)
        sin = cos_sin_cache[positions, head_dim // 2 :].repeat(1, 2)[:, None].to(torch.bfloat16)

        def torch_step() -> torch.Tensor:
            x, residual = weights.embed[input_ids], None
            for layer, lw in enumerate(weights.layers):
                residual = x if residual is None else residual + x
                qkv = _torch_rms_norm(residual, lw["input_norm"], eps) @ lw["qkv"].T
                q = qkv[:, :q_size].view(batch, num_heads, head_dim)
                k = qkv[:, q_size : q_size + kv_size].view(batch, num_kv_heads, head_dim)
                v = qkv[:, q_size + kv_size :].view(batch, num_kv_heads, head_dim)
                q, k = q * cos + _rotate_half(q) * sin, k * cos + _rotate_half(k) * sin
                k_dense[layer, :, :, context] = k
                v_dense[layer, :, :, context] = v
                attn = F.scaled_dot_product_attention(q[:, :, None], k_dense[layer], v_dense[layer], scale=scale,
                                                      enable_gqa=True)
                residual = residual + attn.reshape(batch, q_size) @ lw["o"].T
                gate, up = (_torch_rms_norm(residual, lw["post_norm"], eps) @ lw["gate_up"].T).chunk(2, dim=-1)
                x = (F.silu(gate) * up) @ lw["down"].T
            return _torch_rms_norm(residual + x, weights.final_norm, eps) @ weights.lm_head.T

        ours, theirs = kernel_step().float(), torch_step().float()
        agree = (ours.argmax(-1) == theirs.argmax(-1)).float().mean().item()
        rel_diff = ((ours - theirs).abs().max() / theirs.abs().max()).item()
        ms_ours, ms_torch = time_ms(kernel_step, device), time_ms(torch_step, device)
        rows.append(dict(batch=batch, context=context, ms=ms_ours, tokens_per_s=1000 * batch / ms_ours,
                         torch_ms=ms_torch, torch_tokens_per_s=1000 * batch / ms_torch, speedup=ms_torch / ms_ours,
                         argmax_agree=agree, max_rel_logit_diff=rel_diff))
        del paged, k_caches, v_caches, k_dense, v_dense
        if device.type == "cuda":
            torch.cuda.empty_cache()
    print(f"\n## model decode: {'tiny Llama' if smoke else 'Llama-3-8B'} shape ({config.num_hidden_layers} layers, "
          f"hidden {config.hidden_size}, "
          f"{num_heads}/{num_kv_heads} heads, intermediate {config.intermediate_size}, vocab {config.vocab_size}), "
          f"random bf16 weights, context {context}, one step")
    print(format_table(["batch", "ms/step", "tokens/s", "torch ms/step", "torch tokens/s", "speedup",
                        "argmax agree", "max rel logit diff"],
                       [[r["batch"], r["ms"], r["tokens_per_s"], r["torch_ms"], r["torch_tokens_per_s"], r["speedup"],
                         r["argmax_agree"], r["max_rel_logit_diff"]] for r in rows]))
    return rows


def _slots(block_table: torch.Tensor, seq_len: int, block_size: int) -> torch.Tensor:
    """[batch * seq_len] slot of every position of every sequence, sequence-major."""
    pos = torch.arange(seq_len, device=block_table.device)
    return (block_table[:, pos // block_size].long() * block_size + pos % block_size).flatten()


def _torch_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    variance = x.float().pow(2).mean(-1, keepdim=True)
    return weight * (x.float() * torch.rsqrt(variance + eps)).to(x.dtype)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


if __name__ == "__main__":
    sys.exit(main())
