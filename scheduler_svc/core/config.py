"""The scheduler's configuration: frozen, validated once at construction."""

from __future__ import annotations

from dataclasses import dataclass


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
    `num_blocks - 1` blocks hold tokens. A sequence never grows past `max_seq_len`
    tokens (prompt + output): the smaller of `max_model_len` and what the cache holds.
    """

    num_blocks: int
    block_size: int = 16
    max_num_batched_tokens: int = 2048
    max_num_seqs: int = 256
    max_model_len: int = 8192
    enable_prefix_caching: bool = True
    speculative: SpeculativeConfig | None = None  # None: no drafts
    enable_kv_cache_events: bool = False  # record prefix-cache events (`Scheduler.take_kv_events`)

    def __post_init__(self) -> None:
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

    @property
    def num_usable_blocks(self) -> int:
        return self.num_blocks - 1

    @property
    def max_seq_len(self) -> int:
        return min(self.max_model_len, self.num_usable_blocks * self.block_size)
