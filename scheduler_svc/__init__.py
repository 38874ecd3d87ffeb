"""Pagoda's scheduler service: gRPC front end, admission, scheduling, KV blocks, routing."""
