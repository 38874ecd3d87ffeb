"""Tokenization, chat templating and detokenization off the event loop.

A 600 000-character prompt takes the tokenizer about a second; on the event loop that second
would freeze every stream and health check. The `tokenizers` library releases the GIL while
it encodes, so a small thread pool (`PromptWorker`) runs it beside the loop. Before any of
that, the cheap checks run on the loop (`validation.check_fields`): they refuse a text too long
to fit max_model_len before it is tokenized.

A reply larger than a default gRPC client receives (4 MiB) is refused with
RESOURCE_EXHAUSTED, naming the size, instead of failing on the client's side.
"""

from __future__ import annotations

import asyncio
from concurrent.futures import ThreadPoolExecutor

from transformers import PreTrainedTokenizerBase

from pagoda.v1 import generation_pb2 as pb
from scheduler_svc.errors import InvalidArgument, ResourceExhausted
from scheduler_svc.tokenizer import ModelSpec, encode_text
from scheduler_svc.validation import GenerateParams, build_params, chat_token_ids, check_fields, prompt_token_ids

# What a gRPC client receives by default (grpc.max_receive_message_length): the server sends no more.
MAX_REPLY_BYTES = 4 * 1024 * 1024
# Threads for tokenization: more would only queue on the same cores, and leave the loop less CPU.
PROMPT_THREADS = 2


class PromptWorker:
    def __init__(self, tokenizer: PreTrainedTokenizerBase, spec: ModelSpec, max_model_len: int, threads: int = PROMPT_THREADS):
        self.tokenizer = tokenizer
        self.spec = spec
        self.max_model_len = max_model_len
        self._pool = ThreadPoolExecutor(threads, thread_name_prefix="tokenize")

    async def _run(self, fn, *args):
        return await asyncio.get_running_loop().run_in_executor(self._pool, fn, *args)

    async def generate_params(self, req: pb.GenerateRequest) -> GenerateParams:
        """validate_generate, with the prompt tokenized off the loop once the cheap checks pass."""
        sampling = check_fields(req, self.spec, self.max_model_len)
        ids = await self._run(prompt_token_ids, req, self.tokenizer, self.spec.vocab_size)
        return build_params(req, sampling, ids, self.spec, self.max_model_len)

    async def tokenize(self, req: pb.TokenizeRequest) -> pb.TokenizeResponse:
        reply = await self._run(self._tokenize, req)
        size = reply.ByteSize()
        if size > MAX_REPLY_BYTES:
            raise ResourceExhausted(
                f"the reply would be {size} bytes, more than the {MAX_REPLY_BYTES} a gRPC client receives "
                f"by default ({len(reply.token_ids)} tokens): send shorter text"
            )
        return reply

    def _tokenize(self, req: pb.TokenizeRequest) -> pb.TokenizeResponse:
        tokenizer = self.tokenizer
        kind = req.WhichOneof("prompt")
        if kind == "text":
            ids = encode_text(tokenizer, req.text)
        elif kind == "chat":
            add = req.add_generation_prompt if req.HasField("add_generation_prompt") else True
            ids = chat_token_ids(req.chat, tokenizer, "chat", add)
        else:
            raise InvalidArgument("prompt", "one of text or chat is required")
        return pb.TokenizeResponse(token_ids=ids, tokens=tokenizer.convert_ids_to_tokens(ids))

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
