"""The scheduler core: requests, KV blocks, prefix cache and the step scheduler.

Pure Python (stdlib and `pagoda.step` only): the gRPC front end and the ZeroMQ link
are adapters around `Scheduler.add_requests` / `schedule` / `update_from_output`.
"""

from scheduler_svc.core.block_pool import BlockPool, KVCacheBlock
from scheduler_svc.core.config import SchedulerConfig, SpeculativeConfig, fit_error
from scheduler_svc.core.kv_cache_manager import KVCacheManager
from scheduler_svc.core.kv_events import AllBlocksCleared, BlockRemoved, BlockStored, KVCacheEvent
from scheduler_svc.core.pooling_scheduler import (
    PoolingRequest, PoolingScheduler, PoolingSchedulerConfig, PoolUpdate,
)
from scheduler_svc.core.outputs import RequestUpdate, SchedulerStats, SpecDecodeStats
from scheduler_svc.core.request import FinishReason, Request, RequestStatus
from scheduler_svc.core.scheduler import Scheduler

__all__ = [
    "AllBlocksCleared",
    "BlockRemoved",
    "BlockStored",
    "BlockPool",
    "FinishReason",
    "KVCacheBlock",
    "KVCacheEvent",
    "KVCacheManager",
    "PoolUpdate",
    "PoolingRequest",
    "PoolingScheduler",
    "PoolingSchedulerConfig",
    "Request",
    "RequestStatus",
    "RequestUpdate",
    "Scheduler",
    "SchedulerConfig",
    "SchedulerStats",
    "SpecDecodeStats",
    "SpeculativeConfig",
    "fit_error",
]
