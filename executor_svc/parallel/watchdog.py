"""Ranks watch each other, so a tensor-parallel group fails as a whole.

Each rank's watchdog thread bumps its counter `hb/<rank>` in the group's store every
`interval_s` and reads the others'. It ends its process (`fatal`) when

- the store is unreachable: rank 0 (which hosts it) is gone;
- another rank's counter has not moved for `timeout_s`: that rank died or hangs;
- a rank it launched on this host has exited (seen at once, no timeout);
- its own step has run for longer than `step_timeout_s` (the group deadlocked).

It stops watching once the group leaves on purpose (rank 0's worker is done).

Rank 0 leaving closes its ZeroMQ link: the scheduler sees one executor gone and moves its
requests to the survivors. Ranks launched here also die with rank 0 (PR_SET_PDEATHSIG).
"""

from __future__ import annotations

import subprocess
import threading
import time
from datetime import timedelta

import torch.distributed as dist

from executor_svc.parallel.group import ProcessGroupTP, fatal


class Watchdog(threading.Thread):
    def __init__(
        self,
        group: ProcessGroupTP,
        children: list[subprocess.Popen] = (),
        timeout_s: float = 30.0,
        step_timeout_s: float = 600.0,
        interval_s: float = 0.5,
    ) -> None:
        super().__init__(name="tp-watchdog", daemon=True)
        self.group = group
        self.children = list(children)
        self.timeout_s = timeout_s
        self.step_timeout_s = step_timeout_s
        self.interval_s = interval_s
        # Its own connection: the main thread's store client may be blocked in a wait.
        rdv = group.rdv
        self._store = dist.TCPStore(
            rdv.master_addr, rdv.master_port, rdv.size, is_master=False,
            timeout=timedelta(seconds=max(timeout_s, 5.0)), wait_for_workers=False,
        )

    def run(self) -> None:
        rank, size = self.group.rank, self.group.size
        others = [r for r in range(size) if r != rank]
        seen = {r: (-1, time.monotonic()) for r in others}
        while not self.group.leaving:
            now = time.monotonic()
            try:
                self._store.add(f"hb/{rank}", 1)
                counts = {r: self._store.add(f"hb/{r}", 0) for r in others}
            except Exception as exc:  # noqa: BLE001
                fatal(f"rank {rank}: the group's store (rank 0) is unreachable: {exc}")
            for r, count in counts.items():
                if count != seen[r][0]:
                    seen[r] = (count, now)
                elif now - seen[r][1] > self.timeout_s:
                    fatal(f"rank {r} silent for {now - seen[r][1]:.1f} s")
            for i, child in enumerate(self.children, start=1):
                if child.poll() is not None:
                    fatal(f"rank {i} exited with status {child.returncode}")
            started = self.group.step_started
            if started is not None and now - started > self.step_timeout_s:
                fatal(f"rank {rank}: a step has run for {now - started:.0f} s")
            time.sleep(self.interval_s)
