"""The scheduler's configuration: frozen, validated once at construction."""

from __future__ import annotations

from dataclasses import dataclass, field

from pagoda.step import KVCacheGroupSpec

FULL_ATTENTION = (KVCacheGroupSpec(layer_ids=()),)  # the one group of a model with only full attention

def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def fit_error(num_prompt_tokens: int, max_tokens: int | None, max_seq_len: int) -> tuple[str, str] | None:
    """The one fit check: (field, problem) if a request can never run within `max_seq_len` tokens.

    Validation calls it with `max_model_len`, the engine with the largest executor's
    capacity, a core scheduler with its own; None when it fits.
    """
    if num_prompt_tokens + 1 > max_seq_len:
        return "prompt", f"{num_prompt_tokens} tokens leave no room to generate within {max_seq_len} tokens"
    if max_tokens is not None and num_prompt_tokens + max_tokens > max_seq_len:
        return (
            "stopping.max_tokens",
            f"prompt ({num_prompt_tokens} tokens) + max_tokens ({max_tokens}) exceeds {max_seq_len} tokens",
        )
    return None


@dataclass(frozen=True)
class SpeculativeConfig:
    """Speculative decoding by prompt lookup (vLLM's `ngram` method and flag names).

    Each step, a decoding request gets up to `num_speculative_tokens` draft tokens: the
    tokens that followed the earliest earlier occurrence of its last n tokens, for the
    largest n in [prompt_lookup_min, prompt_lookup_max] that occurs.
    """

    num_speculative_tokens: int
    method: str = "ngram"
    prompt_lookup_min: int = 2
    prompt_lookup_max: int = 5

    def __post_init__(self) -> None:
        if self.method != "ngram":
            raise ValueError(f"speculative method {self.method!r}: only 'ngram' is supported")
        if not 1 <= self.num_speculative_tokens <= 32:
            raise ValueError(f"num_speculative_tokens must be in [1, 32], got {self.num_speculative_tokens}")
        if not 1 <= self.prompt_lookup_min <= self.prompt_lookup_max:
            raise ValueError(
                f"need 1 <= prompt_lookup_min <= prompt_lookup_max, got {self.prompt_lookup_min}, {self.prompt_lookup_max}"
            )


@dataclass(frozen=True)
class SchedulerConfig:
    """Limits of one executor's scheduler.

    `num_blocks` is the executor's KV cache size in blocks, null block 0 included, so
    `num_blocks - 1` blocks hold tokens. `kv_cache_groups` are the executor's groups of
    layers (one block table each, `pagoda.step.KVCacheGroupSpec`). A sequence never grows
    past `max_seq_len` tokens (prompt + output): the smaller of `max_model_len` and the
    longest sequence whose blocks (`max_blocks_per_request`) the cache holds.
    """

    num_blocks: int
    block_size: int = 16
    max_num_batched_tokens: int = 2048
    max_num_seqs: int = 256
    max_model_len: int = 8192
    enable_prefix_caching: bool = True
    speculative: SpeculativeConfig | None = None  # None: no drafts
    enable_kv_cache_events: bool = False  # record prefix-cache events (`Scheduler.take_kv_events`)
    kv_cache_groups: tuple[KVCacheGroupSpec, ...] = field(default=FULL_ATTENTION)
    max_loras: int = 0  # LoRA adapters in one step (the base model aside); 0: no limit
    # While two tenants or more have work here, a tenant holds at most this many running slots when
    # another waits (0: max_num_seqs // the tenants with work); see Scheduler's "Fair shares".
    max_running_per_tenant: int = 0
    # A prefill chunk never ends inside an image's placeholder span (Register.whole_image_chunks:
    # Gemma 3); it is cut before the image, or takes the whole span when it starts the step's budget.
    whole_image_chunks: bool = False
    # The image placeholder tokens whose images one step may encode (vLLM's
    # max_num_encoder_input_tokens; 0: max_num_batched_tokens). An image that does not fit waits
    # for a later step (the chunk stops before it); one larger than the whole budget is encoded
    # alone, in a step that encodes nothing else (vLLM raises its budget to the largest image).
    max_num_encoder_input_tokens: int = 0

    @property
    def encoder_budget(self) -> int:
        return self.max_num_encoder_input_tokens or self.max_num_batched_tokens

    def __post_init__(self) -> None:
        if not isinstance(self.max_running_per_tenant, int) or isinstance(self.max_running_per_tenant, bool) or self.max_running_per_tenant < 0:
            raise ValueError(f"SchedulerConfig.max_running_per_tenant must be an int >= 0, got {self.max_running_per_tenant!r}")
        value = self.max_num_encoder_input_tokens
        if not isinstance(value, int) or isinstance(value, bool) or value < 0:
            raise ValueError(f"SchedulerConfig.max_num_encoder_input_tokens must be an int >= 0, got {value!r}")
        if not isinstance(self.max_loras, int) or isinstance(self.max_loras, bool) or self.max_loras < 0:
            raise ValueError(f"SchedulerConfig.max_loras must be an int >= 0, got {self.max_loras!r}")
        minimums = {
            "num_blocks": 2,
            "block_size": 1,
            "max_num_batched_tokens": 1,
            "max_num_seqs": 1,
            "max_model_len": 2,
        }
        for name, minimum in minimums.items():
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < minimum:
                raise ValueError(f"SchedulerConfig.{name} must be an int >= {minimum}, got {value!r}")
        for name in ("enable_prefix_caching", "enable_kv_cache_events"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"SchedulerConfig.{name} must be a bool, got {getattr(self, name)!r}")
        groups = self.kv_cache_groups
        if not groups or not all(isinstance(g, KVCacheGroupSpec) for g in groups):
            raise ValueError(f"SchedulerConfig.kv_cache_groups must be KVCacheGroupSpecs, at least one, got {groups!r}")
        object.__setattr__(self, "kv_cache_groups", tuple(groups))
        object.__setattr__(self, "_max_seq_len", self._longest_sequence())

    @property
    def num_usable_blocks(self) -> int:
        return self.num_blocks - 1

    @property
    def max_seq_len(self) -> int:
        return self._max_seq_len  # type: ignore[attr-defined]

    def max_blocks_per_request(self, num_tokens: int) -> int:
        """The most blocks one sequence of `num_tokens` tokens holds at once, over every group.

        A full-attention group holds a block per `block_size` tokens. A sliding-window
        group (window W) frees the blocks before the window of the step's first query, so
        while a step computes c <= `max_num_batched_tokens` tokens it holds the blocks of
        W - 1 + c positions at most, which touch at most cdiv(W + c - 2, block_size) + 1
        blocks. (The `n` samples of one prompt also keep their leader's window of the last
        prompt token until they fork: a transient excess, met by preemption.)
        """
        num_blocks = cdiv(num_tokens, self.block_size)
        total = 0
        for group in self.kv_cache_groups:
            if group.sliding_window is None:
                total += num_blocks
            else:
                window_blocks = cdiv(group.sliding_window + self.max_num_batched_tokens - 2, self.block_size) + 1
                total += min(num_blocks, window_blocks)
        return total

    def _longest_sequence(self) -> int:
        """The largest length <= max_model_len whose `max_blocks_per_request` the cache holds."""
        if len(self.kv_cache_groups) == 1 and self.kv_cache_groups[0].sliding_window is None:
            return min(self.max_model_len, self.num_usable_blocks * self.block_size)
        low, high = 0, self.max_model_len  # fits(low); the answer is in [low, high]
        while low < high:
            mid = (low + high + 1) // 2
            if self.max_blocks_per_request(mid) <= self.num_usable_blocks:
                low = mid
            else:
                high = mid - 1
        return low
