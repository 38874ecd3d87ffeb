"""A GGUF file of K-quant and Q5 tensors keeps them packed, with transformers' weights to the bit.

The file is a tiny Llama written with the `gguf` package's writer, every projection of another
type (K-quants as random blocks with finite scales, `tests.gguf_blocks`), like the mixes of a
`Q4_K_M` file: q/k in Q4_K with v in Q6_K (one merged projection, two segments), Q5_0/Q5_1/Q8_0
parts, a Q5_0 embedding and a Q6_K head. transformers loads the same file (dequantizing with the
`gguf` package) as the reference.
"""

from __future__ import annotations

import pytest
import torch
from gguf import GGML_QUANT_SIZES

from executor_svc.loader import load_model
from executor_svc.quant.gguf_kernel import get_kernel
from executor_svc.quant.gguf_linear import GGUFEmbedding, GGUFLinear
from tests.gguf_blocks import T, assert_matmul_close, random_blocks

HIDDEN, MLP, HEADS, KV_HEADS, VOCAB = 256, 512, 4, 2, 96
HEAD_DIM = HIDDEN // HEADS
LAYER_TYPES = [  # attn_q, attn_k, attn_v, attn_output, ffn_gate, ffn_up, ffn_down
    (T.Q4_K, T.Q4_K, T.Q6_K, T.Q5_K, T.Q3_K, T.Q2_K, T.Q6_K),
    (T.Q5_0, T.Q5_1, T.Q8_0, T.Q4_K, T.Q5_0, T.Q5_0, T.Q4_K),
]
EMBEDDING, HEAD = T.Q5_0, T.Q6_K

pytestmark = pytest.mark.skipif(get_kernel() is None, reason="no C compiler: the GGUF kernel is not built")


def write_mixed_gguf(path) -> None:
    import gguf

    w = gguf.GGUFWriter(str(path), "llama")
    w.add_context_length(256)
    w.add_embedding_length(HIDDEN)
    w.add_block_count(len(LAYER_TYPES))
    w.add_feed_forward_length(MLP)
    w.add_head_count(HEADS)
    w.add_head_count_kv(KV_HEADS)
    w.add_rope_dimension_count(HEAD_DIM)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_vocab_size(VOCAB)
    seed = iter(range(1000))

    def add(name: str, ggml_type: T, rows: int, cols: int) -> None:
        block_weights, block_bytes = GGML_QUANT_SIZES[ggml_type]
        data = random_blocks(ggml_type, rows, cols // block_weights, next(seed), scale=0.002)
        w.add_tensor(name, data, raw_shape=(rows, cols // block_weights * block_bytes), raw_dtype=ggml_type)

    add("token_embd.weight", EMBEDDING, VOCAB, HIDDEN)
    add("output.weight", HEAD, VOCAB, HIDDEN)
    w.add_tensor("output_norm.weight", torch.rand(HIDDEN).numpy() + 0.5)
    kv = KV_HEADS * HEAD_DIM
    shapes = [("attn_q", HIDDEN, HIDDEN), ("attn_k", kv, HIDDEN), ("attn_v", kv, HIDDEN),
              ("attn_output", HIDDEN, HIDDEN), ("ffn_gate", MLP, HIDDEN), ("ffn_up", MLP, HIDDEN),
              ("ffn_down", HIDDEN, MLP)]
    for i, types in enumerate(LAYER_TYPES):
        for (name, rows, cols), ggml_type in zip(shapes, types, strict=True):
            add(f"blk.{i}.{name}.weight", ggml_type, rows, cols)
        for norm in ("attn_norm", "ffn_norm"):
            w.add_tensor(f"blk.{i}.{norm}.weight", torch.rand(HIDDEN).numpy() + 0.5)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


@pytest.fixture(scope="module")
def mixed_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("kquants") / "tiny-llama-mixed.gguf"
    write_mixed_gguf(path)
    return path


@pytest.fixture(scope="module")
def hf_weights(mixed_file) -> dict[str, torch.Tensor]:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(mixed_file.parent), gguf_file=mixed_file.name, dtype=torch.float32)
    return {k: v.detach() for k, v in model.state_dict().items()}


def test_every_block_type_stays_packed_in_segments_of_one_type(mixed_file):
    model = load_model(mixed_file, torch.device("cpu"), torch.float32, "gguf")
    first, second = model.layers
    assert first.self_attn.qkv_proj.types == [T.Q4_K, T.Q6_K]  # q and k one Q4_K segment, v its own
    assert first.self_attn.o_proj.types == [T.Q5_K] and first.mlp.down_proj.types == [T.Q6_K]
    assert first.mlp.gate_up_proj.types == [T.Q3_K, T.Q2_K]
    assert second.self_attn.qkv_proj.types == [T.Q5_0, T.Q5_1, T.Q8_0]
    assert (second.self_attn.o_proj.types, second.mlp.gate_up_proj.types, second.mlp.down_proj.types) == (
        [T.Q4_K], [T.Q5_0], [T.Q4_K])
    assert isinstance(model.embed_tokens, GGUFEmbedding) and model.embed_tokens.linear.types == [EMBEDDING]
    assert isinstance(model.lm_head, GGUFLinear) and model.lm_head.types == [HEAD]


def test_kept_weights_equal_transformers_and_multiply_as_they_do(mixed_file, hf_weights):
    model = load_model(mixed_file, torch.device("cpu"), torch.float32, "gguf")
    for i, layer in enumerate(model.layers):
        hf = lambda name: hf_weights[f"model.layers.{i}.{name}.weight"]  # noqa: E731
        expected = {
            "qkv_proj": torch.cat([hf("self_attn.q_proj"), hf("self_attn.k_proj"), hf("self_attn.v_proj")]),
            "o_proj": hf("self_attn.o_proj"),
            "gate_up_proj": torch.cat([hf("mlp.gate_proj"), hf("mlp.up_proj")]),
            "down_proj": hf("mlp.down_proj"),
        }
        for name, weight in expected.items():
            linear = getattr(layer.self_attn if name in ("qkv_proj", "o_proj") else layer.mlp, name)
            assert torch.equal(linear.dequantize(), weight), (i, name)  # q/k rows unpermuted as transformers does
            for num_rows in (1, 9, 70):  # fused tiles of 1-4 and 8 rows; dequantize + GEMM
                x = torch.randn(num_rows, linear.in_features)
                assert_matmul_close(linear(x), x, weight)
    tokens = torch.tensor([0, 5, VOCAB - 1])
    assert torch.equal(model.embed_tokens(tokens), hf_weights["model.embed_tokens.weight"][tokens])
    assert torch.equal(model.lm_head.dequantize(), hf_weights["lm_head.weight"])
