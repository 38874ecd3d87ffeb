"""Pagoda: shared pieces of the scheduler and executor services.

`pagoda.v1` holds the protobuf / gRPC stubs generated from `protos/` (`make protos`).
"""

__version__ = "0.1.0"
