"""OpenAI requests to `GenerateParams`, and Pagoda chunks to OpenAI's response objects.

Token strings in logprobs: the gRPC API returns token ids with each text delta, not the
tokens' own strings; with logprobs on, each response holds one token per sequence, so the
chunk's text is that token's. A token without text of its own (a partial UTF-8 character)
and the top alternatives are written as `token_id:<id>` (vLLM's `return_tokens_as_token_ids`
form), which a client can map back to its tokenizer.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field, replace

from gateway_svc.errors import GatewayError
from gateway_svc.schemas import ChatCompletionRequest, CompletionRequest, ContentPart, _Sampling
from pagoda.client import Chunk, FinishReason, GenerateParams, TokenLogprob, Usage

_UINT64 = (1 << 64) - 1

FINISH = {
    FinishReason.EOS: "stop",
    FinishReason.STOP_SEQUENCE: "stop",
    FinishReason.STOP_TOKEN: "stop",
    FinishReason.LENGTH: "length",
    FinishReason.ABORTED: "stop",
}


def _common(req: _Sampling, max_tokens: int | None, logprobs: bool, top_logprobs: int,
            constraint: dict, adapter: str | None) -> GenerateParams:
    stop = [req.stop] if isinstance(req.stop, str) else list(req.stop or [])
    bias = {int(k): v for k, v in (req.logit_bias or {}).items()}  # keys checked by the schema
    return GenerateParams(
        max_tokens=max_tokens,
        temperature=req.temperature,
        top_p=req.top_p,
        top_k=req.top_k,
        min_p=req.min_p,
        seed=None if req.seed is None else req.seed & _UINT64,
        n=req.n,
        presence_penalty=req.presence_penalty,
        frequency_penalty=req.frequency_penalty,
        repetition_penalty=req.repetition_penalty,
        logit_bias=bias,
        min_tokens=req.min_tokens,
        stop=stop,
        ignore_eos=req.ignore_eos,
        logprobs=logprobs,
        top_logprobs=top_logprobs,
        model=adapter,
        **constraint,
    )


def completion_params(req: CompletionRequest, constraint: dict, adapter: str | None = None) -> GenerateParams:
    """The request's options; `adapter`: the LoRA adapter its `model` selects (None: the base)."""
    if req.echo:
        raise GatewayError(400, "echo: not supported", param="echo")
    if req.suffix:
        raise GatewayError(400, "suffix: not supported", param="suffix")
    if req.best_of not in (None, req.n):
        raise GatewayError(400, "best_of: only best_of = n is supported", param="best_of")
    logprobs = req.logprobs is not None
    return _common(req, req.max_tokens, logprobs, req.logprobs or 0, constraint, adapter)


def completion_prompts(req: CompletionRequest) -> list[str | list[int]]:
    """A prompt, a list of prompts, token ids, or a list of token-id lists."""
    p = req.prompt
    if isinstance(p, str):
        return [p]
    if p and all(isinstance(x, int) for x in p):
        return [list(p)]
    if not p:
        raise GatewayError(400, "prompt: must not be empty", param="prompt")
    return list(p)


def chat_params(req: ChatCompletionRequest, constraint: dict, adapter: str | None = None,
                reasoning_parser: str | None = None, special_tokens: bool = False) -> GenerateParams:
    """The request's options; `adapter`: the LoRA adapter its `model` selects (None: the base);
    `reasoning_parser`: the gateway's (None: the scheduler's); `special_tokens`: keep them in the
    text (a tool-call format marked by one, as Mistral's `[TOOL_CALLS]`)."""
    max_tokens = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
    if req.top_logprobs and not req.logprobs:
        raise GatewayError(400, "top_logprobs: needs logprobs: true", param="top_logprobs")
    params = _common(req, max_tokens, req.logprobs, req.top_logprobs or 0, constraint, adapter)
    return replace(params, reasoning_parser=reasoning_parser, chat_template_kwargs=req.chat_template_kwargs,
                   skip_special_tokens=False if special_tokens else None)


_IMAGE_PARTS = ("input_image", "image")  # the Responses and Anthropic names: chat takes "image_url"


def _content_text(i: int, parts: list[ContentPart]) -> str | list[dict]:
    """List-form content: its "text" parts joined with newlines, as vLLM joins them for a chat
    template that takes text; with an "image_url" part, the parts in order (the scheduler sends them
    as `ChatMessage.parts`; it takes a `data:` URL, or one of its --allowed-media-domains)."""
    texts, items = [], []
    for j, part in enumerate(parts):
        param = f"messages.{i}.content.{j}"
        if part.type == "image_url":
            image_url = (part.model_extra or {}).get("image_url")
            url = image_url.get("url") if isinstance(image_url, dict) else None
            if not isinstance(url, str) or not url:
                raise GatewayError(400, f"{param}.image_url.url: required, a data: URL or an image's URL",
                                   param=f"{param}.image_url.url")
            items.append({"type": "image_url", "image_url": {"url": url}})
            continue
        if part.type in _IMAGE_PARTS:
            raise GatewayError(400, f"{param}: content part type {part.type!r} is not supported; "
                                    f"use \"image_url\"", param=param)
        if part.type != "text":
            raise GatewayError(400, f"{param}: content part type {part.type!r} is not supported; "
                                    f"use \"text\"", param=param)
        if part.text is None:
            raise GatewayError(400, f"{param}.text: required for a \"text\" part", param=f"{param}.text")
        texts.append(part.text)
        items.append({"type": "text", "text": part.text})
    if any(item["type"] == "image_url" for item in items):
        return items
    return "\n".join(texts)


def chat_messages(req: ChatCompletionRequest) -> list[dict]:
    """Messages with text content (list-form content as `_content_text`), an assistant's
    `tool_calls` and a tool's `tool_call_id` kept (the scheduler gives them to the template)."""
    out = []
    for i, m in enumerate(req.messages):
        content = m.content
        if isinstance(content, list):
            content = _content_text(i, content)
        message = {"role": m.role, "content": content or ""}
        for j, c in enumerate(m.tool_calls or ()):
            try:
                json.loads(c.function.arguments)
            except ValueError:
                param = f"messages.{i}.tool_calls.{j}.function.arguments"
                raise GatewayError(400, f"{param}: must be JSON text", param=param) from None
        if m.tool_calls:
            message["tool_calls"] = [c.model_dump() for c in m.tool_calls]
        if m.tool_call_id:
            message["tool_call_id"] = m.tool_call_id
        out.append(message)
    return out


def usage_json(usages: list[Usage | None]) -> dict:
    prompt = sum(u.prompt_tokens for u in usages if u)
    completion = sum(u.completion_tokens for u in usages if u)
    cached = sum(u.cached_prompt_tokens for u in usages if u)
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion,
            "prompt_tokens_details": {"cached_tokens": cached}}


# -- logprobs ----------------------------------------------------------------------


def _token_str(token_id: int) -> str:
    return f"token_id:{token_id}"


@dataclass
class TokenEntry:
    token: str
    logprob: float
    top: list[tuple[str, float]]


def token_entries(chunk: Chunk) -> list[TokenEntry]:
    """The chunk's tokens with their strings (see the module docstring) and logprobs."""
    single = len(chunk.token_ids) == 1 and chunk.text

    def name(token_id: int) -> str:
        return chunk.text if single and token_id == chunk.token_ids[0] else _token_str(token_id)

    def entry(lp: TokenLogprob) -> TokenEntry:
        return TokenEntry(name(lp.token_id), lp.logprob, [(name(t.token_id), t.logprob) for t in lp.top])

    return [entry(lp) for lp in chunk.logprobs]


def _bytes(token: str) -> list[int] | None:
    return None if token.startswith("token_id:") else list(token.encode())


def chat_logprobs(entries: list[TokenEntry]) -> dict:
    return {"content": [
        {"token": e.token, "logprob": e.logprob, "bytes": _bytes(e.token),
         "top_logprobs": [{"token": t, "logprob": lp, "bytes": _bytes(t)} for t, lp in e.top]}
        for e in entries
    ]}


def completion_logprobs(entries: list[TokenEntry], text_offset: int) -> dict:
    offsets, offset = [], text_offset
    for e in entries:
        offsets.append(offset)
        offset += 0 if e.token.startswith("token_id:") else len(e.token)
    return {
        "tokens": [e.token for e in entries],
        "token_logprobs": [e.logprob for e in entries],
        "top_logprobs": [dict(e.top) for e in entries],
        "text_offset": offsets,
    }


@dataclass
class Choice:
    """One choice of a non-streamed response, joined from its chunks."""

    index: int
    text: str = ""
    entries: list[TokenEntry] = field(default_factory=list)
    finish_reason: str | None = None
    reasoning: str = ""

    def add(self, chunk: Chunk, logprobs: bool) -> None:
        self.text += chunk.text
        self.reasoning += chunk.reasoning_text
        if logprobs:
            self.entries.extend(token_entries(chunk))
        if chunk.finish_reason is not None:
            self.finish_reason = FINISH[chunk.finish_reason]
