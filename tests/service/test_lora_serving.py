"""LoRA adapters through the services (one start): `--lora-modules`, `GenerateRequest.model`, run-time
load and unload, each refusal by its field, an executor that joins later, one killed mid-stream.

The base is a tiny random Llama (tests/model_families.py), the adapters random PEFT folders
(`init_lora_weights=False`); every answer is compared with transformers + peft on the same weights.
"""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest

from pagoda.v1 import generation_pb2 as pb
from tests.executor.test_lora import make_adapter, peft_reference
from tests.model_families import build_family, load_reference
from tests.service.harness import Service, collect, greedy_request, hf_greedy

PROMPT = [1, 520, 33, 1200, 9, 17, 44, 803, 90, 12, 7, 300]
TOKENS = 24


def ask(svc, model: str, max_tokens: int = TOKENS, request_id: str = "", timeout: float = 120):
    req = greedy_request(prompt_ids=PROMPT, max_tokens=max_tokens, ignore_eos=True, request_id=request_id)
    req.model = model
    return collect(svc.stub.Generate(req, timeout=timeout))["outputs"][0]["token_ids"]


@pytest.fixture(scope="module")
def folders(tmp_path_factory, default_model_dir):
    root = tmp_path_factory.mktemp("lora-service")
    base = build_family("llama", root / "base", default_model_dir)
    return {
        "base": base,
        "sql": make_adapter(base, root / "sql", ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"], seed=1),
        "chat": make_adapter(base, root / "chat", ["q_proj", "v_proj"], r=4, seed=2, use_rslora=True),
        "late": make_adapter(base, root / "late", ["o_proj", "down_proj"], r=16, seed=3),
        "wide": make_adapter(base, root / "wide", ["q_proj"], r=32, alpha=32, seed=4),
        "other": make_adapter(build_family("llama", root / "other", default_model_dir, hidden_size=96), root / "other-a",
                              ["q_proj"], seed=5),
    }


def test_adapters_through_the_services(folders, tmp_path):
    base = folders["base"]
    expected = {
        "": hf_greedy(load_reference(base), PROMPT, TOKENS, ignore_eos=True),
        "sql": hf_greedy(peft_reference(base, folders["sql"]), PROMPT, TOKENS, ignore_eos=True),
        "chat": hf_greedy(peft_reference(base, folders["chat"]), PROMPT, TOKENS, ignore_eos=True),
        "late": hf_greedy(peft_reference(base, folders["late"]), PROMPT, TOKENS, ignore_eos=True),
    }
    assert len({tuple(v) for v in expected.values()}) == 4
    scheduler_args = ["--lora-modules", f"sql={folders['sql']}", "--max-loras", "2", "--max-lora-rank", "16",
                      "--max-num-batched-tokens", "8"]
    with Service(model=str(base), scheduler_args=scheduler_args) as svc:
        info = svc.stub.GetModelInfo(pb.GetModelInfoRequest())
        assert list(info.lora_adapters) == ["sql"]
        # the base (by "" and by its name) and the adapter, mixed in one batch, chunked prefill of 8 tokens
        with ThreadPoolExecutor(4) as pool:
            answers = list(pool.map(lambda m: ask(svc, m), ["", "sql", info.name, "sql"]))
        assert answers == [expected[""], expected["sql"], expected[""], expected["sql"]]

        # unknown model: NOT_FOUND naming `model`, before any work
        with pytest.raises(grpc.RpcError) as err:
            ask(svc, "nope")
        assert err.value.code() == grpc.StatusCode.NOT_FOUND and err.value.details().startswith("model:")

        # run-time load; refusals by field, nothing loaded
        svc.stub.LoadLoraAdapter(pb.LoadLoraAdapterRequest(lora_name="chat", lora_path=str(folders["chat"])))
        assert ask(svc, "chat") == expected["chat"]
        refusals = {
            ("wide", str(folders["wide"])): (grpc.StatusCode.INVALID_ARGUMENT, "r:"),  # rank 32 > 16
            ("other", str(folders["other"])): (grpc.StatusCode.FAILED_PRECONDITION, "lora_path:"),  # another base's shapes
            ("gone", str(tmp_path / "missing")): (grpc.StatusCode.NOT_FOUND, "lora_path:"),
            ("", str(folders["chat"])): (grpc.StatusCode.INVALID_ARGUMENT, "lora_name:"),
            ("chat", str(folders["chat"])): (grpc.StatusCode.ALREADY_EXISTS, "lora_name:"),
        }
        for (name, path), (code, field) in refusals.items():
            with pytest.raises(grpc.RpcError) as err:
                svc.stub.LoadLoraAdapter(pb.LoadLoraAdapterRequest(lora_name=name, lora_path=path))
            assert err.value.code() == code and err.value.details().startswith(field), (name, err.value.details())
        assert sorted(svc.stub.GetModelInfo(pb.GetModelInfoRequest()).lora_adapters) == ["chat", "sql"]

        # a stream in flight keeps its adapter through an unload; new requests are NOT_FOUND
        req = greedy_request(prompt_ids=PROMPT, max_tokens=TOKENS, ignore_eos=True)
        req.model = "chat"
        stream = svc.stub.Generate(req, timeout=120)
        first = next(stream)
        svc.stub.UnloadLoraAdapter(pb.UnloadLoraAdapterRequest(lora_name="chat"))
        rest = collect(stream)
        assert list(first.outputs[0].token_ids) + rest["outputs"][0]["token_ids"] == expected["chat"]
        with pytest.raises(grpc.RpcError) as err:
            ask(svc, "chat")
        assert err.value.code() == grpc.StatusCode.NOT_FOUND
        with pytest.raises(grpc.RpcError) as err:
            svc.stub.UnloadLoraAdapter(pb.UnloadLoraAdapterRequest(lora_name="chat"))
        assert err.value.code() == grpc.StatusCode.NOT_FOUND and err.value.details().startswith("lora_name:")

        # an executor that joins later gets every adapter, one loaded before it too; the first one dies
        # mid-stream and the stream goes on there, identical
        svc.stub.LoadLoraAdapter(pb.LoadLoraAdapterRequest(lora_name="late", lora_path=str(folders["late"])))
        svc.add_executor()
        svc.wait_serving(2)
        req = greedy_request(prompt_ids=PROMPT, max_tokens=TOKENS, ignore_eos=True)
        req.model = "late"
        stream = svc.stub.Generate(req, timeout=180)
        received = list(next(stream).outputs[0].token_ids)
        for proc in svc.executors:
            if proc.poll() is None:
                proc.kill()  # whichever holds it: kill both in turn would lose the service; kill the first
                break
        rest = collect(stream)
        assert received + rest["outputs"][0]["token_ids"] == expected["late"]
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and sum(e.healthy for e in svc.server_info().executors) != 1:
            time.sleep(0.3)
        assert ask(svc, "sql") == expected["sql"] and ask(svc, "late") == expected["late"]
        assert "Traceback" not in svc.logs()
