"""Verify draft tokens: keep the longest prefix the target model agrees with, plus one token of its own.

A request with k drafts has k + 1 logits rows: row j is the target's distribution p_j
for the token after the last token and drafts d_0..d_{j-1}::

    rows     p_0      p_1      ...  p_k
    drafts   d_0      d_1      ...  (none: the bonus row)

Greedy rows accept while d_j = argmax p_j and emit the argmax at the first mismatch (or
at row k), so the output is the one plain greedy decoding gives. Sampled rows use
rejection sampling (Leviathan et al. 2023; vLLM's rejection sampler): a draft from a
proposal q is accepted with probability min(1, p_j(d_j) / q(d_j)); on the first
rejection the token is drawn from the residual max(0, p_j - q), normalized. Prompt
lookup proposes one token with certainty (q one-hot), so the test is u < p_j(d_j) and
the residual is p_j with d_j removed. Each emitted token is then distributed exactly as
the target's: P(t) = p(d) [t = d] + (1 - p(d)) p(t) [t != d] / (1 - p(d)) = p(t).

A seeded request draws the uniform and the residual's noise of row j from its own
generator seeded by (seed, position of row j), as the sampler does, so its output does
not depend on the batch it ran in.
"""

from __future__ import annotations

import torch

from executor_svc.sampler import Sampler, SamplingRow, row_generator, target_probs


def rejection_sample(probs: torch.Tensor, draft_token_ids: list[int], generators: list[torch.Generator | None]) -> list[int]:
    """The accepted drafts and one more token; `probs` [k + 1, vocab] target rows, one generator per row."""
    num_drafts = len(draft_token_ids)
    for j, draft in enumerate(draft_token_ids):
        u = torch.rand((), generator=generators[j], device=probs.device)
        p = probs[j, draft]
        if u < p:
            continue
        residual = probs[j].clone()
        residual[draft] = 0.0
        return draft_token_ids[:j] + [_draw(residual, generators[j])]
    return draft_token_ids + [_draw(probs[num_drafts], generators[num_drafts])]


def greedy_accept(target_token_ids: list[int], draft_token_ids: list[int]) -> list[int]:
    """The drafts up to the first that differs from the target's argmax, then the argmax there."""
    num_accepted = 0
    while num_accepted < len(draft_token_ids) and draft_token_ids[num_accepted] == target_token_ids[num_accepted]:
        num_accepted += 1
    return draft_token_ids[:num_accepted] + [target_token_ids[num_accepted]]


def _draw(probs: torch.Tensor, generator: torch.Generator | None) -> int:
    """One token from unnormalized `probs` (the sampler's exponential race: argmax p / E)."""
    noise = torch.empty_like(probs).exponential_(generator=generator)
    return int((probs / noise.clamp_min_(1e-20)).argmax())


def verify(
    sampler: Sampler,
    logits: torch.Tensor,
    rows: list[SamplingRow],
    draft_token_ids: list[list[int]],
    token_bitmask: torch.Tensor | None = None,
) -> list[tuple[list[int], list[int]]]:
    """Per request: (its tokens, the logits row of each), from `logits` [sum(k + 1), vocab].

    `rows[i]` describes logits row i: the request's tokens with the drafts before that
    row appended, so penalties, min_tokens and seeds see the position they sample.
    `token_bitmask` (structured output: row i's grammar mask after the drafts before it)
    masks `logits` in place first, so a draft its grammar rejects is never accepted.
    """
    processed = sampler.process(logits, rows, token_bitmask)
    greedy = [r.params.greedy for r in rows]
    argmax = processed.argmax(dim=-1).tolist()
    sampled = [i for i, g in enumerate(greedy) if not g]
    probs = target_probs(processed[sampled], [rows[i].params for i in sampled]) if sampled else None
    probs_row = {row: index for index, row in enumerate(sampled)}
    out, start = [], 0
    for drafts in draft_token_ids:
        span = range(start, start + len(drafts) + 1)
        if greedy[start]:
            tokens = greedy_accept(argmax[span.start : span.stop], drafts)
        else:
            generators = [row_generator(rows[i], logits.device) for i in span]
            tokens = rejection_sample(probs[[probs_row[i] for i in span]], drafts, generators)
        out.append((tokens, list(span[: len(tokens)])))
        start = span.stop
    return out
