import math

from pagoda import wire
from pagoda.step import (
    BlockCopy,
    CachedRequestData,
    KVCacheGroupSpec,
    NewRequestData,
    SampledToken,
    SamplingParams,
    StepPlan,
    StepResult,
)
from pagoda.v1 import executor_pb2 as pb


def _roundtrip(msg_to_proto, msg_from_proto, value, proto_type):
    data = msg_to_proto(value).SerializeToString()
    parsed = proto_type()
    parsed.ParseFromString(data)
    return msg_from_proto(parsed)


def test_step_plan_roundtrip():
    sampling = SamplingParams(
        temperature=0.5,
        top_p=0.75,
        top_k=40,
        min_p=0.125,
        seed=2**63 + 5,
        presence_penalty=0.5,
        frequency_penalty=-0.25,
        repetition_penalty=1.5,
        logit_bias=((3, -100.0), (17, 2.5)),
        min_tokens=4,
        stop_token_ids=(2, 7),
        logprobs=True,
        top_logprobs=5,
    )
    plan = StepPlan(
        step_id=42,
        new_requests=[NewRequestData("a", [1, 2, 3], 2, sampling, [5, 9], 1)],
        cached_requests=[CachedRequestData("b", ([11],)), CachedRequestData("c", ([],))],
        num_scheduled_tokens={"a": 2, "b": 4, "c": 1},
        finished_req_ids=["d"],
        block_copies=[BlockCopy(9, 12)],
        scheduled_spec_decode_tokens={"b": [7, 8, 9]},
    )
    assert _roundtrip(wire.plan_to_proto, wire.plan_from_proto, plan, pb.StepPlan) == plan


def test_unseeded_sampling_stays_unseeded():
    plan = StepPlan(step_id=1, new_requests=[NewRequestData("a", [1], 1, SamplingParams(), [1], 0)])
    back = _roundtrip(wire.plan_to_proto, wire.plan_from_proto, plan, pb.StepPlan)
    assert back.new_requests[0].sampling.seed is None
    assert back.new_requests[0].sampling == SamplingParams()


def test_step_result_roundtrip():
    result = StepResult(
        step_id=7,
        sampled=[SampledToken("a", 5, -0.5, [(5, -0.5), (6, -1.25)]), SampledToken("b", 0)],
    )
    back = _roundtrip(wire.result_to_proto, wire.result_from_proto, result, pb.StepResult)
    assert back.step_id == 7
    assert [(s.req_id, s.token_id) for s in back.sampled] == [("a", 5), ("b", 0)]
    assert math.isclose(back.sampled[0].logprob, -0.5)
    assert back.sampled[0].top_logprobs == [(5, -0.5), (6, -1.25)]


def test_block_ids_of_several_kv_cache_groups_roundtrip():
    """Group 0 in the fields a one-group plan always had, the others beside them."""
    plan = StepPlan(
        step_id=3,
        new_requests=[NewRequestData("a", [1, 2, 3], 3, SamplingParams(), ([5, 9], [0, 4], [0, 7]), 0)],
        cached_requests=[CachedRequestData("b", ([11], [12], [13])), CachedRequestData("c", ([], [], []))],
        num_scheduled_tokens={"a": 3, "b": 1, "c": 1},
    )
    msg = wire.plan_to_proto(plan)
    assert list(msg.new_requests[0].block_ids) == [5, 9] and len(msg.new_requests[0].group_block_ids) == 2
    assert _roundtrip(wire.plan_to_proto, wire.plan_from_proto, plan, pb.StepPlan) == plan
    one_group = StepPlan(step_id=4, cached_requests=[CachedRequestData("b", [11])])  # a flat list: the one group's
    assert wire.plan_to_proto(one_group).cached_requests[0].group_new_block_ids == []
    assert wire.plan_from_proto(wire.plan_to_proto(one_group)).cached_requests[0].new_block_ids == ([11],)


def test_kv_cache_groups_roundtrip():
    groups = (KVCacheGroupSpec((5, 11)), KVCacheGroupSpec((0, 1), 512), KVCacheGroupSpec((2,), 512))
    msg = pb.Register(kv_cache_groups=wire.kv_cache_groups_to_proto(groups))
    assert wire.kv_cache_groups_from_proto(pb.Register.FromString(msg.SerializeToString()).kv_cache_groups) == groups
    assert wire.kv_cache_groups_from_proto([]) == (KVCacheGroupSpec(()),)  # an executor naming none: one full group


def test_pooling_plan_and_result_roundtrip():
    from pagoda.step import PooledOutput, PoolRequest, PoolTask

    plan = StepPlan(
        step_id=3,
        pool_requests=[
            PoolRequest("e", [101, 7, 102], PoolTask.EMBED, normalize=True, dimensions=64),
            PoolRequest("c", [101, 7, 102, 9, 102], PoolTask.CLASSIFY, token_type_ids=[0, 0, 0, 1, 1]),
        ],
    )
    assert _roundtrip(wire.plan_to_proto, wire.plan_from_proto, plan, pb.StepPlan) == plan
    result = StepResult(step_id=3, pooled=[PooledOutput("e", [0.5, -0.25]), PooledOutput("c", [0.75])])
    assert _roundtrip(wire.result_to_proto, wire.result_from_proto, result, pb.StepResult) == result
