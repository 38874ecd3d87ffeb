"""Shard-by-shard loading (issue #15): a tensor-parallel rank reads only its slices of each tensor.

A Llama checkpoint of ~500 MB (constant weights: what is measured is bytes, not values),
saved in files of at most 32 MB (safetensors maps a whole file while it is open), is loaded in fresh processes: whole (TP=1), and as rank 0 and rank 1
of two. Each process resets its peak resident set (`/proc/self/clear_refs`) after its imports
and reports its VmHWM growth over the load: a rank must stay well under the model's size,
the whole load must not (or the measurement would tell nothing).
"""

from __future__ import annotations

import json
import multiprocessing

import pytest
import torch

FILE_BYTES = 32 << 20


def _kib(field: str) -> int:
    for line in open("/proc/self/status"):
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    raise KeyError(field)


def _load(model_dir: str, rank: int, size: int, queue) -> None:
    import executor_svc.parallel.sharding  # noqa: F401 (imports before the baseline, as the next line)
    from executor_svc.loader import load_config, load_model
    from executor_svc.model import TensorParallel

    torch.set_num_threads(1)
    load_config(model_dir)  # transformers' imports (~100 MB) before the baseline
    tp = TensorParallel()
    tp.rank, tp.size = rank, size  # loading needs the rank's place only, no collective
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # reset VmHWM to the current resident set
    except OSError:
        pass
    before = _kib("VmRSS")
    model = load_model(model_dir, torch.device("cpu"), torch.float32, tp=tp if size > 1 else None)
    queue.put((_kib("VmHWM") - before, sum(p.numel() * p.element_size() for p in model.parameters())))


def peak_growth(model_dir, rank: int, size: int) -> tuple[int, int]:
    ctx = multiprocessing.get_context("spawn")
    queue = ctx.Queue()
    proc = ctx.Process(target=_load, args=(str(model_dir), rank, size, queue))
    proc.start()
    out = queue.get(timeout=600)
    proc.join()
    return out


@pytest.fixture(scope="module")
def big_model_dir(tmp_path_factory):
    from safetensors.torch import save_file
    from transformers import LlamaConfig

    config = LlamaConfig(
        vocab_size=8192, hidden_size=1024, intermediate_size=2816, num_hidden_layers=10, num_attention_heads=16,
        num_key_value_heads=4, max_position_embeddings=256, tie_word_embeddings=False,
    )
    path = tmp_path_factory.mktemp("tp-big-llama")
    config.save_pretrained(path)
    h, i, kv = config.hidden_size, config.intermediate_size, 4 * 64
    shapes = {"model.embed_tokens.weight": (config.vocab_size, h), "lm_head.weight": (config.vocab_size, h), "model.norm.weight": (h,)}
    for n in range(config.num_hidden_layers):
        p = f"model.layers.{n}."
        shapes |= {
            p + "self_attn.q_proj.weight": (h, h), p + "self_attn.k_proj.weight": (kv, h), p + "self_attn.v_proj.weight": (kv, h),
            p + "self_attn.o_proj.weight": (h, h), p + "mlp.gate_proj.weight": (i, h), p + "mlp.up_proj.weight": (i, h),
            p + "mlp.down_proj.weight": (h, i), p + "input_layernorm.weight": (h,), p + "post_attention_layernorm.weight": (h,),
        }
    files: list[dict[str, torch.Tensor]] = [{}]
    weight_map, size = {}, 0
    for name, shape in shapes.items():
        tensor = torch.full(shape, 0.01)
        if size + tensor.nbytes > FILE_BYTES and files[-1]:
            files.append({})
            size = 0
        files[-1][name] = tensor
        size += tensor.nbytes
    for k, tensors in enumerate(files):
        file_name = f"model-{k + 1:05d}-of-{len(files):05d}.safetensors"
        save_file(tensors, path / file_name, metadata={"format": "pt"})
        weight_map |= dict.fromkeys(tensors, file_name)
    (path / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    return path, sum(t.nbytes for f in files for t in f.values())


def test_each_rank_peaks_well_under_the_model_size(big_model_dir):
    model_dir, model_bytes = big_model_dir
    whole_peak, whole_params = peak_growth(model_dir, 0, 1)
    assert whole_params == model_bytes
    assert whole_peak > 0.9 * model_bytes  # the measurement sees a whole load
    for rank in range(2):
        peak, params = peak_growth(model_dir, rank, 2)
        assert params < 0.55 * model_bytes  # its share (norms are whole on every rank)
        print(f"rank {rank} of 2: peak growth {peak / 2**20:.0f} MiB, whole load {whole_peak / 2**20:.0f} MiB, model {model_bytes / 2**20:.0f} MiB")
        assert peak < 0.8 * model_bytes, (rank, peak, model_bytes, whole_peak)
