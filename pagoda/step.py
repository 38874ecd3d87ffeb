"""The step protocol between the scheduler and an executor, as typed dataclasses.

One scheduler step produces a `StepPlan`; the executor runs it and answers with a
`StepResult`. `pagoda.wire` converts both to and from the protobuf messages of
`protos/pagoda/v1/executor.proto` (round-trip tested).

Per-request state on the executor side::

    token_ids            every token so far (prompt + generated); the executor appends
                         the tokens it samples itself, the scheduler never re-sends them
    num_computed_tokens  tokens whose KV is in the cache
    block_table          block ids, in order, one table per KV cache group (see below);
                         slot of position p = block_table[p // B] * B + p % B

KV cache groups (`KVCacheGroupSpec`, reported by the executor at registration): the
layers that share one attention type -- full attention, or one sliding window -- share
one block table, so every block id in a plan belongs to exactly one group. A model with
only full attention has one group, and its plans are those of a single table. For a
sliding-window group the scheduler frees the blocks wholly outside the window of every
future query while the request runs: their entries become the null block 0, which a
sliding-window layer never reads::

    window 8, block_size 4, 13 tokens computed: the next query (position 13)
    reads positions 6..13
    full attention   [ b1 | b2 | b3 | b4 ]
    sliding window   [ 0  | b6 | b7 | b8 ]      b5 (positions 0-3) was freed

A plan does not announce the blocks freed from a running request's table (its next new
request data would show them as 0): the executor's table keeps their old ids, which may
already hold another request's KV, and the block tables it builds for a step give the
null block for every block wholly before the window of the step's first query.

Each step the executor computes `token_ids[num_computed : num_computed + num_scheduled]`
for every scheduled request; a request whose computed count then reaches
`len(token_ids)` gets one sampled token, which the executor appends. A request absent
from `num_scheduled_tokens` keeps its state untouched. `finished_req_ids` (finished,
aborted or preempted) drop their state before the step runs; a preempted request comes
back later as a new request with every token so far.

Speculative decoding: a request at its end (everything but its last token computed) may
come with draft tokens in `scheduled_spec_decode_tokens`; its `num_scheduled_tokens`
counts them. The executor computes the last token and the k drafts, k + 1 positions,
and answers with 1..k+1 tokens for it, in order: the drafts the target model accepted
(a prefix of them) and one token of its own::

    token_ids  [ ... t ]   drafts [d0 d1 d2]    num_scheduled = 4
    verified   t -> d0 ok, d0 -> d1 ok, d1 -> d2 rejected: the model says x
    result     [d0, d1, x]    token_ids [ ... t d0 d1 x ]
    num_computed_tokens rolls back by the 1 rejected draft: len(token_ids) - 1

Both sides keep the blocks that covered the rejected drafts: the next step writes
those slots again.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

from pagoda.constraint import Constraint


GREEDY_BELOW_TEMPERATURE = 1e-5
# The longest error message a StepResult carries (`StepResult.error`, `RequestError.message`):
# the executor cuts longer ones, and the scheduler sizes its limit on a link message by it.
MAX_ERROR_MESSAGE_CHARS = 4096


@dataclass(frozen=True)
class SamplingParams:
    """What the executor needs to turn a request's logits into a token.

    Defaults are neutral: every option at its default leaves the logits unchanged.
    `stop_token_ids` holds every token id that would end the sequence (EOS ids unless
    `ignore_eos`, plus the request's own stop ids); the executor masks them while fewer
    than `min_tokens` tokens have been generated. `constraint` (structured output): the
    executor masks every token its grammar matcher rejects, before any other rule
    (`executor_svc.structured_output`).
    """

    temperature: float = 1.0  # 0 = greedy
    top_p: float = 1.0
    top_k: int = 0  # 0 = off
    min_p: float = 0.0
    seed: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: tuple[tuple[int, float], ...] = ()
    min_tokens: int = 0
    stop_token_ids: tuple[int, ...] = ()
    logprobs: bool = False
    top_logprobs: int = 0  # 0..20
    constraint: Constraint | None = None
    # `constraint` as the scheduler's check compiled it (xgrammar's serialize_json; b"": not sent):
    # the executor deserializes it instead of compiling (NewRequest.compiled_grammar on the wire)
    compiled_grammar: bytes = field(default=b"", compare=False, repr=False)

    @property
    def greedy(self) -> bool:
        """Temperature 0, or so close to it (vLLM's 1e-5) that logits / temperature would overflow."""
        return self.temperature < GREEDY_BELOW_TEMPERATURE


@dataclass(frozen=True)
class KVCacheGroupSpec:
    """Layers that share one block table: one attention type, the same number of layers in
    every group of a model (vLLM's KVCacheGroupSpec).

    `layer_ids` are the model's layer indices; the i-th layer of every group shares the
    executor's i-th K and V tensors, each block id being owned by one group at a time
    (so a block holds `len(layer_ids)` layers' K and V, whatever the group). A group may
    hold fewer layers than the others (padding). `sliding_window` None is full attention;
    W means the query at position p reads positions p - W + 1 .. p (transformers'
    `kv_idx > q_idx - sliding_window`).
    """

    layer_ids: tuple[int, ...]
    sliding_window: int | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "layer_ids", tuple(self.layer_ids))
        if self.sliding_window is not None and self.sliding_window < 1:
            raise ValueError(f"sliding_window must be >= 1 or None, got {self.sliding_window}")


def per_group(block_ids: tuple[list[int], ...] | list[int]) -> tuple[list[int], ...]:
    """Block ids as one list per KV cache group; a flat list is the one group of a full-attention model."""
    if isinstance(block_ids, tuple):
        return block_ids
    if block_ids and not isinstance(block_ids[0], int):
        return tuple(list(ids) for ids in block_ids)
    return (block_ids,)


IMAGE_TENSOR_DTYPES = ("float32", "bfloat16", "float16", "int64", "int32")


@dataclass(frozen=True)
class ImageTensor:
    """One tensor of an image processor's output: raw little-endian bytes in C order (no pickle)."""

    name: str  # the processor's key: "pixel_values", "image_sizes", ...
    dtype: str  # one of IMAGE_TENSOR_DTYPES
    shape: tuple[int, ...]
    data: bytes

    @classmethod
    def from_torch(cls, name: str, tensor) -> ImageTensor:
        import torch

        t = tensor.detach().to("cpu").contiguous()
        dtype = str(t.dtype).removeprefix("torch.")
        if dtype not in IMAGE_TENSOR_DTYPES:
            raise ValueError(f"{name}: dtype {dtype} (expected one of {IMAGE_TENSOR_DTYPES})")
        return cls(name, dtype, tuple(t.shape), t.reshape(-1).view(torch.uint8).numpy().tobytes())

    def to_torch(self):
        """The tensor (a copy); a dtype or a byte count that does not fit raises ValueError naming the tensor."""
        import math

        import torch

        if self.dtype not in IMAGE_TENSOR_DTYPES:
            raise ValueError(f"{self.name}: dtype {self.dtype!r} (expected one of {IMAGE_TENSOR_DTYPES})")
        dtype = getattr(torch, self.dtype)
        expected = math.prod(self.shape) * dtype.itemsize
        if len(self.data) != expected:
            raise ValueError(f"{self.name}: {len(self.data)} bytes, shape {list(self.shape)} of {self.dtype} needs {expected}")
        if not self.data:
            return torch.empty(self.shape, dtype=dtype)
        return torch.frombuffer(bytearray(self.data), dtype=torch.uint8).view(dtype).reshape(self.shape)


@dataclass(frozen=True)
class ImageInput:
    """An image of a request: its processor tensors, its content hash (hex), and the span of
    placeholder tokens (`token_ids[offset : offset + length]`) that its encoder output replaces."""

    hash: str
    offset: int
    length: int
    tensors: tuple[ImageTensor, ...]

    @property
    def end(self) -> int:
        return self.offset + self.length


@dataclass
class NewRequestData:
    """A request the executor has no state for: sent in full, once (also on resumption).

    `block_ids`: one list per KV cache group, in the order the executor registered them
    (a flat list is taken as the one group's).
    """

    req_id: str
    token_ids: list[int]
    num_prompt_tokens: int
    sampling: SamplingParams
    block_ids: tuple[list[int], ...]
    num_computed_tokens: int
    lora: str = ""  # the LoRA adapter the request runs with, by name; "" for the base model
    images: tuple[ImageInput, ...] = ()  # in prompt order (a vision-language model's)
    tenant: str = ""  # who sent it (the API key's tenant; "" when keys are off): grammar loads take turns

    def __post_init__(self) -> None:
        self.block_ids = per_group(self.block_ids)


@dataclass
class CachedRequestData:
    """A request the executor already holds: only the blocks added since the last step,
    one list per KV cache group (every group's table grows by the same number of entries).
    Built every step for every running request, so not normalised: `per_group` reads a flat
    list as the one group's."""

    req_id: str
    new_block_ids: tuple[list[int], ...]


@dataclass
class BlockCopy:
    """Copy-on-write: copy every layer's K and V of block `src` into block `dst` (both of one
    KV cache group: block ids are unique across groups, so no group is named)."""

    src: int
    dst: int


class PoolTask(enum.IntEnum):
    """What a pooling request asks of the model; the values are `pagoda.v1.PoolTask`'s."""

    EMBED = 1  # the pooled vector (sentence-transformers' `encode`)
    CLASSIFY = 2  # a cross-encoder's scores, one a label (sentence-transformers' `CrossEncoder.predict`)


@dataclass
class PoolRequest:
    """A pooling runner's request (--runner pooling): the whole input, run in one step and
    forgotten after it. It holds no KV blocks and is never chunked (encoders attend both ways).

    `token_type_ids`: the encoders' segment ids (a pair's second text 1); empty = all 0.
    Embed: `dimensions` 0 is the full vector, else its first `dimensions` values (Matryoshka),
    L2-normalized after the cut when `normalize`.
    """

    req_id: str
    token_ids: list[int]
    task: PoolTask = PoolTask.EMBED
    token_type_ids: list[int] = field(default_factory=list)
    normalize: bool = False
    dimensions: int = 0

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)


@dataclass
class PooledOutput:
    """A pooling request's answer: embed, the vector; classify, one score a label (activation applied)."""

    req_id: str
    values: list[float]


@dataclass
class StepPlan:
    step_id: int
    new_requests: list[NewRequestData] = field(default_factory=list)
    cached_requests: list[CachedRequestData] = field(default_factory=list)
    num_scheduled_tokens: dict[str, int] = field(default_factory=dict)
    finished_req_ids: list[str] = field(default_factory=list)
    block_copies: list[BlockCopy] = field(default_factory=list)
    scheduled_spec_decode_tokens: dict[str, list[int]] = field(default_factory=dict)
    pool_requests: list[PoolRequest] = field(default_factory=list)  # a pooling executor's plans hold only these

    @property
    def total_num_scheduled_tokens(self) -> int:
        return sum(self.num_scheduled_tokens.values())


@dataclass
class SampledToken:
    req_id: str
    token_id: int
    logprob: float = 0.0  # set when sampling.logprobs
    top_logprobs: list[tuple[int, float]] = field(default_factory=list)  # sampling.top_logprobs best


@dataclass
class RequestError:
    """A failure the executor pins on one request (non-finite logits in its row, a sampler error).

    That request gets no token this step; the rest of the batch goes on. The scheduler ends it,
    except for two messages of structured output (`GRAMMAR_PENDING`, `GRAMMAR_FAILED`).
    """

    req_id: str
    message: str


@dataclass
class StepResult:
    """One token per request that reached its end; 1..k+1 in order for a request with k drafts."""

    step_id: int
    sampled: list[SampledToken] = field(default_factory=list)
    errors: list[RequestError] = field(default_factory=list)
    pooled: list[PooledOutput] = field(default_factory=list)  # one per pool request that did not fail


# A constrained request's first sample came before its grammar compiled on the executor (off the
# step's path): it got no token, the step ran the others. The scheduler takes it out of the
# executor (as a preemption: nothing is lost) and binds it again a little later.
GRAMMAR_PENDING = "grammar pending: "
# Its grammar failed to compile on the executor (over the executor's time or memory bound):
# "grammar failed: <constraint field>: <why>". The scheduler ends it with INVALID_ARGUMENT naming
# that field.
GRAMMAR_FAILED = "grammar failed: "
