"""Tokenization, chat templating and detokenization off the event loop.

A 600 000-character prompt takes the tokenizer about a second; on the event loop that second
would freeze every stream and health check. The `tokenizers` library releases the GIL while
it encodes, so a small thread pool (`PromptWorker`) runs it beside the loop. Before any of
that, the cheap checks run on the loop (`validation.check_fields`): they refuse a text too long
to fit max_model_len before it is tokenized.

Releasing the GIL in Rust is not enough for a huge text: what comes after it is Python work
that holds the GIL, and while one thread holds it the loop does not run. For a 4 MB Tokenize
(680 000 tokens), measured on the 2-core test machine: the ids as a Python list 25-35 ms in
one C call, the tokens' strings 150-250 ms, building the reply message 30-130 ms in one C
call, its ByteSize 13 ms (on the loop). Beside a stream whose tokens come every 8 ms, any of
those is a gap several times the usual one. So a text (or chat) over `OFFLOAD_CHARS`
characters is tokenized in a child process (`TokenizeProcess`, started on first use, at a
lower CPU priority): it returns the ids packed as bytes, or for Tokenize the serialized reply
or only its size, so that the scheduler's process converts nothing it does not keep.

Tenants take turns (`FairSlots`): the threads and the child each run the next job of the
tenant that has waited longest since its last turn, not the oldest job, so one tenant's
thousand texts delay another tenant's prompt by at most one job each of them already runs.

Bounded before work: a text (or chat) is refused by its characters first (Generate: more than
`max_model_len` tokens could hold, `validation.check_fields`; Tokenize: more than its token limit
could), then by its tokens, counted in pieces so that a text over the limit is refused having
tokenized about the limit's worth of it (`tokenizer.encode_at_most`). Generate's token limit is
`max_model_len - 1` (room for one generated token); Tokenize's is `tokenize_max_tokens`, the
larger of `max_model_len` and MAX_TOKENIZE_TOKENS, so that Tokenize can still count a text too
long for the model.

A reply larger than a default gRPC client receives (4 MiB) is refused with
RESOURCE_EXHAUSTED, naming the size, instead of failing on the client's side.
"""

from __future__ import annotations

import array
import asyncio
import dataclasses
import logging
import multiprocessing
import os
import signal
from concurrent.futures import ProcessPoolExecutor, ThreadPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from pathlib import Path

import grpc
from transformers import PreTrainedTokenizerBase

from pagoda.v1 import generation_pb2 as pb
from scheduler_svc.auth import current_tenant
from scheduler_svc.chat import message_chars
from scheduler_svc.errors import InvalidArgument, ResourceExhausted, ServiceError, Unavailable
from scheduler_svc.fair_slots import FairSlots
from scheduler_svc.media import ImagePrompts, MediaConfig, check_parts, decode_image, has_images, image_bytes, image_parts
from scheduler_svc.tokenizer import ModelSpec, TooManyTokens, encode_text, load_tokenizer
from scheduler_svc.validation import (
    GenerateParams, build_params, chat_text, chat_token_ids, check_fields, counted_chars, prompt_token_ids,
)

log = logging.getLogger(__name__)

# What a gRPC client receives by default (grpc.max_receive_message_length): the server sends no more.
MAX_REPLY_BYTES = 4 * 1024 * 1024
# Threads for tokenization: more would only queue on the same cores, and leave the loop less CPU.
PROMPT_THREADS = 2
# Texts (a chat: its contents) longer than this go to the child process. At this size the
# Python work after the Rust encode is ~17 000 tokens, 1-2 ms of GIL: threads are fine below.
OFFLOAD_CHARS = 100_000
# The child's nice(2) increment: a huge request waits for CPU rather than running streams.
CHILD_NICENESS = 10
# Tokenize answers texts of up to this many tokens (or max_model_len, if larger): the longest
# context of the families served (Llama 3.1's 131,072), so no prompt a model can read is refused,
# while a 4 MB text (680,000 tokens) is refused after tokenizing a fifth of it.
MAX_TOKENIZE_TOKENS = 131_072


class PromptWorker:
    def __init__(
        self,
        tokenizer: PreTrainedTokenizerBase,
        spec: ModelSpec,
        max_model_len: int,
        threads: int = PROMPT_THREADS,
        model_dir: Path | str | None = None,
        offload_chars: int = OFFLOAD_CHARS,
        media: MediaConfig = MediaConfig(),
    ):
        """`model_dir`: where the child process loads the same tokenizer (None: no child, threads only), and a
        vision-language model's processor (`media.ImagePrompts`); `media`: the limits on a chat's images."""
        self.tokenizer = tokenizer
        self.spec = spec
        self.max_model_len = max_model_len
        self.offload_chars = offload_chars
        self.tokenize_max_tokens = max(max_model_len, MAX_TOKENIZE_TOKENS)
        self._pool = ThreadPoolExecutor(threads, thread_name_prefix="tokenize")
        self._turns = FairSlots(threads)
        self._child = TokenizeProcess(model_dir, self._pool) if model_dir is not None else None
        self.media = media
        self.images = ImagePrompts.load(model_dir)

    async def _run(self, fn, *args):
        async with self._turns.turn(current_tenant()):  # tenants in turns, not first come first served
            return await asyncio.get_running_loop().run_in_executor(self._pool, fn, *args)

    async def run(self, fn, *args):
        """`fn(*args)` on the tokenizer threads (Embed and Rerank tokenize there too)."""
        return await self._run(fn, *args)

    def _offload(self, req: pb.GenerateRequest | pb.TokenizeRequest) -> bool:
        return self._child is not None and self._long(req)

    def _long(self, req: pb.GenerateRequest | pb.TokenizeRequest) -> bool:
        kind = req.WhichOneof("prompt")
        if kind == "text":
            return len(req.text) > self.offload_chars
        if kind == "chat":
            return sum(len(message_chars(m)) for m in req.chat.messages) > self.offload_chars
        return False

    async def generate_params(self, req: pb.GenerateRequest) -> GenerateParams:
        """validate_generate, with the prompt tokenized off the loop once the cheap checks pass."""
        if req.WhichOneof("prompt") == "chat":
            check_parts(req.chat, "prompt.chat", self.media)
            if has_images(req):
                return await self._image_params(req)
        if self._long(req):  # its 4 MB text alone: check_fields counts ignored characters in 6-7 ms
            sampling = await self._run(check_fields, req, self.spec, self.max_model_len)
        else:
            sampling = check_fields(req, self.spec, self.max_model_len)
        if self._offload(req):
            packed = await self._child.run(_child_prompt_ids, req.SerializeToString(), self.max_model_len)
            ids = array.array("I", packed).tolist()  # at most max_model_len - 1: prompt_token_ids refuses more
        else:
            ids = await self._run(prompt_token_ids, req, self.tokenizer, self.spec.vocab_size, self.max_model_len)
        return build_params(req, sampling, ids, self.spec, self.max_model_len)

    async def _image_params(self, req: pb.GenerateRequest) -> GenerateParams:
        """A chat with images: the cheap checks, then on the threads its images decoded and the processor run."""
        if self.images is None:
            i, j, _ = image_parts(req.chat)[0]
            raise InvalidArgument(f"prompt.chat.messages[{i}].parts[{j}].image",
                                  "this model takes no images (a text-only model, or its folder has no processor)")
        sampling = check_fields(req, self.spec, self.max_model_len)
        ids, images = await self._run(self._image_prompt, req)
        return dataclasses.replace(build_params(req, sampling, ids, self.spec, self.max_model_len), images=images)

    def _image_prompt(self, req: pb.GenerateRequest):
        return self._chat_images(req.chat, "prompt.chat", True, self.max_model_len - 1)

    def _chat_images(self, chat: pb.Chat, field: str, add_generation_prompt: bool, max_tokens: int):
        """(token ids, ImageInputs) of a chat with images: each decoded, the template rendered, the processor run."""
        pictures = []
        for i, j, image in image_parts(chat):
            name = f"{field}.messages[{i}].parts[{j}].image"
            pictures.append(decode_image(image_bytes(image, name, self.media.allowed_domains), name))
        text = chat_text(chat, self.tokenizer, field, add_generation_prompt)
        return self.images.prompt(text, pictures, max_tokens, field)

    async def token_media_params(self, req: pb.GenerateRequest, media) -> GenerateParams:
        """A token-ids prompt with its images given beside it (`vllm.grpc.engine`'s media_refs or mm_inputs,
        `scheduler_svc.vllm_engine.media`): the cheap checks on the loop, then on the threads the images
        fetched, decoded and run through the processor (or the router's pixels checked) and the ids expanded."""
        if self.images is None:
            raise InvalidArgument(media.field, "this model takes no images (a text-only model, or its folder has no processor)")
        media.check(self.media)
        sampling = check_fields(req, self.spec, self.max_model_len)
        ids = prompt_token_ids(req, self.tokenizer, self.spec.vocab_size)  # token ids: no tokenizing
        ids, images = await self._run(media.prompt, self.images, ids, self.max_model_len - 1, self.media)
        return dataclasses.replace(build_params(req, sampling, ids, self.spec, self.max_model_len), images=images)

    async def tokenize(self, req: pb.TokenizeRequest) -> pb.TokenizeResponse:
        self._check_tokenize_chars(req)
        if req.WhichOneof("prompt") == "chat":
            check_parts(req.chat, "chat", self.media)
            if has_images(req):
                return await self._image_tokenize(req)
        if self._offload(req):
            size, count, data = await self._child.run(_child_tokenize, req.SerializeToString(), self.tokenize_max_tokens)
            reply = None if size > MAX_REPLY_BYTES else await self._run(pb.TokenizeResponse.FromString, data)
        else:
            reply = await self._run(_tokenize, self.tokenizer, req, self.tokenize_max_tokens)
            size, count = reply.ByteSize(), len(reply.token_ids)
        if size > MAX_REPLY_BYTES:
            raise ResourceExhausted(
                f"the reply would be {size} bytes, more than the {MAX_REPLY_BYTES} a gRPC client receives "
                f"by default ({count} tokens): send shorter text"
            )
        return reply

    async def _image_tokenize(self, req: pb.TokenizeRequest) -> pb.TokenizeResponse:
        """A chat with images: the ids Generate gives the model (each image's placeholder expanded by the
        processor), with Generate's checks of the images."""
        if self.images is None:
            i, j, _ = image_parts(req.chat)[0]
            raise InvalidArgument(f"chat.messages[{i}].parts[{j}].image",
                                  "this model takes no images (a text-only model, or its folder has no processor)")
        add = req.add_generation_prompt if req.HasField("add_generation_prompt") else True
        ids, _ = await self._run(self._chat_images, req.chat, "chat", add, self.tokenize_max_tokens)
        return pb.TokenizeResponse(token_ids=ids, tokens=self.tokenizer.convert_ids_to_tokens(ids))

    def _check_tokenize_chars(self, req: pb.TokenizeRequest) -> None:
        """Characters first: a text that even at `spec.max_token_chars` a token has more tokens
        than Tokenize answers (as `validation.check_fields` bounds a prompt)."""
        kind = req.WhichOneof("prompt")
        if kind == "text":
            num_chars = len(req.text)
        elif kind == "chat":
            num_chars = sum(len(message_chars(m)) for m in req.chat.messages)
        else:
            return
        limit = self.tokenize_max_tokens * self.spec.max_token_chars
        if num_chars > limit and (kind == "chat" or counted_chars(req.text, self.spec) > limit):
            raise InvalidArgument(kind, f"{num_chars} characters are more than Tokenize's {self.tokenize_max_tokens} "
                                        f"tokens can hold (at most {limit})")

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
        if self._child is not None:
            self._child.close()


def _tokenize(tokenizer: PreTrainedTokenizerBase, req: pb.TokenizeRequest, max_tokens: int) -> pb.TokenizeResponse:
    kind = req.WhichOneof("prompt")
    try:
        if kind == "text":
            ids = encode_text(tokenizer, req.text, max_tokens)
        elif kind == "chat":
            add = req.add_generation_prompt if req.HasField("add_generation_prompt") else True
            ids = chat_token_ids(req.chat, tokenizer, "chat", add, max_tokens)
        else:
            raise InvalidArgument("prompt", "one of text or chat is required")
    except TooManyTokens as exc:
        raise InvalidArgument(kind, f"{exc}: more than the {max_tokens} Tokenize answers") from None
    return pb.TokenizeResponse(token_ids=ids, tokens=tokenizer.convert_ids_to_tokens(ids))


class TokenizeProcess:
    """One child process with its own copy of the tokenizer, for texts too long for a thread.

    Started on first use (importing transformers and loading the tokenizer takes it a few
    seconds, once); if it dies (killed for memory, say) the request gets UNAVAILABLE and the
    next one starts a new child. The child's errors come back as (code, message), since a
    ServiceError's fields do not survive pickling.
    """

    def __init__(self, model_dir: Path | str, threads: ThreadPoolExecutor):
        self.model_dir = str(model_dir)
        self._threads = threads
        self._pool: ProcessPoolExecutor | None = None
        self._turns = FairSlots(1)  # its one process's queue, in tenants' turns too

    async def run(self, fn, *args):
        async with self._turns.turn(current_tenant()):
            return await self._run(fn, *args)

    async def _run(self, fn, *args):
        if self._pool is None:
            # spawn: a fork would copy gRPC's and ZeroMQ's threads' state mid-flight
            self._pool = ProcessPoolExecutor(
                1, mp_context=multiprocessing.get_context("spawn"), initializer=_child_init, initargs=(self.model_dir,)
            )
        pool = self._pool
        try:
            # submit in a thread: the first one starts the child (4-15 ms of fork and exec, measured)
            submitted = await asyncio.get_running_loop().run_in_executor(self._threads, pool.submit, fn, *args)
            result = await asyncio.wrap_future(submitted)
        except BrokenProcessPool:
            if self._pool is pool:
                self._pool = None
                pool.shutdown(wait=False, cancel_futures=True)
            log.warning("the tokenizer process died; the next long prompt starts a new one")
            raise Unavailable("the tokenizer process for long prompts died; retry, or send shorter text") from None
        if isinstance(result, _ChildError):
            error = ServiceError(result.message)
            error.code = result.code
            raise error
        return result

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)
            self._pool = None


class _ChildError:
    def __init__(self, exc: ServiceError):
        self.code: grpc.StatusCode = exc.code
        self.message = exc.message


_child_tokenizer: PreTrainedTokenizerBase | None = None


def _child_init(model_dir: str) -> None:
    global _child_tokenizer
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # a terminal's Ctrl-C: the scheduler stops us (close)
    try:
        os.nice(CHILD_NICENESS)
    except OSError:
        pass
    _child_tokenizer = load_tokenizer(Path(model_dir))


def _child_prompt_ids(data: bytes, max_model_len: int) -> bytes | _ChildError:
    """In the child: the GenerateRequest's prompt ids, packed as uint32."""
    req = pb.GenerateRequest.FromString(data)
    try:
        ids = prompt_token_ids(req, _child_tokenizer, 2**32, max_model_len)  # vocab: only the token_ids prompt checks it
    except ServiceError as exc:
        return _ChildError(exc)
    return array.array("I", ids).tobytes()


def _child_tokenize(data: bytes, max_tokens: int) -> tuple[int, int, bytes] | _ChildError:
    """In the child: (the reply's size, its token count, the serialized reply or b"" when too large)."""
    try:
        reply = _tokenize(_child_tokenizer, pb.TokenizeRequest.FromString(data), max_tokens)
    except ServiceError as exc:
        return _ChildError(exc)
    size = reply.ByteSize()
    return size, len(reply.token_ids), reply.SerializeToString() if size <= MAX_REPLY_BYTES else b""
