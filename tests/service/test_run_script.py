"""`make run`'s script (scripts/run.sh) and a terminal's Ctrl-C (issue #43): SIGINT to the whole
foreground process group ends every process, the scheduler's helper children included, with no
KeyboardInterrupt traceback.

Before: the constraint-check child (and the long-prompt tokenizer child) got the terminal's SIGINT
too and died printing a KeyboardInterrupt traceback, while their parent was stopping them anyway.
"""

from __future__ import annotations

import os

import pytest

from pagoda.client import Client
from tests.readme.test_readme_commands import ctrl_c, start, wait_serving
from tests.service.harness import free_port

pytestmark = pytest.mark.timeout(900)


def test_ctrl_c_ends_every_process_of_run_sh_without_a_traceback():
    link = free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith("PAGODA_")}
    env.update(PAGODA_PORT=str(free_port()), PAGODA_EXECUTOR_BIND=f"tcp://127.0.0.1:{link}",
               PAGODA_SCHEDULER=f"tcp://127.0.0.1:{link}", PAGODA_METRICS_PORT="0", PAGODA_NUM_THREADS="1")
    proc = start("./scripts/run.sh", env)
    try:
        target = f"127.0.0.1:{env['PAGODA_PORT']}"
        wait_serving(target, proc)
        with Client(target, timeout=300) as client:
            # start both helper children: the constraint compiler, the tokenizer for long texts
            assert client.generate("Hi", max_tokens=2, json_object=True).collect().outputs
            assert len(client.tokenize("hello world " * 10_000).token_ids) == 20_001
    finally:
        out = ctrl_c(proc) if proc.poll() is None else proc.communicate()[0]
    # communicate() returned: every process that held the output pipe (the whole group) has ended
    assert "Traceback" not in out and "KeyboardInterrupt" not in out, out[-4000:]
