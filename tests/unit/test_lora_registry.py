"""The scheduler's LoRA registry with stand-in executors: loading on all or none, LRU eviction under
--max-cpu-loras and loading again on demand, refusals by field."""

from __future__ import annotations

import asyncio
import json

import grpc
import pytest

from scheduler_svc.errors import ServiceError
from scheduler_svc.lora_registry import LoraRegistry, parse_lora_modules


def adapter_folder(root, name, rank=4):
    folder = root / name
    folder.mkdir()
    (folder / "adapter_config.json").write_text(json.dumps({"peft_type": "LORA", "r": rank, "lora_alpha": 8}))
    (folder / "adapter_model.safetensors").write_bytes(b"weights of " + name.encode())
    return str(folder)


class Executors:
    """Stand-ins: each records what it is sent and answers a load with `refuse`'s error ("" = loaded)."""

    def __init__(self, ids=("e1", "e2"), refuse=None):
        self.ids = list(ids)
        self.sent: list[tuple[str, str, str]] = []  # (executor, load/unload, adapter)
        self.refuse = refuse or {}
        self.registry: LoraRegistry | None = None

    async def send(self, executor_id, msg) -> bool:
        kind = msg.WhichOneof("kind")
        name = getattr(msg, kind).name
        self.sent.append((executor_id, kind, name))
        if kind == "load_lora":
            error = self.refuse.get((executor_id, name), "")
            asyncio.get_running_loop().call_soon(self.registry.on_status, executor_id, name, error)
        return True


def make(max_cpu_loras=2, in_use=(), **executors):
    fakes = Executors(**executors)
    used = set(in_use)
    registry = LoraRegistry(16, max_cpu_loras, "base-model", lambda: fakes.ids, fakes.send, lambda name: name in used)
    fakes.registry = registry
    return registry, fakes, used


def code_of(exc: ServiceError) -> grpc.StatusCode:
    return exc.code


def test_loads_everywhere_evicts_the_least_recently_used_and_loads_it_again_on_demand(tmp_path):
    async def scenario():
        registry, fakes, _ = make(max_cpu_loras=2)
        for name in "abc":
            path = adapter_folder(tmp_path, name)
            if name != "c":
                await registry.load(name, path)
        assert {(e, n) for e, k, n in fakes.sent if k == "load_lora"} == {(e, n) for e in ("e1", "e2") for n in "ab"}
        assert await registry.acquire("a") == "a"  # a is now the most recently used
        await registry.load("c", str(tmp_path / "c"))  # evicts b
        await asyncio.sleep(0.05)
        assert list(registry.adapters) == ["a", "c"] and registry.names() == ["a", "b", "c"]
        assert ("e1", "unload_lora", "b") in fakes.sent
        fakes.sent.clear()
        assert await registry.acquire("b") == "b"  # loaded again from its path, evicting a
        await asyncio.sleep(0.05)
        assert list(registry.adapters) == ["c", "b"]
        assert ("e2", "load_lora", "b") in fakes.sent and ("e1", "unload_lora", "a") in fakes.sent
        assert await registry.acquire("") == "" and await registry.acquire("base-model") == ""
        with pytest.raises(ServiceError) as err:
            await registry.acquire("nope")
        assert code_of(err.value) == grpc.StatusCode.NOT_FOUND and err.value.message.startswith("model:")

    asyncio.run(scenario())


def test_a_refusal_on_one_executor_loads_it_nowhere(tmp_path):
    async def scenario():
        registry, fakes, _ = make(refuse={("e2", "x"): "base_model.model.q_proj.lora_A: shape (4, 96)"})
        with pytest.raises(ServiceError) as err:
            await registry.load("x", adapter_folder(tmp_path, "x"))
        assert code_of(err.value) == grpc.StatusCode.FAILED_PRECONDITION
        assert err.value.message.startswith("lora_path:") and "e2" in err.value.message and "shape" in err.value.message
        assert {e for e, k, n in fakes.sent if k == "unload_lora"} == {"e1", "e2"}
        assert registry.names() == [] and not registry.adapters

    asyncio.run(scenario())


def test_every_adapter_in_use_leaves_no_room(tmp_path):
    async def scenario():
        registry, _, used = make(max_cpu_loras=1)
        await registry.load("a", adapter_folder(tmp_path, "a"))
        used.add("a")
        with pytest.raises(ServiceError) as err:
            await registry.load("b", adapter_folder(tmp_path, "b"))
        assert code_of(err.value) == grpc.StatusCode.RESOURCE_EXHAUSTED

    asyncio.run(scenario())


@pytest.mark.parametrize(
    "name,make_path,code,field",
    [
        ("", lambda tmp: adapter_folder(tmp, "ok"), grpc.StatusCode.INVALID_ARGUMENT, "lora_name:"),
        ("base-model", lambda tmp: adapter_folder(tmp, "ok"), grpc.StatusCode.INVALID_ARGUMENT, "lora_name:"),
        ("a", lambda tmp: "", grpc.StatusCode.INVALID_ARGUMENT, "lora_path:"),
        ("a", lambda tmp: str(tmp / "absent"), grpc.StatusCode.NOT_FOUND, "lora_path:"),
        ("a", lambda tmp: adapter_folder(tmp, "wide", rank=32), grpc.StatusCode.INVALID_ARGUMENT, "r:"),
    ],
)
def test_refusals_name_the_field(name, make_path, code, field, tmp_path):
    async def scenario():
        registry, fakes, _ = make()
        with pytest.raises(ServiceError) as err:
            await registry.load(name, make_path(tmp_path))
        assert code_of(err.value) == code and err.value.message.startswith(field), err.value.message
        assert not fakes.sent and not registry.names()

    asyncio.run(scenario())


def test_lora_modules_flag_forms():
    assert parse_lora_modules(["sql=/a/b", "org/adapter", "x=org/y"]) == [
        ("sql", "/a/b"), ("adapter", "org/adapter"), ("x", "org/y")]
    with pytest.raises(ValueError, match="NAME=PATH"):
        parse_lora_modules(["=/a"])
