"""Retrieval routes over the scheduler's Embed and Rerank (a model served with --runner pooling):

- `POST /v1/embeddings` (OpenAI's): `input` a string, a list of strings, a list of token ids or
  a list of such lists; `encoding_format` "float" or "base64" (little-endian float32, as OpenAI
  sends and its SDK decodes); `dimensions` (a Matryoshka model's); vLLM's extras
  `truncate_prompt_tokens` and `normalize`. Answer: `{"object": "list", "data": [{"object":
  "embedding", "index", "embedding"}], "model", "usage": {"prompt_tokens", "total_tokens"}}`.
- `POST /v1/rerank` (the Jina / Cohere shape vLLM serves): `query`, `documents` (strings),
  `top_n` (0 or absent: all), `return_documents` (default true). Answer: `{"id", "model",
  "usage": {"total_tokens"}, "results": [{"index", "relevance_score", "document": {"text"}}]}`,
  best first.
- `POST /v1/score` (vLLM's): `text_1` and `text_2`, each a string or a list: one text_1 against
  every text_2, or pairs of two lists of one length. Answer: `{"id", "object": "list", "created",
  "model", "data": [{"index", "object": "score", "score"}], "usage"}` in the pairs' order.

The scheduler checks every field (`scheduler_svc/pooling_requests.py`); its refusal is a 400 in
OpenAI's shape whose `param` is this route's name of the field (`texts[3]` is `input`).
"""

from __future__ import annotations

import asyncio
import base64
import struct
import time
import uuid
from typing import Annotated, Literal

from fastapi import APIRouter, Request
from pydantic import Field

from gateway_svc.body import bearer, parse_body
from gateway_svc.errors import GatewayError
from gateway_svc.models import ModelName
from gateway_svc.schemas import UINT32_MAX, Text, TokenId, _Strict
from pagoda.client import AsyncClient, PagodaError

# The most inputs (texts or token lists) of one body: OpenAI's limit, the scheduler's MAX_POOL_INPUTS.
MAX_INPUTS = 2048
Dimension = Annotated[int, Field(ge=1, le=UINT32_MAX)]

# The scheduler's field (before any "[i]" or ".") -> each route's name for it
_EMBED_FIELDS = {"texts": "input", "token_ids": "input", "dimensions": "dimensions",
                 "truncate_prompt_tokens": "truncate_prompt_tokens", "model": "model"}
_RERANK_FIELDS = {"query": "query", "documents": "documents", "model": "model"}
_SCORE_FIELDS = {"query": "text_1", "documents": "text_2", "model": "model"}


class EmbeddingRequest(_Strict):
    model: Text | None = None
    input: (Text | Annotated[list[Text], Field(max_length=MAX_INPUTS)] | list[TokenId]
            | Annotated[list[list[TokenId]], Field(max_length=MAX_INPUTS)])
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: Dimension | None = None
    user: Text | None = None
    truncate_prompt_tokens: Dimension | None = None  # vLLM's
    normalize: bool | None = None  # vLLM's


class RerankRequest(_Strict):
    model: Text | None = None
    query: Text
    documents: Annotated[list[Text], Field(max_length=MAX_INPUTS)]
    top_n: Annotated[int, Field(ge=0, le=UINT32_MAX)] | None = None
    return_documents: bool = True


class ScoreRequest(_Strict):
    model: Text | None = None
    text_1: Text | Annotated[list[Text], Field(min_length=1, max_length=MAX_INPUTS)]
    text_2: Text | Annotated[list[Text], Field(min_length=1, max_length=MAX_INPUTS)]


def _refusal(err: PagodaError, fields: dict[str, str]) -> GatewayError:
    """The scheduler's refusal, its field named as the route names it."""
    error = GatewayError.from_pagoda(err)
    field, sep, rest = err.details.partition(": ")
    name = fields.get(field.split("[")[0].split(".")[0]) if sep and " " not in field else None
    if name:
        error.param, error.message = name, f"{name}: {rest}" if name == field else f"{name} ({field}): {rest}"
    return error


def _base64(values) -> str:
    return base64.b64encode(struct.pack(f"<{len(values)}f", *values)).decode("ascii")


def pooling_router(client: AsyncClient, model: ModelName) -> APIRouter:
    router = APIRouter()

    async def select(requested: str | None, key: str | None) -> str:
        name, adapter = await model.select(requested, key)
        if adapter is not None:
            raise GatewayError(400, f"model: `{requested}` is a LoRA adapter; a pooling model serves no adapters",
                               param="model", code="model_not_found")
        return name

    @router.post("/v1/embeddings")
    async def embeddings(request: Request):
        body = await parse_body(request, EmbeddingRequest)
        key = bearer(request)
        name = await select(body.model, key)
        try:
            reply = await client.embed(body.input, normalize=body.normalize, dimensions=body.dimensions,
                                       truncate_prompt_tokens=body.truncate_prompt_tokens, api_key=key)
        except PagodaError as err:
            raise _refusal(err, _EMBED_FIELDS) from None
        encode = _base64 if body.encoding_format == "base64" else list
        data = [{"object": "embedding", "index": i, "embedding": encode(v)} for i, v in enumerate(reply.vectors)]
        tokens = reply.usage.prompt_tokens
        return {"object": "list", "data": data, "model": name, "usage": {"prompt_tokens": tokens, "total_tokens": tokens}}

    @router.post("/v1/rerank")
    async def rerank(request: Request):
        body = await parse_body(request, RerankRequest)
        key = bearer(request)
        name = await select(body.model, key)
        try:
            reply = await client.rerank(body.query, body.documents, top_n=body.top_n or None, api_key=key)
        except PagodaError as err:
            raise _refusal(err, _RERANK_FIELDS) from None
        results = []
        for result in reply.results:
            item = {"index": result.index, "relevance_score": result.relevance_score}
            if body.return_documents:
                item["document"] = {"text": body.documents[result.index]}
            results.append(item)
        return {"id": f"rerank-{uuid.uuid4().hex}", "model": name,
                "usage": {"total_tokens": reply.usage.prompt_tokens}, "results": results}

    @router.post("/v1/score")
    async def score(request: Request):
        body = await parse_body(request, ScoreRequest)
        key = bearer(request)
        name = await select(body.model, key)
        firsts = [body.text_1] if isinstance(body.text_1, str) else body.text_1
        seconds = [body.text_2] if isinstance(body.text_2, str) else body.text_2
        if len(firsts) == 1:
            calls = [(firsts[0], seconds)]
        elif len(firsts) == len(seconds):
            calls = [(first, [second]) for first, second in zip(firsts, seconds)]
        else:
            raise GatewayError(400, f"text_1: {len(firsts)} texts for the {len(seconds)} of text_2: give one, or as many",
                               param="text_1")
        try:
            replies = await asyncio.gather(*(client.rerank(q, docs, api_key=key) for q, docs in calls))
        except PagodaError as err:
            raise _refusal(err, _SCORE_FIELDS) from None
        scores: list[float] = []
        for reply, (_, docs) in zip(replies, calls):
            by_index = {r.index: r.relevance_score for r in reply.results}
            scores.extend(by_index[i] for i in range(len(docs)))
        tokens = sum(reply.usage.prompt_tokens for reply in replies)
        return {"id": f"score-{uuid.uuid4().hex}", "object": "list", "created": int(time.time()), "model": name,
                "data": [{"index": i, "object": "score", "score": s} for i, s in enumerate(scores)],
                "usage": {"prompt_tokens": tokens, "total_tokens": tokens}}

    return router
