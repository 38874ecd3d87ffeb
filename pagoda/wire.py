"""The one place where step dataclasses (pagoda.step) meet their protobuf messages.

Everything on the ZeroMQ link is a serialized `ExecutorMessage` or `SchedulerMessage`;
nothing is pickled.
"""

from __future__ import annotations

import dataclasses

from pagoda.constraint import Constraint, ConstraintKind
from pagoda.step import (
    BlockCopy,
    CachedRequestData,
    ImageInput,
    ImageTensor,
    KVCacheGroupSpec,
    NewRequestData,
    PooledOutput,
    PoolRequest,
    PoolTask,
    RequestError,
    SampledToken,
    SamplingParams,
    StepPlan,
    StepResult,
    per_group,
)
from pagoda.v1 import executor_pb2 as pb
from pagoda.v1 import generation_pb2 as api_pb


def constraint_to_proto(c: Constraint | None, msg: api_pb.Constraint) -> None:
    """Write `c` into `msg` (a `pagoda.v1.Constraint`, the API's and the step protocol's)."""
    if c is None:
        return
    if c.kind is ConstraintKind.CHOICE:
        msg.choice.choices.extend(c.choices)
    elif c.kind is ConstraintKind.JSON_OBJECT:
        msg.json_object = True
    else:
        setattr(msg, c.kind.value, c.value)


def constraint_from_proto(msg: api_pb.Constraint) -> Constraint | None:
    """The constraint `msg` holds; None when its oneof is unset (or json_object is false)."""
    kind = msg.WhichOneof("kind")
    if kind is None or (kind == "json_object" and not msg.json_object):
        return None
    if kind == "choice":
        return Constraint(ConstraintKind.CHOICE, choices=tuple(msg.choice.choices))
    if kind == "json_object":
        return Constraint(ConstraintKind.JSON_OBJECT)
    return Constraint(ConstraintKind(kind), getattr(msg, kind))


def sampling_to_proto(s: SamplingParams) -> pb.StepSampling:
    msg = pb.StepSampling(
        temperature=s.temperature,
        top_p=s.top_p,
        top_k=s.top_k,
        min_p=s.min_p,
        presence_penalty=s.presence_penalty,
        frequency_penalty=s.frequency_penalty,
        repetition_penalty=s.repetition_penalty,
        logit_bias=dict(s.logit_bias),
        min_tokens=s.min_tokens,
        stop_token_ids=s.stop_token_ids,
        logprobs=s.logprobs,
        top_logprobs=s.top_logprobs,
    )
    if s.seed is not None:
        msg.seed = s.seed
    constraint_to_proto(s.constraint, msg.constraint)
    return msg


def sampling_from_proto(msg: pb.StepSampling) -> SamplingParams:
    return SamplingParams(
        temperature=msg.temperature,
        top_p=msg.top_p,
        top_k=msg.top_k,
        min_p=msg.min_p,
        seed=msg.seed if msg.HasField("seed") else None,
        presence_penalty=msg.presence_penalty,
        frequency_penalty=msg.frequency_penalty,
        repetition_penalty=msg.repetition_penalty,
        logit_bias=tuple(sorted(msg.logit_bias.items())),
        min_tokens=msg.min_tokens,
        stop_token_ids=tuple(msg.stop_token_ids),
        logprobs=msg.logprobs,
        top_logprobs=msg.top_logprobs,
        constraint=constraint_from_proto(msg.constraint) if msg.HasField("constraint") else None,
    )


def _with_grammar(sampling: SamplingParams, compiled_grammar: bytes) -> SamplingParams:
    if not compiled_grammar or sampling.constraint is None:
        return sampling
    return dataclasses.replace(sampling, compiled_grammar=compiled_grammar)


def kv_cache_groups_to_proto(groups: tuple[KVCacheGroupSpec, ...]) -> list[pb.KVCacheGroup]:
    return [pb.KVCacheGroup(layer_ids=g.layer_ids, sliding_window=g.sliding_window or 0) for g in groups]


def kv_cache_groups_from_proto(msgs) -> tuple[KVCacheGroupSpec, ...]:
    """The registered groups; none is one full-attention group (an executor that names no layers)."""
    if not msgs:
        return (KVCacheGroupSpec(layer_ids=()),)
    return tuple(KVCacheGroupSpec(tuple(m.layer_ids), m.sliding_window or None) for m in msgs)


def _other_groups(block_ids: tuple[list[int], ...]) -> list[pb.BlockIds]:
    return [pb.BlockIds(block_ids=ids) for ids in block_ids[1:]] if len(block_ids) > 1 else []


def _per_group(first, others) -> tuple[list[int], ...]:
    return (list(first), *(list(ids.block_ids) for ids in others)) if others else (list(first),)


def _cached_request_to_proto(r: CachedRequestData) -> pb.CachedRequest:
    ids = per_group(r.new_block_ids)  # (a flat list is the one group's)
    if len(ids) == 1:
        return pb.CachedRequest(req_id=r.req_id, new_block_ids=ids[0])
    return pb.CachedRequest(req_id=r.req_id, new_block_ids=ids[0], group_new_block_ids=_other_groups(ids))


def _image_to_proto(image: ImageInput) -> pb.ImageInput:
    return pb.ImageInput(
        hash=image.hash,
        offset=image.offset,
        length=image.length,
        tensors=[pb.ImageTensor(name=t.name, dtype=t.dtype, shape=t.shape, data=t.data) for t in image.tensors],
    )


def _image_from_proto(msg: pb.ImageInput) -> ImageInput:
    return ImageInput(
        hash=msg.hash,
        offset=msg.offset,
        length=msg.length,
        tensors=tuple(ImageTensor(t.name, t.dtype, tuple(t.shape), t.data) for t in msg.tensors),
    )


def plan_to_proto(plan: StepPlan) -> pb.StepPlan:
    return pb.StepPlan(
        step_id=plan.step_id,
        new_requests=[
            pb.NewRequest(
                req_id=r.req_id,
                token_ids=r.token_ids,
                num_prompt_tokens=r.num_prompt_tokens,
                sampling=sampling_to_proto(r.sampling),
                block_ids=r.block_ids[0],
                num_computed_tokens=r.num_computed_tokens,
                group_block_ids=_other_groups(r.block_ids),
                lora=r.lora,
                images=[_image_to_proto(image) for image in r.images],
                tenant=r.tenant,
                compiled_grammar=r.sampling.compiled_grammar if r.sampling.constraint is not None else b"",
            )
            for r in plan.new_requests
        ],
        cached_requests=[  # (one KV cache group inline: every running request, every step)
            pb.CachedRequest(req_id=r.req_id, new_block_ids=ids[0])
            if type(ids := r.new_block_ids) is tuple and len(ids) == 1
            else _cached_request_to_proto(r)
            for r in plan.cached_requests
        ],
        num_scheduled_tokens=plan.num_scheduled_tokens,
        finished_req_ids=plan.finished_req_ids,
        block_copies=[pb.BlockCopy(src=c.src, dst=c.dst) for c in plan.block_copies],
        scheduled_spec_decode_tokens={
            req_id: pb.DraftTokens(token_ids=drafts) for req_id, drafts in plan.scheduled_spec_decode_tokens.items()
        },
        pool_requests=[
            pb.PoolRequest(
                req_id=r.req_id, token_ids=r.token_ids, token_type_ids=r.token_type_ids, task=int(r.task),
                normalize=r.normalize, dimensions=r.dimensions,
            )
            for r in plan.pool_requests
        ],
    )


def plan_from_proto(msg: pb.StepPlan) -> StepPlan:
    return StepPlan(
        step_id=msg.step_id,
        new_requests=[
            NewRequestData(
                req_id=r.req_id,
                token_ids=list(r.token_ids),
                num_prompt_tokens=r.num_prompt_tokens,
                sampling=_with_grammar(sampling_from_proto(r.sampling), r.compiled_grammar),
                block_ids=_per_group(r.block_ids, r.group_block_ids),
                num_computed_tokens=r.num_computed_tokens,
                lora=r.lora,
                images=tuple(_image_from_proto(image) for image in r.images),
                tenant=r.tenant,
            )
            for r in msg.new_requests
        ],
        cached_requests=[
            CachedRequestData(req_id=r.req_id, new_block_ids=_per_group(r.new_block_ids, r.group_new_block_ids))
            for r in msg.cached_requests
        ],
        num_scheduled_tokens=dict(msg.num_scheduled_tokens),
        finished_req_ids=list(msg.finished_req_ids),
        block_copies=[BlockCopy(src=c.src, dst=c.dst) for c in msg.block_copies],
        scheduled_spec_decode_tokens={
            req_id: list(drafts.token_ids) for req_id, drafts in msg.scheduled_spec_decode_tokens.items()
        },
        pool_requests=[
            PoolRequest(
                req_id=r.req_id, token_ids=list(r.token_ids), task=PoolTask(r.task), token_type_ids=list(r.token_type_ids),
                normalize=r.normalize, dimensions=r.dimensions,
            )
            for r in msg.pool_requests
        ],
    )


def result_to_proto(result: StepResult) -> pb.StepResult:
    return pb.StepResult(
        step_id=result.step_id,
        sampled=[
            pb.SampledToken(
                req_id=s.req_id,
                token_id=s.token_id,
                logprob=s.logprob,
                top_logprobs=[pb.TopToken(token_id=t, logprob=lp) for t, lp in s.top_logprobs],
            )
            for s in result.sampled
        ],
        errors=[pb.RequestError(req_id=e.req_id, message=e.message) for e in result.errors],
        pooled=[pb.PooledOutput(req_id=p.req_id, values=p.values) for p in result.pooled],
    )


def result_from_proto(msg: pb.StepResult) -> StepResult:
    return StepResult(
        step_id=msg.step_id,
        sampled=[
            SampledToken(
                req_id=s.req_id,
                token_id=s.token_id,
                logprob=s.logprob,
                top_logprobs=[(t.token_id, t.logprob) for t in s.top_logprobs],
            )
            for s in msg.sampled
        ],
        errors=[RequestError(req_id=e.req_id, message=e.message) for e in msg.errors],
        pooled=[PooledOutput(req_id=p.req_id, values=list(p.values)) for p in msg.pooled],
    )
