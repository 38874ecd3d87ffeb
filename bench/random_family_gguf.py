"""A random-weight GGUF file of a non-Llama family, made by llama.cpp's own tools, for bench_one_stream.py.

    .venv/bin/python bench/random_family_gguf.py --llama-cpp DIR --out DIR [--type Q4_K_M]

Writes a Gemma-3-270M-shaped transformers config (hidden 640, 18 layers, 4 heads, 1 KV head,
head_dim 256, MLP 2048, sliding window 512, five sliding layers to one full) with random weights
(`torch.manual_seed(0)`, init std 0.02, so logits are sane) and the default model's tokenizer
(no hub access; its 49152 tokens set the vocabulary, as llama.cpp's converter cuts the
embedding to the tokenizer's size), converts it with llama.cpp's `convert_hf_to_gguf.py` to
f16, then `llama-quantize` to `--type`. llama.cpp is a benchmark peer (see bench/README.md):
`DIR` is its source tree with `build/bin/llama-quantize` built.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from pagoda import model_files  # noqa: E402

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja")


def gemma3_config():
    from transformers import Gemma3TextConfig

    return Gemma3TextConfig(
        vocab_size=49152, hidden_size=640, intermediate_size=2048, num_hidden_layers=18, num_attention_heads=4,
        num_key_value_heads=1, head_dim=256, query_pre_attn_scalar=256, sliding_window=512,
        layer_types=(["sliding_attention"] * 5 + ["full_attention"]) * 3, max_position_embeddings=32768,
        initializer_range=0.02, bos_token_id=1, eos_token_id=2, pad_token_id=0, tie_word_embeddings=True,
        architectures=["Gemma3ForCausalLM"],
    )


def copy_tokenizer(out: Path) -> None:
    """The default model's tokenizer files into the Hugging Face folder `out` (no hub access)."""
    tokenizer_dir = model_files.resolve_model(None, weights=False)
    for name in TOKENIZER_FILES:
        if (Path(tokenizer_dir) / name).exists():
            shutil.copy(Path(tokenizer_dir) / name, out / name)


def build_hf(out: Path) -> Path:
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(gemma3_config(), dtype=torch.float32)
    model.save_pretrained(out)
    copy_tokenizer(out)
    return out


def convert(llama_cpp: Path, hf_dir: Path, f16: Path, out: Path, ggml_type: str) -> Path:
    """`hf_dir` -> `f16` (llama.cpp's `convert_hf_to_gguf.py`) -> `out` (`llama-quantize` to `ggml_type`)."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(llama_cpp / "gguf-py"), os.environ.get("PYTHONPATH")]))}
    if not f16.exists():
        subprocess.run([sys.executable, str(llama_cpp / "convert_hf_to_gguf.py"), str(hf_dir), "--outtype", "f16",
                        "--outfile", str(f16)], check=True, env=env)
    subprocess.run([str(llama_cpp / "build/bin/llama-quantize"), str(f16), str(out), ggml_type], check=True)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--llama-cpp", type=Path, required=True, help="llama.cpp's source tree (build/bin built)")
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--type", default="Q4_K_M")
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    hf_dir = build_hf(args.out / "hf")
    f16 = args.out / "gemma3-270m-shape-random.f16.gguf"
    out = convert(args.llama_cpp, hf_dir, f16, args.out / f"gemma3-270m-shape-random.{args.type}.gguf", args.type)
    print(out)


if __name__ == "__main__":
    main()
