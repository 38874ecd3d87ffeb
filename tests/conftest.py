"""Set before anything imports triton: without CUDA, Triton kernels run in Triton's interpreter."""

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
