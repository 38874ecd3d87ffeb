"""OpenAI request bodies as pydantic models, bounded so that every malformed input is a 400 naming
its field before any gRPC call (nothing reaches the scheduler that its protobuf cannot hold).

- An unknown field is refused (400 `Unrecognized request argument supplied: <name>`, as OpenAI
  answers). OpenAI fields this server parses but does not implement yet are listed once, in
  `NOT_SUPPORTED_YET`: set to anything but null / empty they are a 400 naming the field.
- Lists are bounded (`messages`, a completion's prompts, `stop`, `logit_bias`), every integer
  is in its protobuf type's range, floats are finite, and strings are valid Unicode (a lone
  surrogate such as "\\ud800" is refused).
- The limits that the scheduler also checks are its own (`scheduler_svc/validation.py`;
  tests/gateway/test_gateway_limits.py keeps them equal).

Beside OpenAI's fields, vLLM's common extras are accepted: `top_k`, `min_p`,
`repetition_penalty`, `min_tokens`, `ignore_eos`, and its `structured_outputs` (`json`, `regex`,
`choice`, `grammar`; also as the older `guided_json`, ...) beside OpenAI's `response_format`;
chat takes `tools` (at most `MAX_TOOLS` functions), `tool_choice` and `parallel_tool_calls`
(`gateway_svc/tools.py`), and vLLM's `chat_template_kwargs` and `include_reasoning`.
"""

from __future__ import annotations

from typing import Annotated, Any, ClassVar, Literal

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, PrivateAttr, model_validator

UINT32_MAX = (1 << 32) - 1
INT32_MAX = (1 << 31) - 1
MAX_N = 16  # = scheduler_svc.validation.MAX_N
MAX_TOP_LOGPROBS = 20  # = scheduler_svc.validation.MAX_TOP_LOGPROBS
MAX_STOP_STRINGS = 16  # = scheduler_svc.validation.MAX_STOP_STRINGS
MAX_LOGIT_BIAS_ENTRIES = 1024  # = scheduler_svc.validation.MAX_LOGIT_BIAS_ENTRIES
MAX_ABS_LOGIT_BIAS = 100.0  # = scheduler_svc.validation.MAX_ABS_LOGIT_BIAS
MAX_MESSAGES = 2048
# Prompts of one /v1/completions body: each is its own gRPC stream (times n samples inside it).
MAX_PROMPTS = 64

MAX_TOOLS = 128  # functions of one request (OpenAI's limit)
MAX_CHOICES = 1024  # structured_outputs.choice

# OpenAI fields accepted but not implemented: a request that sets one (to anything but null,
# empty or "none") gets 400 naming it. The legacy `functions` are `tools` now.
NOT_SUPPORTED_YET = ("functions", "function_call")
_UNSET = (None, [], {}, "none")


def _unicode(text: str) -> str:
    """Only text that UTF-8 can encode (protobuf strings must): no lone surrogates."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise ValueError(f"not valid Unicode text ({exc.reason} at character {exc.start})") from None
    return text


def _token_id_key(key: str) -> str:
    if not (key.isascii() and key.isdigit() and int(key) <= UINT32_MAX):
        raise ValueError(f"keys must be token ids (integers in [0, {UINT32_MAX}]), got {key[:32]!r}")
    return key


Text = Annotated[str, AfterValidator(_unicode)]
Float = Annotated[float, Field(allow_inf_nan=False)]
TokenId = Annotated[int, Field(ge=0, le=UINT32_MAX)]
Count = Annotated[int, Field(ge=0, le=UINT32_MAX)]
Bias = Annotated[float, Field(ge=-MAX_ABS_LOGIT_BIAS, le=MAX_ABS_LOGIT_BIAS, allow_inf_nan=False)]
BiasKey = Annotated[str, AfterValidator(_token_id_key)]


class _Strict(BaseModel):
    """Unknown fields are refused; those in `_not_yet` are set aside, and `unsupported()` names
    the first one set."""

    model_config = ConfigDict(extra="forbid")
    _not_yet: ClassVar[tuple[str, ...]] = ()
    _set_aside: dict[str, Any] = PrivateAttr(default_factory=dict)

    @model_validator(mode="wrap")
    @classmethod
    def _set_aside_not_yet(cls, data, handler):
        held = {}
        if isinstance(data, dict) and cls._not_yet:
            held = {k: data[k] for k in cls._not_yet if k in data}
            data = {k: v for k, v in data.items() if k not in held}
        model = handler(data)
        model._set_aside = held
        return model

    def unsupported(self) -> str | None:
        return next((k for k, v in self._set_aside.items() if v not in _UNSET), None)


class StreamOptions(_Strict):
    include_usage: bool = False


class JsonSchemaFormat(_Strict):
    name: Text = Field("response", max_length=64)
    description: Text | None = None
    schema_: dict[str, Any] | None = Field(None, alias="schema")
    strict: bool | None = None


class ResponseFormat(_Strict):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None

    @model_validator(mode="after")
    def _schema_with_its_type(self):
        if (self.type == "json_schema") != (self.json_schema is not None):
            raise ValueError('json_schema is given with type "json_schema", and only then')
        return self


class StructuredOutputs(_Strict):
    """vLLM's `structured_outputs`: at most one of its fields."""

    json_: dict[str, Any] | Text | None = Field(None, alias="json")
    regex: Text | None = None
    choice: Annotated[list[Text], Field(min_length=1, max_length=MAX_CHOICES)] | None = None
    grammar: Text | None = None


class _Sampling(_Strict):
    _not_yet = NOT_SUPPORTED_YET

    model: Text | None = None
    temperature: float | None = Field(None, ge=0, le=2, allow_inf_nan=False)
    top_p: float | None = Field(None, gt=0, le=1, allow_inf_nan=False)
    n: int = Field(1, ge=1, le=MAX_N)
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: Text | Annotated[list[Text], Field(max_length=MAX_STOP_STRINGS)] | None = None
    seed: int | None = Field(None, ge=-(1 << 63), le=(1 << 64) - 1)  # int64 or uint64
    presence_penalty: float | None = Field(None, ge=-2, le=2, allow_inf_nan=False)
    frequency_penalty: float | None = Field(None, ge=-2, le=2, allow_inf_nan=False)
    logit_bias: dict[BiasKey, Bias] | None = Field(None, max_length=MAX_LOGIT_BIAS_ENTRIES)
    user: Text | None = None
    top_k: int | None = Field(None, ge=-1, le=INT32_MAX)
    min_p: Float | None = None
    repetition_penalty: Float | None = None
    min_tokens: Count | None = None
    ignore_eos: bool = False
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputs | None = None
    # vLLM's older names of structured_outputs' fields
    guided_json: dict[str, Any] | Text | None = None
    guided_regex: Text | None = None
    guided_choice: Annotated[list[Text], Field(min_length=1, max_length=MAX_CHOICES)] | None = None
    guided_grammar: Text | None = None

    @property
    def include_usage(self) -> bool:
        return bool(self.stream and self.stream_options and self.stream_options.include_usage)


class CompletionRequest(_Sampling):
    prompt: (Text | list[TokenId] | Annotated[list[Text], Field(max_length=MAX_PROMPTS)]
             | Annotated[list[list[TokenId]], Field(max_length=MAX_PROMPTS)])
    max_tokens: int | None = Field(16, ge=1, le=UINT32_MAX)  # OpenAI's default for completions
    logprobs: int | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS)
    echo: bool = False
    suffix: Text | None = None
    best_of: int | None = Field(None, ge=1, le=MAX_N)


class ContentPart(BaseModel):
    """A part of a message's content: `text`, or `image_url` (others are a 400 naming the part, see
    `translate.chat_messages`)."""

    model_config = ConfigDict(extra="allow")

    type: Text
    text: Text | None = None


class Function(_Strict):
    name: str = Field(pattern=r"^[a-zA-Z0-9_-]{1,64}$")  # OpenAI's rule for function names
    description: Text | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class Tool(_Strict):
    type: Literal["function"]
    function: Function


class FunctionCall(_Strict):
    name: Text
    arguments: Text  # JSON text, as the model wrote it


class ToolCall(_Strict):
    id: Text
    type: Literal["function"] = "function"
    function: FunctionCall


class FunctionName(_Strict):
    name: Text


class NamedToolChoice(_Strict):
    type: Literal["function"]
    function: FunctionName


class ChatMessage(_Strict):
    role: Text
    content: Text | Annotated[list[ContentPart], Field(max_length=MAX_MESSAGES)] | None = None
    name: Text | None = None  # accepted; chat templates do not use it
    tool_calls: Annotated[list[ToolCall], Field(max_length=MAX_TOOLS)] | None = None  # an assistant's
    tool_call_id: Text | None = None  # a "tool" message's answer to that call


class ChatCompletionRequest(_Sampling):
    messages: list[ChatMessage] = Field(min_length=1, max_length=MAX_MESSAGES)
    max_tokens: int | None = Field(None, ge=1, le=UINT32_MAX)
    max_completion_tokens: int | None = Field(None, ge=1, le=UINT32_MAX)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS)
    tools: Annotated[list[Tool], Field(max_length=MAX_TOOLS)] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool = True
    # vLLM's: variables for the chat template (e.g. {"enable_thinking": false}), and whether the
    # answer carries the reasoning (`reasoning_content`, `reasoning`)
    chat_template_kwargs: dict[str, Any] | None = None
    include_reasoning: bool = True


class LoadLoraAdapterRequest(_Strict):
    """vLLM's body of POST /v1/load_lora_adapter."""

    lora_name: Text = Field(min_length=1)
    lora_path: Text = Field(min_length=1)  # a PEFT folder on the scheduler's host, or ORG/NAME on the hub


class UnloadLoraAdapterRequest(_Strict):
    """vLLM's body of POST /v1/unload_lora_adapter."""

    lora_name: Text = Field(min_length=1)
