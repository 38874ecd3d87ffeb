"""Tensor parallelism: one executor made of N ranks (see launch.py for how a group starts)."""

from __future__ import annotations

import os


def is_group(args) -> bool:
    """Whether this executor is a tensor-parallel group (the flag, or torchrun's WORLD_SIZE)."""
    return args.tensor_parallel_size > 1 or int(os.environ.get("WORLD_SIZE", "1")) > 1
