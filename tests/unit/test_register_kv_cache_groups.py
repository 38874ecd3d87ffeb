"""What a Register may say of its KV cache groups: bounded, every layer in one group, none empty."""

from pagoda import wire
from pagoda.step import KVCacheGroupSpec
from pagoda.v1 import executor_pb2 as xpb
from scheduler_svc.executor_pool import MAX_KV_CACHE_GROUPS, MAX_KV_CACHE_LAYERS, kv_cache_groups_problem


def groups_msg(*groups: KVCacheGroupSpec):
    return xpb.Register(kv_cache_groups=wire.kv_cache_groups_to_proto(groups)).kv_cache_groups


def test_gemma_like_groups_and_none_at_all_are_served():
    assert kv_cache_groups_problem(groups_msg(KVCacheGroupSpec((5, 11)), KVCacheGroupSpec((0, 1), 512))) == ""
    assert kv_cache_groups_problem(groups_msg()) == ""  # an executor that names no groups: one full group


def test_overlapping_empty_or_too_many_groups_are_refused():
    assert "no layer may be in two groups" in kv_cache_groups_problem(groups_msg(KVCacheGroupSpec((0, 1)), KVCacheGroupSpec((1,), 8)))
    assert "every group needs layers" in kv_cache_groups_problem(groups_msg(KVCacheGroupSpec(())))
    many = [KVCacheGroupSpec((i,)) for i in range(MAX_KV_CACHE_GROUPS + 1)]
    assert "groups, at most" in kv_cache_groups_problem(groups_msg(*many))
    wide = KVCacheGroupSpec(tuple(range(MAX_KV_CACHE_LAYERS + 1)))
    assert "layers, at most" in kv_cache_groups_problem(groups_msg(wide))
