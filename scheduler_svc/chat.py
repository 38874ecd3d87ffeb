"""A `pagoda.v1.Chat` as the model's chat template takes it: messages (with an assistant's tool
calls and a tool's answer), and the tools, in the shapes of transformers' `apply_chat_template`.

A template that uses tools (Qwen 2.5 / 3, Llama 3.x, Mistral, Hermes, ...) renders them itself.
One that does not (it never reads `tools`, as SmolLM2's) would drop them without a word, so the
tools are then described in the Hermes form, which is what the gateway parses back: a system
message's `<tools>` block (Qwen 2.5's wording), and an assistant's calls as `<tool_call>` blocks
of its content.
"""

from __future__ import annotations

import json

from scheduler_svc.errors import InvalidArgument

MAX_TOOLS = 128  # functions of one request (OpenAI's limit; = gateway_svc.schemas.MAX_TOOLS)

_HERMES_TOOLS = """# Tools

You may call one or more functions to assist with the user query.

You are provided with function signatures within <tools></tools> XML tags:
<tools>
{tools}
</tools>

For each function call, return a json object with function name and arguments within <tool_call></tool_call> XML tags:
<tool_call>
{{"name": <function-name>, "arguments": <args-json-object>}}
</tool_call>"""


def _json_object(text: str, field: str, empty: dict | None = None) -> dict:
    if not text and empty is not None:
        return empty
    try:
        value = json.loads(text)
    except ValueError as exc:
        raise InvalidArgument(field, f"not JSON text: {exc}") from None
    if not isinstance(value, dict):
        raise InvalidArgument(field, f"must be a JSON object, got {type(value).__name__}")
    return value


def template_input(chat, field: str) -> tuple[list[dict], list[dict] | None]:
    """(messages, tools) for `apply_chat_template`; bad input raises InvalidArgument naming it."""
    if not chat.messages:
        raise InvalidArgument(f"{field}.messages", "must not be empty")
    if len(chat.tools) > MAX_TOOLS:
        raise InvalidArgument(f"{field}.tools", f"at most {MAX_TOOLS} tools, got {len(chat.tools)}")
    messages = []
    for i, m in enumerate(chat.messages):
        if not m.role:
            raise InvalidArgument(f"{field}.messages[{i}].role", "must not be empty")
        message = {"role": m.role, "content": m.content}
        if m.parts:  # as transformers' processors give them to the template (media.check_parts: not with content)
            message["content"] = [{"type": "text", "text": part.text} if part.WhichOneof("kind") == "text" else {"type": "image"}
                                  for part in m.parts]
        if m.tool_calls:
            message["tool_calls"] = [
                {"id": c.id, "type": "function",
                 "function": {"name": c.name,
                              "arguments": _json_object(c.arguments, f"{field}.messages[{i}].tool_calls[{j}].arguments", {})}}
                for j, c in enumerate(m.tool_calls)
            ]
        if m.tool_call_id:
            message["tool_call_id"] = m.tool_call_id
        messages.append(message)
    tools = []
    for i, t in enumerate(chat.tools):
        if not t.name:
            raise InvalidArgument(f"{field}.tools[{i}].name", "must not be empty")
        function = {"name": t.name, **({"description": t.description} if t.description else {}),
                    "parameters": _json_object(t.parameters, f"{field}.tools[{i}].parameters",
                                               {"type": "object", "properties": {}})}
        tools.append({"type": "function", "function": function})
    return messages, tools or None


# apply_chat_template's own arguments: a chat's template kwargs may not set them
_RESERVED_KWARGS = frozenset({
    "conversation", "messages", "tools", "documents", "chat_template", "add_generation_prompt",
    "continue_final_message", "tokenize", "padding", "truncation", "max_length", "return_tensors",
    "return_dict", "return_assistant_tokens_mask", "tokenizer_kwargs", "processor_kwargs",
})


def message_chars(m) -> str:
    """The text of a message: its content, or its parts' texts."""
    return m.content or "".join(part.text for part in m.parts)


def template_kwargs(chat, field: str) -> dict:
    """`chat.chat_template_kwargs` as keyword arguments of the template; InvalidArgument naming it."""
    if not chat.chat_template_kwargs:
        return {}
    name = f"{field}.chat_template_kwargs"
    kwargs = _json_object(chat.chat_template_kwargs, name)
    for key in kwargs:
        if not key.isidentifier() or key in _RESERVED_KWARGS:
            raise InvalidArgument(name, f"{key!r} is not a template variable one may set")
    return kwargs


def uses_tools(tokenizer, tools) -> bool:
    """Whether the chat template that transformers picks for `tools` reads them."""
    try:
        template = tokenizer.get_chat_template(None, tools)
    except (ValueError, TypeError):
        return False
    return "tools" in template


def hermes(messages: list[dict], tools: list[dict] | None) -> list[dict]:
    """`messages` with the tools and every tool call written as text in the Hermes form."""
    out = []
    for m in messages:
        calls = [f"<tool_call>\n{json.dumps({'name': c['function']['name'], 'arguments': c['function']['arguments']}, ensure_ascii=False)}\n</tool_call>"
                 for c in m.get("tool_calls", ())]
        content = "\n".join([m["content"], *calls] if m["content"] else calls)
        out.append({"role": m["role"], "content": content})
    if not tools:
        return out
    text = _HERMES_TOOLS.format(tools="\n".join(json.dumps(t, ensure_ascii=False) for t in tools))
    if out and out[0]["role"] == "system":
        first = out[0]["content"]
        return [{"role": "system", "content": f"{first}\n\n{text}" if first else text}, *out[1:]]
    return [{"role": "system", "content": text}, *out]
