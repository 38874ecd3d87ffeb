"""A stand-in scheduler with LoRA adapters (issue 38): it records what it is sent and keeps its own
set of loaded adapters, answering as the scheduler's contract says (DESIGN.md, Public API)."""

from __future__ import annotations

import grpc

from pagoda.v1 import generation_pb2 as pb
from tests.client.keyed_server import KeyedServicer

BASE = "keyed"  # GetModelInfo().name

# lora_path -> the stand-in's refusal of it (as the scheduler answers: the field named first)
REFUSALS = {
    "/adapters/rank-128": (grpc.StatusCode.INVALID_ARGUMENT, "lora_path: rank 128 is above --max-lora-rank 64"),
    "/adapters/missing": (grpc.StatusCode.NOT_FOUND, "lora_path: no adapter_config.json in /adapters/missing"),
    "/adapters/disabled": (grpc.StatusCode.FAILED_PRECONDITION,
                           "lora_name: LoRA adapters need the scheduler's --enable-lora"),
    "/adapters/taken": (grpc.StatusCode.ALREADY_EXISTS, "lora_name: an adapter of that name is loaded"),
}


class LoraServicer(KeyedServicer):
    """Loads adapters into a set (refusing the paths of `REFUSALS`), lists them in ModelInfo, and
    answers a Generate naming another model NOT_FOUND, as the scheduler's contract says."""

    def __init__(self):
        self.requests: list[pb.GenerateRequest] = []
        self.loads: list[pb.LoadLoraAdapterRequest] = []
        self.unloads: list[pb.UnloadLoraAdapterRequest] = []
        self.adapters: list[str] = []

    def GetModelInfo(self, request, context):
        self._check(context)
        return pb.ModelInfo(name=BASE, vocab_size=3, max_model_len=512, lora_adapters=self.adapters)

    def Generate(self, request, context):
        self._check(context)
        self.requests.append(request)
        if request.model not in ("", BASE, *self.adapters):
            context.abort(grpc.StatusCode.NOT_FOUND, f"model: no LoRA adapter named {request.model!r} is loaded")
        yield from super().Generate(request, context)

    def LoadLoraAdapter(self, request, context):
        self._check(context)
        self.loads.append(request)
        if request.lora_path in REFUSALS:
            context.abort(*REFUSALS[request.lora_path])
        self.adapters.append(request.lora_name)
        return pb.LoadLoraAdapterResponse()

    def UnloadLoraAdapter(self, request, context):
        self._check(context)
        self.unloads.append(request)
        if request.lora_name not in self.adapters:
            context.abort(grpc.StatusCode.NOT_FOUND,
                          f"lora_name: no LoRA adapter named {request.lora_name!r} is loaded")
        self.adapters.remove(request.lora_name)
        return pb.UnloadLoraAdapterResponse()

    def GetServerInfo(self, request, context):
        self._check(context)
        return pb.ServerInfo(version="stand-in")
