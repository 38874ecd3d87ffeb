"""The CPU decode-attention kernel (`csrc/paged_decode.c`): built once per machine, called through ctypes.

Decode attention on a CPU is memory-bound. The portable path gathers each sequence's K and V
blocks into a padded copy and runs SDPA on it, so every K/V byte is read, written, and read
again; this kernel reads K and V once, in place, through the block table. It is plain C
compiled with the system compiler (`cc -O3 -march=native`, no torch headers: 0.4 s here)
into `~/.cache/pagoda/kernels/`, keyed by the source, the compiler and this CPU's flags. The
sequences are split into one contiguous range per torch thread, balanced by length, and run
on torch's OpenMP threads: the library is built with -fopenmp, so its libgomp.so.1 is the one
torch already loaded, whose threads are still spinning after the step's last GEMM. A pool of
our own competed with them for the cores: at 40 decodes of 256 tokens on 2 cores, the
attention of a `--dtype bfloat16` step took 29.8 ms on a Python thread pool beside torch's
spinning threads, 26.3 ms on one thread, and 15-18 ms on torch's team. Where the compiler
has no OpenMP, or the process would hold a second OpenMP runtime (a torch whose runtime is
bundled under another name), the ranges run on a Python thread pool (ctypes releases the GIL
for the duration of each call).

Where no compiler is found or the build fails, `load()` returns None and the backend keeps
the SDPA path; `BackendOptions.cpu_decode_kernel=False` (`PAGODA_CPU_DECODE_KERNEL=0`) keeps it
too (for side-by-side runs).
"""

from __future__ import annotations

import ctypes
import logging
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

from executor_svc import cbuild

log = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("csrc") / "paged_decode.c"
CFLAGS = (*cbuild.BASE_CFLAGS, "-fopenmp-simd")

_c_int64, _c_float, _ptr = ctypes.c_int64, ctypes.c_float, ctypes.c_void_p


class CpuDecodeKernel:
    """`kernel(q, k_cache, v_cache, block_table, seq_lens, scale) -> out` for float32 or bfloat16 decodes.

    A bfloat16 cache is read as it is (`paged_decode_attention_bf16`); its bfloat16 query is
    cast to float32 for the call and the output back to bfloat16 (the softmax and the sums are
    float32 either way, as SDPA's CPU kernels compute them).
    """

    DTYPES = (torch.float32, torch.bfloat16)

    def __init__(self, library: ctypes.CDLL, num_threads: int, openmp: bool = False) -> None:
        argtypes = [_ptr, _ptr, _ptr, _ptr, _c_int64, _ptr, _ptr, _ptr, *[_c_int64] * 4, _c_float, *[_c_int64] * 3]
        fns = {torch.float32: library.paged_decode_attention, torch.bfloat16: library.paged_decode_attention_bf16}
        for fn in fns.values():
            fn.argtypes, fn.restype = argtypes, None
        self._fns = fns
        self._library = library
        self.num_threads = max(1, num_threads)
        self._parts = None  # paged_decode_attention_parts: sequences, and parts of long ones, on torch's team
        self._pool = None
        self._seqs = library.paged_decode_attention_seqs  # the same arguments, on the calling thread
        self._seqs.argtypes = [_ptr, _ptr, _ptr, _ptr, _c_int64, _ptr, _ptr, _ptr, *[_c_int64] * 5, _c_float,
                               *[_c_int64] * 4]
        self._seqs.restype = None
        if openmp and self.num_threads > 1:
            self._parts = library.paged_decode_attention_parts
            self._parts.argtypes = [_ptr, _ptr, _ptr, _ptr, _c_int64, _ptr, _ptr, _ptr, *[_c_int64] * 5, _c_float,
                                    *[_c_int64] * 4]
            self._parts.restype = None
        elif self.num_threads > 1:
            self._pool = ThreadPoolExecutor(self.num_threads, thread_name_prefix="decode-attn")

    @classmethod
    def load(cls, num_threads: int | None = None) -> CpuDecodeKernel | None:
        what = "CPU decode attention kernel (SDPA on gathered blocks instead)"
        library, openmp = cbuild.load_openmp(SOURCE, CFLAGS, what)
        if library is None:
            return None
        kernel = cls(library, num_threads or torch.get_num_threads(), openmp)
        log.info("decode attention: CPU kernel on %d thread(s)%s", kernel.num_threads,
                 " (torch's OpenMP team)" if kernel._parts is not None else "")
        return kernel

    @staticmethod
    def scratch_floats(num_heads: int, block_size: int) -> int:
        """Floats of scratch one thread of the kernel needs."""
        return num_heads * (block_size + 2)

    @property
    def parts_function(self):
        """The C entry that runs a step's sequences on torch's OpenMP team (None without one), for callers
        that run a whole step in C::

            paged_decode_attention_parts(q, k_cache, v_cache, block_table, table_stride, seq_lens, out, scratch,
                                         scratch_stride, num_heads, num_kv_heads, head_dim, block_size, scale,
                                         num_seqs, threads, kv_bf16, window)

        scratch: `threads` rows of `scratch_floats` floats, `scratch_stride` floats apart; `threads` the
        kernel's `num_threads`. The same bits as `c_function` over every sequence.
        """
        return self._parts

    @property
    def step_function(self):
        """The entry a whole-step caller runs every step's sequences through, with `parts_function`'s
        arguments: `parts_function` on the OpenMP team, or with one thread the calling thread's loop;
        None for several threads without the team (the caller splits the sequences)."""
        if self._parts is not None:
            return self._parts
        return self._seqs if self.num_threads == 1 else None

    def c_function(self, dtype: torch.dtype = torch.float32):
        """The C entry for a `dtype` cache, for callers that run a whole step in C (one range of sequences a call)::

            paged_decode_attention(q, k_cache, v_cache, block_table, table_stride, seq_lens, out, scratch,
                                   num_heads, num_kv_heads, head_dim, block_size, scale, first_seq, end_seq, window)

        q and out [S, H, D] float32, scratch `num_heads * (block_size + 2)` floats. `window`: a sliding window
        (a sequence of length L attends to its last min(L, window) keys; the table's blocks before them are
        never read) or 0 for every key.
        """
        return self._fns[dtype]

    def __call__(
        self,
        q: torch.Tensor,  # [S, H, D] float32, or bfloat16 with a bfloat16 cache
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        block_table: torch.Tensor,  # [S, cols] int32
        seq_lens: torch.Tensor,  # [S] int32
        scale: float,
        work_split: list[int] | None = None,
        window: int | None = None,
    ) -> torch.Tensor:
        """`window`: a sliding layer's window (each sequence attends to its last `window` keys), None for every key."""
        num_seqs, num_heads, head_dim = q.shape
        _, block_size, num_kv_heads, _ = k_cache.shape
        dtype = q.dtype  # the cache's, or float32 (a float32 query over a bfloat16 cache: out float32)
        assert k_cache.dtype == v_cache.dtype and k_cache.dtype in self.DTYPES and dtype in (torch.float32, k_cache.dtype)
        assert k_cache.is_contiguous() and v_cache.is_contiguous()
        q = q.float().contiguous()
        fn = self._fns[k_cache.dtype]
        assert block_table.dtype == torch.int32 and seq_lens.dtype == torch.int32 and block_table.stride(1) == 1
        out = torch.empty_like(q)
        args = (
            q.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(), block_table.data_ptr(), block_table.stride(0),
            seq_lens.data_ptr(), out.data_ptr(),
        )
        tail = (num_heads, num_kv_heads, head_dim, block_size, scale)
        if self._parts is not None:  # every thread, even for one sequence (a long one is split over them)
            scratch = torch.empty(self.num_threads, self.scratch_floats(num_heads, block_size), dtype=torch.float32)
            self._parts(*args, scratch.data_ptr(), scratch.stride(0), *tail, num_seqs, self.num_threads,
                        int(k_cache.dtype == torch.bfloat16), window or 0)
            return out.to(dtype)
        bounds = work_split if work_split is not None else self.split(seq_lens)
        scratch = torch.empty(len(bounds) - 1, self.scratch_floats(num_heads, block_size), dtype=torch.float32)
        calls = [
            (*args, scratch[i].data_ptr(), *tail, bounds[i], bounds[i + 1], window or 0)
            for i in range(len(bounds) - 1)
            if bounds[i + 1] > bounds[i]
        ]
        if self._pool is None or len(calls) == 1:
            for c in calls:
                fn(*c)
        else:
            others = [self._pool.submit(fn, *c) for c in calls[1:]]
            fn(*calls[0])  # this thread's share, while the pool runs the rest
            for f in others:
                f.result()
        return out.to(dtype)

    def split(self, seq_lens: torch.Tensor) -> list[int]:
        """Sequence boundaries [0, ..., S] giving each thread about the same number of keys."""
        num_seqs = seq_lens.shape[0]
        parts = min(self.num_threads, num_seqs)
        if parts <= 1:
            return [0, num_seqs]
        cost = seq_lens.cumsum(0)
        targets = cost[-1] * torch.arange(1, parts) / parts
        inner = torch.searchsorted(cost, targets).tolist()
        return [0, *inner, num_seqs]
