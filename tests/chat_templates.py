"""Each tool-call format's family chat template (tests/data/chat_templates/), and a chat rendered
with one as the scheduler renders it: OpenAI's messages through the gateway's and the client's
translation (`gateway_svc.translate.chat_messages`, `pagoda.client` -> `pagoda.v1.Chat`), then
`scheduler_svc.validation.chat_token_ids` (template_input, apply_chat_template: a template's
error is INVALID_ARGUMENT naming `prompt.chat.messages`).

The templates are written for these tests in each family's format (the file's first comment says
which); their tool-call markers are the real templates', so the scheduler's choice of parser
from them (`choose_tool_parser_from_template`) is tested on them too.
"""

from __future__ import annotations

from pathlib import Path

from gateway_svc.schemas import ChatCompletionRequest
from gateway_svc.translate import chat_messages as gateway_messages
from pagoda.client.types import chat_messages, chat_tools
from pagoda.v1 import generation_pb2 as pb
from scheduler_svc.validation import chat_token_ids

TEMPLATE_DIR = Path(__file__).parent / "data" / "chat_templates"
# tool-call parser -> (template file, the marker that ends an assistant's turn in it)
FAMILY_TEMPLATES = {
    "hermes": ("qwen2.5_hermes.jinja", "<|im_end|>"),
    "llama3_json": ("llama3.1_json.jinja", "<|eot_id|>"),
    "mistral": ("mistral_tool_calls.jinja", None),  # the tokenizer's eos_token
    "qwen3_coder": ("qwen3_coder.jinja", "<|im_end|>"),
    "pythonic": ("llama3.2_pythonic.jinja", "<|eot_id|>"),
}


def family_template(parser: str) -> str:
    return (TEMPLATE_DIR / FAMILY_TEMPLATES[parser][0]).read_text()


def end_of_turn(parser: str, tokenizer) -> str:
    return FAMILY_TEMPLATES[parser][1] or tokenizer.eos_token


def with_template(tokenizer, template: str):
    """A copy of `tokenizer` whose chat template is `template` (the scheduler's model, another family)."""
    import copy

    out = copy.copy(tokenizer)
    out.chat_template = template
    return out


def render(tokenizer, messages: list[dict], tools: list[dict] | None = None, add_generation_prompt: bool = True,
           **kwargs) -> list[int]:
    """The token ids the scheduler makes of an OpenAI chat request's messages and tools."""
    req = ChatCompletionRequest(model="m", messages=messages, tools=tools)
    chat = pb.Chat(messages=chat_messages(gateway_messages(req)), tools=chat_tools(tools or ()))
    if kwargs:
        import json

        chat.chat_template_kwargs = json.dumps(kwargs)
    return chat_token_ids(chat, tokenizer, "prompt.chat", add_generation_prompt)
