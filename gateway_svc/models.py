"""The models a gateway serves: the base model and the LoRA adapters its scheduler has loaded.

- A request's `model` selects one: none, or the base's name (`GetModelInfo().name`), is the base;
  any other name is sent as `GenerateRequest.model`. A name that the last `ModelInfo.lora_adapters`
  lacks is asked about once more, and if the scheduler has not loaded it, it is a 404
  `model_not_found` naming `model` before any Generate (so a scheduler without LoRA never answers
  with the base under an adapter's name). The list may be stale the other way (an adapter
  unloaded since): the scheduler's NOT_FOUND naming `model` is the same 404
  (`GatewayError.from_pagoda`).
- `GET /v1/models` lists the base and each adapter of `ModelInfo.lora_adapters` in vLLM's shape:
  an adapter's `parent` is the base's id. (`root` is vLLM's path of the weights; the gRPC API
  names adapters without their paths, so here it is the model's own name.)
- `POST /v1/load_lora_adapter` (`{"lora_name", "lora_path"}`) and `POST /v1/unload_lora_adapter`
  (`{"lora_name"}`): vLLM's routes and bodies onto the scheduler's `LoadLoraAdapter` /
  `UnloadLoraAdapter`, answered with vLLM's success text; the scheduler's refusal keeps its
  status and message (400, 404, 409, ... in OpenAI's shape, `param` the field it names).
"""

from __future__ import annotations

from fastapi import APIRouter, Request
from fastapi.responses import PlainTextResponse

from gateway_svc.body import bearer, parse_body
from gateway_svc.errors import GatewayError
from gateway_svc.schemas import LoadLoraAdapterRequest, UnloadLoraAdapterRequest
from pagoda.client import AsyncClient, ModelInfo

OWNED_BY = "pagoda"


class ModelName:
    """The base model's name as GetModelInfo reports it, asked once (with the first caller's key)
    and kept, and what a request's `model` selects (the module docstring)."""

    def __init__(self, client: AsyncClient):
        self._client = client
        self._name: str | None = None
        self.info: ModelInfo | None = None  # the first GetModelInfo's answer (its parsers)
        self._adapters: frozenset[str] = frozenset()  # as last reported: a hint, the scheduler decides

    async def get(self, api_key: str | None) -> str:
        if self._name is None:
            self.info = await self._client.model_info(api_key=api_key)
            self._name = self.info.name
        return self._name

    async def select(self, requested: str | None, api_key: str | None) -> tuple[str, str | None]:
        """(the name a response gives as its `model`, the adapter for `GenerateRequest.model`:
        None for the base)."""
        name = await self.get(api_key)
        if not requested or requested == name:
            return name, None
        if requested not in self._adapters:
            self._adapters = frozenset((await self._client.model_info(api_key=api_key)).lora_adapters)
            if requested not in self._adapters:
                raise GatewayError(404, f"The model `{requested}` does not exist: neither `{name}` nor one of the "
                                        "LoRA adapters loaded now (GET /v1/models lists them)",
                                   param="model", code="model_not_found")
        return requested, requested


def model_cards(info: ModelInfo) -> list[dict]:
    """The base model's card, then one per loaded adapter with the base as its `parent`."""

    def card(name: str, parent: str | None) -> dict:
        return {"id": name, "object": "model", "created": 0, "owned_by": OWNED_BY, "root": name,
                "parent": parent, "max_model_len": info.max_model_len}

    return [card(info.name, None), *(card(adapter, info.name) for adapter in info.lora_adapters)]


def models_router(client: AsyncClient) -> APIRouter:
    router = APIRouter()

    @router.get("/v1/models")
    async def models(request: Request):
        info = await client.model_info(api_key=bearer(request))  # asked each time: adapters come and go
        return {"object": "list", "data": model_cards(info)}

    @router.post("/v1/load_lora_adapter")
    async def load_lora_adapter(request: Request):
        body = await parse_body(request, LoadLoraAdapterRequest)
        await client.load_lora_adapter(body.lora_name, body.lora_path, api_key=bearer(request))
        return PlainTextResponse(f"Success: LoRA adapter '{body.lora_name}' added successfully.")

    @router.post("/v1/unload_lora_adapter")
    async def unload_lora_adapter(request: Request):
        body = await parse_body(request, UnloadLoraAdapterRequest)
        await client.unload_lora_adapter(body.lora_name, api_key=bearer(request))
        return PlainTextResponse(f"Success: LoRA adapter '{body.lora_name}' removed successfully.")

    return router
