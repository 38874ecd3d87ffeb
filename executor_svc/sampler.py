"""Turn the logits of the sampled rows into tokens, one `SamplingParams` per row.

Order (vLLM's, with transformers' warper order for the filters)::

    raw logits ──▶ grammar mask (structured output: tokens the request's matcher rejects -> -inf)
        │
        ├──▶ logprobs (log_softmax of the masked logits, when asked)
        │
        ├─ logit_bias, min_tokens (stop_token_ids masked while too few tokens are generated)
        ├─ repetition penalty   over prompt + output tokens (transformers semantics)
        ├─ presence / frequency penalties over output tokens (OpenAI / vLLM semantics)
        ├─ temperature 0 ──▶ argmax
        └─ temperature > 0 ──▶ / temperature ─▶ top_k ─▶ top_p ─▶ min_p ─▶ softmax ─▶ draw

The draw is argmax(probs / E) with E ~ Exp(1) per vocabulary entry (the Gumbel-max
trick in exponential form, as vLLM). A seeded request's E comes from its own
`torch.Generator` seeded from (seed, position of the token being sampled), so its token
depends on nothing else in the batch and is the same after resumption on another
executor; unseeded rows share one batched draw from the global generator.

Every stage is skipped when no row uses it; the rows that do are handled in one
vectorized pass, except the seeded draws (one small generator per seeded row).

The grammar mask (`token_bitmask`, from `executor_svc.structured_output`) is applied to
the logits in place. `min_tokens` never masks the stop tokens of a row whose grammar
allows nothing else (its grammar is complete): the grammar's end wins.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from executor_svc.fused_ops import rows_argmax
from executor_svc.structured_output import apply_token_bitmask
from pagoda.step import SamplingParams

_MASK64 = (1 << 64) - 1


@dataclass
class SamplerOutput:
    token_ids: list[int]
    logprobs: list[float | None]  # per row; None where the request did not ask
    top_logprobs: list[list[tuple[int, float]]] = field(default_factory=list)


@dataclass
class SamplingRow:
    """What the sampler needs about one request beside its logits."""

    params: SamplingParams
    token_ids: list[int]  # prompt + output so far; the sampled token goes at len(token_ids)
    num_prompt_tokens: int


def position_seed(seed: int, position: int) -> int:
    """A 64-bit generator seed from (seed, position): splitmix64 of their combination."""
    x = (seed * 0x9E3779B97F4A7C15 + position + 1) & _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return x ^ (x >> 31)


class Sampler:
    def __call__(self, logits: torch.Tensor, rows: list[SamplingRow], token_bitmask: torch.Tensor | None = None) -> SamplerOutput:
        """logits [len(rows), vocab] float32 -> one token per row; `token_bitmask` masks `logits` in place first."""
        if token_bitmask is not None:
            apply_token_bitmask(logits, token_bitmask)
        params = [r.params for r in rows]
        logprob_rows = [i for i, p in enumerate(params) if p.logprobs or p.top_logprobs]
        raw_logprobs = torch.log_softmax(logits[logprob_rows], dim=-1) if logprob_rows else None

        logits = self._process(logits, rows)
        greedy = [p.greedy for p in params]
        if all(greedy):
            token_ids = rows_argmax(logits)  # a few CPU rows of finite values: one C pass each
            if token_ids is None:
                token_ids = logits.argmax(dim=-1)
        else:
            token_ids = self._draw(logits, rows, greedy)
        return self._output(token_ids, params, logprob_rows, raw_logprobs)

    # -- logits processors -------------------------------------------------------------

    def _process(self, logits: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
        params = [r.params for r in rows]
        bias = [(i, t, b) for i, p in enumerate(params) for t, b in p.logit_bias]
        min_tok = [
            (i, t)
            for i, r in enumerate(rows)
            if r.params.min_tokens and len(r.token_ids) - r.num_prompt_tokens < r.params.min_tokens
            for t in r.params.stop_token_ids
        ]
        rep = [i for i, p in enumerate(params) if p.repetition_penalty != 1.0]
        pres_freq = [i for i, p in enumerate(params) if p.presence_penalty or p.frequency_penalty]
        if not (bias or min_tok or rep or pres_freq):
            return logits
        logits = logits.clone()
        device, vocab = logits.device, logits.shape[1]
        if bias:
            r, t, b = zip(*bias)
            logits.index_put_(
                (_ints(r, device), _ints(t, device)),
                torch.tensor(b, dtype=logits.dtype, device=device),
                accumulate=True,
            )
        if min_tok:
            r, t = zip(*min_tok)
            constrained = sorted({i for i in r if params[i].constraint is not None})
            before = logits[constrained] if constrained else None
            logits[_ints(r, device), _ints(t, device)] = -float("inf")
            if constrained:  # the grammar's end wins over min_tokens (see the module docstring)
                ended = torch.isinf(logits[constrained]).all(dim=-1)
                if ended.any():
                    keep = _ints(constrained, device)[ended]
                    logits[keep] = before[ended]
        if rep:
            seen = _token_counts([rows[i].token_ids for i in rep], vocab, device) > 0
            penalty = torch.tensor([params[i].repetition_penalty for i in rep], device=device)[:, None]
            sub = logits[rep]
            penalised = torch.where(sub < 0, sub * penalty, sub / penalty)
            logits[rep] = torch.where(seen, penalised, sub)
        if pres_freq:
            counts = _token_counts([rows[i].token_ids[rows[i].num_prompt_tokens :] for i in pres_freq], vocab, device)
            freq = torch.tensor([params[i].frequency_penalty for i in pres_freq], device=device)[:, None]
            pres = torch.tensor([params[i].presence_penalty for i in pres_freq], device=device)[:, None]
            logits[pres_freq] -= freq * counts + pres * (counts > 0)
        return logits

    # -- drawing -----------------------------------------------------------------------

    def _draw(self, logits: torch.Tensor, rows: list[SamplingRow], greedy: list[bool]) -> torch.Tensor:
        device = logits.device
        token_ids = logits.argmax(dim=-1)
        sampled = [i for i, g in enumerate(greedy) if not g]
        params = [rows[i].params for i in sampled]
        probs = target_probs(logits[sampled], params)
        noise = torch.empty_like(probs)
        seeded = [j for j, p in enumerate(params) if p.seed is not None]
        if len(seeded) < len(params):
            noise.exponential_()
        for j in seeded:
            noise[j].exponential_(generator=row_generator(rows[sampled[j]], device))
        token_ids[sampled] = (probs / noise.clamp_min_(1e-20)).argmax(dim=-1)
        return token_ids

    def process(self, logits: torch.Tensor, rows: list[SamplingRow], token_bitmask: torch.Tensor | None = None) -> torch.Tensor:
        """The logits after the grammar mask (applied to `logits` in place), bias, min_tokens and
        penalties: the input of argmax or `target_probs`."""
        if token_bitmask is not None:
            apply_token_bitmask(logits, token_bitmask)
        return self._process(logits, rows)

    def output(self, logits: torch.Tensor, token_ids: torch.Tensor, rows: list[SamplingRow]) -> SamplerOutput:
        """Chosen `token_ids` of the rows of `logits` (raw, or grammar-masked), with the logprobs the rows ask for."""
        params = [r.params for r in rows]
        logprob_rows = [i for i, p in enumerate(params) if p.logprobs or p.top_logprobs]
        raw_logprobs = torch.log_softmax(logits[logprob_rows], dim=-1) if logprob_rows else None
        return self._output(token_ids, params, logprob_rows, raw_logprobs)

    @staticmethod
    def _output(
        token_ids: torch.Tensor,
        params: list[SamplingParams],
        logprob_rows: list[int],
        raw_logprobs: torch.Tensor | None,
    ) -> SamplerOutput:
        ids = token_ids.tolist()
        logprobs: list[float | None] = [None] * len(ids)
        top: list[list[tuple[int, float]]] = [[] for _ in ids]
        if raw_logprobs is not None:
            chosen = raw_logprobs.gather(1, token_ids[logprob_rows].unsqueeze(1)).squeeze(1).tolist()
            # never more than the vocabulary (a beam asks for beam_width + its stop tokens)
            k = min(max(params[i].top_logprobs for i in logprob_rows), raw_logprobs.shape[-1])
            top_values, top_ids = raw_logprobs.topk(k, dim=-1) if k else (None, None)
            top_values = top_values.tolist() if k else None
            top_ids = top_ids.tolist() if k else None
            for j, i in enumerate(logprob_rows):
                logprobs[i] = chosen[j]
                n = params[i].top_logprobs
                if n:
                    top[i] = list(zip(top_ids[j][:n], top_values[j][:n]))
        return SamplerOutput(token_ids=ids, logprobs=logprobs, top_logprobs=top)


def target_probs(logits: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    """The distribution a sampled row draws from: processed logits / temperature, filtered, softmax."""
    temperature = torch.tensor([p.temperature for p in params], device=logits.device)[:, None]
    return torch.softmax(
        filter_logits(
            logits / temperature,
            top_k=[p.top_k for p in params],
            top_p=[p.top_p for p in params],
            min_p=[p.min_p for p in params],
        ),
        dim=-1,
    )


def row_generator(row: SamplingRow, device: torch.device) -> torch.Generator | None:
    """A seeded row's own generator for the token at `len(row.token_ids)`; None when unseeded."""
    if row.params.seed is None:
        return None
    generator = torch.Generator(device=device)
    generator.manual_seed(position_seed(row.params.seed, len(row.token_ids)))
    return generator


def filter_logits(logits: torch.Tensor, top_k: list[int], top_p: list[float], min_p: list[float]) -> torch.Tensor:
    """top_k, then top_p, then min_p (transformers' warper semantics, per row); removed -> -inf.

    Ties at the k-th value are kept (as TopKLogitsWarper); top_p removes the low tail whose
    cumulative probability is <= 1 - top_p and keeps at least one token (as TopPLogitsWarper);
    min_p removes tokens whose probability is below min_p x the top probability.
    """
    device, vocab = logits.device, logits.shape[1]
    use_k = any(0 < k < vocab for k in top_k)
    use_p = any(p < 1.0 for p in top_p)
    if use_k or use_p:
        sorted_logits, sorted_ids = logits.sort(dim=-1)  # ascending
        remove = torch.zeros_like(sorted_logits, dtype=torch.bool)
        if use_k:
            k = torch.tensor([k if 0 < k < vocab else vocab for k in top_k], device=device)
            kth = sorted_logits.gather(1, (vocab - k)[:, None])
            remove |= sorted_logits < kth
        if use_p:
            p = torch.tensor(top_p, device=device, dtype=logits.dtype)[:, None]
            cumulative = sorted_logits.masked_fill(remove, -float("inf")).softmax(dim=-1).cumsum(dim=-1)
            tail = cumulative <= 1 - p
            tail[:, -1] = False
            remove |= tail
        logits = logits.masked_fill(remove.scatter(1, sorted_ids, remove), -float("inf"))
    if any(m > 0.0 for m in min_p):
        probs = logits.softmax(dim=-1)
        threshold = torch.tensor(min_p, device=device, dtype=probs.dtype)[:, None] * probs.amax(dim=-1, keepdim=True)
        logits = logits.masked_fill(probs < threshold, -float("inf"))
    return logits


def _ints(values, device: torch.device) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.int64, device=device)


def _token_counts(token_lists: list[list[int]], vocab: int, device: torch.device) -> torch.Tensor:
    """[len(token_lists), vocab] float counts of each token id (ids outside the vocabulary ignored)."""
    width = max((len(t) for t in token_lists), default=0)
    padded = torch.full((len(token_lists), width), vocab, dtype=torch.int64)
    for i, tokens in enumerate(token_lists):
        padded[i, : len(tokens)] = torch.tensor(tokens, dtype=torch.int64)
    padded = padded.clamp_(max=vocab).to(device)
    counts = torch.zeros(len(token_lists), vocab + 1, device=device)
    counts.scatter_add_(1, padded, torch.ones_like(padded, dtype=counts.dtype))
    return counts[:, :vocab]
