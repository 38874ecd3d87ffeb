"""The field's engine protocol, `vllm.grpc.engine.VllmEngine` (the `smg-grpc-proto` package),
served by the scheduler beside `pagoda.v1.Generation` on the same port.

    requests.py    the protocol's GenerateRequest as Pagoda's (proto3 zeros, refused fields)
    responses.py   Pagoda's response stream as the protocol's chunks and completes
    loads.py       the scheduler's load (GetLoads, the KV stream's load record)
    kv_events.py   the executors' prefix-cache events as per-tenant KV-event streams
    servicer.py    the RPCs, and `add_vllm_engine`, which registers them on a server
"""

from scheduler_svc.vllm_engine.servicer import SERVICE_NAME, VllmEngineServicer, add_vllm_engine

__all__ = ["SERVICE_NAME", "VllmEngineServicer", "add_vllm_engine"]
