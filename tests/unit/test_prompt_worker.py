"""PromptWorker: the child process that tokenizes huge texts gives what the threads give."""

import asyncio

import grpc
import pytest

from pagoda import model_files
from pagoda.v1 import generation_pb2 as pb
from scheduler_svc.errors import ServiceError
from scheduler_svc.prompts import PromptWorker
from scheduler_svc.tokenizer import encode, load_tokenizer, read_model_spec

TEXTS = ["hello world", " ", "<|im_start|>user\nhi<|im_end|>", "<|endoftext|>x", "\x16", "café 🎉 日本語 " * 40, "a\n\n\tb  c"]
CHAT = pb.Chat(messages=[pb.ChatMessage(role="system", content="be brief"), pb.ChatMessage(role="user", content="hi <|im_end|> 🎉")])


@pytest.fixture(scope="module")
def model():
    model_dir = model_files.resolve_model(None)
    tokenizer = load_tokenizer(model_dir)
    return model_dir, tokenizer, read_model_spec(model_dir, tokenizer)


@pytest.mark.parametrize("add_special_tokens", [True, False])
def test_encode_gives_transformers_ids(model, add_special_tokens):
    tokenizer = model[1]
    for text in TEXTS:
        assert encode(tokenizer, text, add_special_tokens) == tokenizer.encode(text, add_special_tokens=add_special_tokens)


@pytest.mark.slow  # starts a child process that loads the tokenizer, ~55 s on 2 shared cores
def test_the_child_process_answers_as_the_threads_do(model):
    model_dir, tokenizer, spec = model

    async def both():
        threads = PromptWorker(tokenizer, spec, 4096)
        child = PromptWorker(tokenizer, spec, 4096, model_dir=model_dir, offload_chars=0)  # every text to the child
        try:
            requests = [pb.TokenizeRequest(text=t) for t in TEXTS] + [
                pb.TokenizeRequest(chat=CHAT), pb.TokenizeRequest(chat=CHAT, add_generation_prompt=False)]
            for req in requests:
                assert await child.tokenize(req) == await threads.tokenize(req), req
            for req in (pb.GenerateRequest(text="hello " * 300), pb.GenerateRequest(chat=CHAT)):
                assert (await child.generate_params(req)).prompt_token_ids == (await threads.generate_params(req)).prompt_token_ids
            errors = []
            for worker in (threads, child):
                for call in (worker.tokenize(pb.TokenizeRequest(chat=pb.Chat(messages=[pb.ChatMessage(content="x")]))),
                             worker.generate_params(pb.GenerateRequest(text="hello " * 5000))):
                    with pytest.raises(ServiceError) as caught:
                        await call
                    errors.append((caught.value.code, caught.value.message))
            assert errors[:2] == errors[2:]
            assert errors[0] == (grpc.StatusCode.INVALID_ARGUMENT, "chat.messages[0].role: must not be empty")
            assert errors[1][0] == grpc.StatusCode.INVALID_ARGUMENT and errors[1][1].startswith("prompt")
        finally:
            threads.close()
            child.close()

    asyncio.run(both())
