"""The CPU decode path (executor_svc/cpu_decode_path.py) gives the modules' hidden states to the bit, step by step."""

from __future__ import annotations

import pytest
import torch

from executor_svc import cpu_decode_path
from executor_svc.cpu_decode_path import CpuDecodePath
from executor_svc.model_runner import ModelRunner
from executor_svc.quant.gguf_kernel import get_kernel
from executor_svc.quant.gguf_linear import GGUFLinear
from pagoda import model_files
from tests.executor.plans import PlanBuilder, run_to_completion
from tests.executor.test_model_runner import mixed_workload

pytestmark = pytest.mark.skipif(get_kernel() is None, reason="no C compiler: the GGUF kernel is not built")


@pytest.fixture(scope="module")
def runner():
    return ModelRunner(model_files.resolve_model(None, weights=False), device="cpu", block_size=16, num_kv_blocks=256)


@pytest.mark.parametrize(
    "form", ["one-call", "layer-loop", "split-attention"]
)  # every layer in one C call (where the attention has the OpenMP team); the Python loop of C calls per layer
def test_each_decode_step_equals_the_modules_to_the_bit(runner, form, monkeypatch):
    from transformers import AutoTokenizer

    model = runner.model
    path = runner.backend.decode_step
    assert isinstance(path, CpuDecodePath), "the default GGUF model on the CPU takes the decode path"
    if form == "one-call":
        assert (path._one_call is not None) == (path._kernel.step_function is not None)
    else:
        monkeypatch.setattr(path, "_one_call", None)
    if form == "split-attention":  # (without the kernel's OpenMP entry: split over the threads above 0 keys)
        monkeypatch.setattr(cpu_decode_path, "ONE_THREAD_KEYS", 0)
    tok = AutoTokenizer.from_pretrained(str(runner.model_dir))
    texts = ["The capital of France is", "def add(a, b):\n", "Once upon a time, in a small village, there lived"]
    prompts = {f"p{i}": tok(t)["input_ids"] for i, t in enumerate(texts)}
    compared: list[int] = []  # rows of each step the path took
    declined = 0

    def both(model_, input_ids, positions, kv_caches, meta):
        nonlocal declined
        fast = path.forward(input_ids, positions, kv_caches, meta)
        # the modules, on the same inputs (they write the same K/V again)
        slow = model(input_ids, positions, kv_caches, meta, runner.attention)
        if fast is None:
            declined += 1
        else:
            compared.append(input_ids.shape[0])
            for got, want in zip(fast, slow, strict=True):
                torch.testing.assert_close(got, want, atol=0, rtol=0)
        return slow

    monkeypatch.setattr(runner.backend, "forward", both)
    builder = PlanBuilder(block_size=16, num_blocks=256)
    mixed_workload(builder, prompts, max_tokens=12)
    run_to_completion(runner, builder)
    assert declined > 0, "steps with prefill chunks go through the modules"
    assert 1 in compared and max(compared) >= 2, compared  # one decode alone, and several together


def test_steps_it_does_not_take(runner):
    path = runner.backend.decode_step
    assert path is not None

    class Meta:  # only what forward reads before it declines
        max_query_len, max_seq_len = 2, 10  # a prefill chunk (or drafts to verify)

    ids = torch.zeros(4, dtype=torch.int64)
    assert path.forward(ids, ids, [], Meta) is None


def test_decode_steps_above_the_fused_rows_equal_the_modules_to_the_bit(runner, monkeypatch):
    """Above `max_rows` the path's linears run their modules' own forward (the GEMM the modules
    run at that many rows) between its C calls: still the modules' hidden states to the bit."""
    from transformers import AutoTokenizer

    path = runner.backend.decode_step
    monkeypatch.setattr(path, "max_rows", 1)  # every step of several requests goes above it
    tok = AutoTokenizer.from_pretrained(str(runner.model_dir))
    texts = ["The capital of France is", "def add(a, b):\n", "Once upon a time, in a small village, there lived"]
    prompts = {f"p{i}": tok(t)["input_ids"] for i, t in enumerate(texts)}
    above: list[int] = []
    calls: list[int] = []
    real = GGUFLinear.forward

    def counted(self, x):
        calls.append(x.shape[0])
        return real(self, x)

    def both(model_, input_ids, positions, kv_caches, meta):
        fast = path.forward(input_ids, positions, kv_caches, meta)
        slow = runner.model(input_ids, positions, kv_caches, meta, runner.attention)
        if fast is not None and input_ids.shape[0] > 1:
            above.append(input_ids.shape[0])
            for got, want in zip(fast, slow, strict=True):
                torch.testing.assert_close(got, want, atol=0, rtol=0)
        return slow

    monkeypatch.setattr(GGUFLinear, "forward", counted)
    monkeypatch.setattr(runner.backend, "forward", both)
    builder = PlanBuilder(block_size=16, num_blocks=256)
    mixed_workload(builder, prompts, max_tokens=8)
    run_to_completion(runner, builder)
    assert len(above) >= 3, above  # decode steps of several requests went through the path
    # each of them ran every layer's 4 linears once in the path and once in the modules
    assert calls.count(2) >= len(above) * 2 * 4 * len(runner.model.layers), "the path ran the modules' GEMMs"


@pytest.mark.parametrize("above_fused_rows", [False, True], ids=["fused-rows", "gemm-rows"])
def test_bfloat16_decode_steps_stay_close_to_its_modules(above_fused_rows):
    """A bfloat16 model's decode steps through the path compute in float32 (K/V rounded into its
    bfloat16 cache): close to its modules, which round every activation to bfloat16, not equal.
    Above `max_rows` (gemm-rows) its linears are the modules' bfloat16 GEMMs on rounded inputs."""
    from transformers import AutoTokenizer

    runner = ModelRunner(model_files.resolve_model(None, weights=False), device="cpu", dtype="bfloat16",
                         block_size=16, num_kv_blocks=128)
    path = runner.backend.decode_step
    assert isinstance(path, CpuDecodePath) and runner.kv_caches[0][0].dtype == torch.bfloat16
    if above_fused_rows:
        path.max_rows = 1
    tok = AutoTokenizer.from_pretrained(str(runner.model_dir))
    prompts = {f"q{i}": tok(t)["input_ids"] for i, t in enumerate(["The capital of France is", "def add(a, b):\n"])}
    errors: list[float] = []

    def both(model_, input_ids, positions, kv_caches, meta):
        fast = path.forward(input_ids, positions, kv_caches, meta)
        slow = runner.model(input_ids, positions, kv_caches, meta, runner.attention)  # rewrites the same slots
        if fast is not None:
            # float32 at the fused rows; above them bfloat16, for the final norm and head's GEMM
            assert fast[0].dtype == (torch.float32 if input_ids.shape[0] <= path.max_rows else torch.bfloat16)
            got, want = sum(fast), sum(x.float() for x in slow)
            errors.append(((got - want).norm() / want.norm()).item())
        return slow

    runner.backend.forward = both
    builder = PlanBuilder(block_size=16, num_blocks=128)
    mixed_workload(builder, prompts, max_tokens=8)
    run_to_completion(runner, builder)
    print(f"bf16 decode path vs its modules: relative error of the last layer's output, max {max(errors):.4f}")
    assert errors and max(errors) < 0.05, errors


def write_random_adapter(folder, config, targets: dict[str, int], seed: int, **options):
    """A random PEFT folder for the runner's model: `targets` module name -> rank (B not zero)."""
    import json

    from safetensors.torch import save_file

    c = config
    shapes = {"q_proj": (c.hidden_size, c.q_size), "k_proj": (c.hidden_size, c.kv_size),
              "v_proj": (c.hidden_size, c.kv_size), "o_proj": (c.q_size, c.hidden_size),
              "gate_proj": (c.hidden_size, c.intermediate_size), "up_proj": (c.hidden_size, c.intermediate_size),
              "down_proj": (c.intermediate_size, c.hidden_size)}
    gen = torch.Generator().manual_seed(seed)
    tensors = {}
    for layer in range(c.num_layers):
        for name, rank in targets.items():
            fan_in, fan_out = shapes[name]
            owner = "self_attn" if name in ("q_proj", "k_proj", "v_proj", "o_proj") else "mlp"
            key = f"base_model.model.model.layers.{layer}.{owner}.{name}"
            tensors[f"{key}.lora_A.weight"] = torch.randn(rank, fan_in, generator=gen) * fan_in**-0.5
            tensors[f"{key}.lora_B.weight"] = torch.randn(fan_out, rank, generator=gen) * 0.05
    folder.mkdir(parents=True)
    save_file(tensors, str(folder / "adapter_model.safetensors"))
    config_json = {"peft_type": "LORA", "r": max(targets.values()), "lora_alpha": 16, "target_modules": list(targets),
                   "bias": "none", "rank_pattern": {k: v for k, v in targets.items()}, **options}
    (folder / "adapter_config.json").write_text(json.dumps(config_json))
    return folder


def test_decode_steps_with_adapter_rows_equal_the_modules(runner, monkeypatch, tmp_path):
    """Rows of LoRA adapters (two adapters beside base rows, one on every projection, one on some slices of
    the merged q/k/v and gate/up only, rsLoRA) take the one-call C step, their deltas added after each
    projection (csrc/cpu_ops.c's `lora_deltas`): the modules' hidden states within float32 summation order."""
    from transformers import AutoTokenizer

    path = runner.backend.decode_step
    if path._one_call is None:
        pytest.skip("no one-call C decode step here")
    runner.enable_lora(64)  # (the module's runner: its projections wrapped, the adapters unloaded at the end)
    every = {name: 8 for name in ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")}
    runner.add_lora("a", write_random_adapter(tmp_path / "a", runner.config, every, seed=1))
    runner.add_lora("b", write_random_adapter(tmp_path / "b", runner.config, {"k_proj": 4, "v_proj": 6, "up_proj": 4},
                                              seed=2, use_rslora=True))
    tok = AutoTokenizer.from_pretrained(str(runner.model_dir))
    texts = ["The capital of France is", "def add(a, b):\n", "Once upon a time, in a small village, there lived",
             "The capital of France is"]
    prompts = {f"p{i}": tok(t)["input_ids"] for i, t in enumerate(texts)}
    adapters = {"p0": "a", "p1": "", "p2": "b", "p3": "a"}
    with_adapters: list[int] = []  # rows of each step with adapter rows the path took
    errors: list[float] = []

    def both(model_, input_ids, positions, kv_caches, meta):
        fast = path.forward(input_ids, positions, kv_caches, meta)
        slow = runner.model(input_ids, positions, kv_caches, meta, runner.attention)
        if fast is not None:
            if runner.loras.state.active:
                with_adapters.append(input_ids.shape[0])
            for got, want in zip(fast, slow, strict=True):
                errors.append(((got - want).norm() / want.norm()).item())
        return slow

    monkeypatch.setattr(runner.backend, "forward", both)
    builder = PlanBuilder(block_size=16, num_blocks=256)
    mixed_workload(builder, prompts, max_tokens=8)
    next_plan = builder.next_plan

    def with_lora():
        plan = next_plan()
        for new in plan.new_requests:
            new.lora = adapters[new.req_id]
        return plan

    builder.next_plan = with_lora
    try:
        outputs = run_to_completion(runner, builder)
    finally:
        runner.remove_lora("a")
        runner.remove_lora("b")
    assert with_adapters and max(with_adapters) >= 3, with_adapters
    print(f"adapter rows through the C step: relative error to the modules, max {max(errors):.2e}")
    assert max(errors) < 1e-5, max(errors)
    assert outputs["p0"] == outputs["p3"] and outputs["p0"] != outputs["p1"]  # the adapter's, same prompt, same tokens
