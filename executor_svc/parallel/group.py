"""The process group of a tensor-parallel executor: rendezvous, collectives, the plan broadcast.

Rendezvous is a `torch.distributed.TCPStore` on rank 0 (`--tp-master-addr:--tp-master-port`),
shared with the watchdog (heartbeats) and used to hand the scheduler's `ExecutorConfig` to
the other ranks (they may wait minutes for it: a store read, not a collective with a timeout).
NCCL on CUDA, gloo on the CPU.

Any failed collective means a rank is gone: the process exits at once (`fatal`), so a
broken group never answers a step with an error the scheduler would pass on to clients.
"""

from __future__ import annotations

import logging
import os
import struct
import sys
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from executor_svc.model import TensorParallel

log = logging.getLogger(__name__)

# The other ranks wait in the plan broadcast for as long as the scheduler sends no step, so
# collectives never time out: a dead or hung rank, or a step that never ends, is found by
# the watchdog (executor_svc/parallel/watchdog.py), and a rank that dies breaks its sockets.
COLLECTIVE_TIMEOUT = timedelta(days=365)
STORE_TIMEOUT = timedelta(days=365)
# The plan broadcast sends this many bytes in one collective; a longer plan takes a second one.
BROADCAST_BYTES = 64 * 1024


@dataclass(frozen=True)
class Rendezvous:
    rank: int
    size: int
    master_addr: str = "127.0.0.1"
    master_port: int = 29500
    # Under torchrun with its agent store, the store on master_port already exists.
    store_exists: bool = False


def fatal(message: str) -> None:
    """Leave now, the whole process: a group missing a rank cannot serve."""
    log.critical("tensor-parallel group broken: %s; exiting", message)
    sys.stderr.flush()
    os._exit(3)


class ProcessGroupTP(TensorParallel):
    """A rank of the group: the model's collectives plus the plan broadcast."""

    def __init__(
        self, rdv: Rendezvous, device: torch.device, listen_fd: int | None = None, broadcast_bytes: int = BROADCAST_BYTES
    ) -> None:
        """`listen_fd`: rank 0's listening socket for the store (bound to the master address only);
        `broadcast_bytes`: the size of the plan broadcast's buffer (a longer plan takes two)."""
        self.rank = rdv.rank
        self.size = rdv.size
        self.device = device
        self.store = dist.TCPStore(
            rdv.master_addr,
            rdv.master_port,
            rdv.size,
            is_master=rdv.rank == 0 and not rdv.store_exists,
            timeout=STORE_TIMEOUT,
            wait_for_workers=False,
            master_listen_fd=listen_fd,
        )
        self.rdv = rdv
        backend = "nccl" if device.type == "cuda" else "gloo"
        dist.init_process_group(
            backend, store=dist.PrefixStore("pg", self.store), rank=rdv.rank, world_size=rdv.size,
            timeout=COLLECTIVE_TIMEOUT,
        )
        self._buffer = torch.empty(broadcast_bytes, dtype=torch.uint8, device=device)
        self.step_started: float | None = None  # time.monotonic() while a step runs (watchdog)
        self.leaving = False  # the group is stopping on purpose: ranks exiting is no failure
        log.info("tensor-parallel rank %d of %d (%s) joined", self.rank, self.size, backend)

    # -- the model's collectives -----------------------------------------------------------

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        try:
            dist.all_reduce(x)
        except Exception as exc:  # noqa: BLE001 (any failure is a lost rank)
            fatal(f"all_reduce: {exc}")
        return x

    def gather_logits(self, x: torch.Tensor) -> torch.Tensor:
        """Vocabulary shards [n, V / N] -> [n, V] on rank 0 (the only rank that samples)."""
        x = x.contiguous()
        parts = [torch.empty_like(x) for _ in range(self.size)] if self.rank == 0 else None
        try:
            dist.gather(x, parts, dst=0)
        except Exception as exc:  # noqa: BLE001
            fatal(f"gather: {exc}")
        return torch.cat(parts, dim=-1) if self.rank == 0 else x

    def min(self, value: int) -> int:
        t = torch.tensor([value], dtype=torch.int64, device=self.device)
        try:
            dist.all_reduce(t, op=dist.ReduceOp.MIN)
        except Exception as exc:  # noqa: BLE001
            fatal(f"all_reduce MIN: {exc}")
        return int(t.item())

    # -- rank 0 -> every rank: one step's bytes --------------------------------------------

    def broadcast_bytes(self, payload: bytes | None) -> bytes:
        """Rank 0 sends `payload`, the others receive it: one broadcast when it fits the buffer.

        The first 8 bytes carry the length; a longer payload's rest follows in a second broadcast.
        """
        buf = self._buffer
        room = buf.numel() - 8
        try:
            if self.rank == 0:
                head = struct.pack("<q", len(payload)) + payload[:room]
                buf[: len(head)].copy_(torch.frombuffer(bytearray(head), dtype=torch.uint8))
                dist.broadcast(buf, src=0)
                if len(payload) > room:
                    rest = torch.frombuffer(bytearray(payload[room:]), dtype=torch.uint8)
                    dist.broadcast(rest.to(self.device), src=0)
                return payload
            dist.broadcast(buf, src=0)
            data = buf.cpu().numpy().tobytes()
            (length,) = struct.unpack_from("<q", data)
            if length <= room:
                return data[8 : 8 + length]
            rest = torch.empty(length - room, dtype=torch.uint8, device=self.device)
            dist.broadcast(rest, src=0)
            return data[8:] + rest.cpu().numpy().tobytes()
        except Exception as exc:  # noqa: BLE001
            fatal(f"broadcast: {exc}")
            raise  # unreachable: fatal exits

    # -- set-up hand-over through the store ------------------------------------------------

    def publish(self, key: str, value: bytes) -> None:
        self.store.set(key, value)

    def wait_for(self, key: str) -> bytes:
        try:
            return self.store.get(key)
        except Exception as exc:  # noqa: BLE001
            fatal(f"the group's store (rank 0) is unreachable: {exc}")
            raise  # unreachable: fatal exits

    def close(self) -> None:
        if dist.is_initialized():
            dist.destroy_process_group()
