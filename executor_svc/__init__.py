"""Pagoda's executor: a model replica and its paged KV cache, driven step by step over ZeroMQ."""
