"""bench/profile_step_loop.py sorts py-spy samples into step stages."""

from __future__ import annotations

from bench.profile_step_loop import classify, executor_table, parse_raw, scheduler_busy

SERVE = "MainThread;main (executor_svc/__main__.py:87);Worker._serve (executor_svc/worker.py:158)"
STEP = SERVE + ";Worker._execute (executor_svc/worker.py:171);ModelRunner._execute (executor_svc/model_runner.py:230)"
LAYER = STEP + ";DecoderModel.forward (executor_svc/model.py:200);DecoderLayer.forward (executor_svc/model.py:130)"


def test_classify_by_leaf_and_caller():
    frames = lambda s: s.split(";")[1:]  # noqa: E731
    assert classify(frames(LAYER + ";PackedLinear.forward (executor_svc/model.py:80)")) == "linear (matmuls)"
    # the LM head is a linear layer too, but its caller decides
    lm_head = STEP + ";DecoderModel.compute_logits (executor_svc/model.py:210);PackedLinear.forward (executor_svc/model.py:80)"
    assert classify(frames(lm_head)) == "LM head + final norm"
    kernel = LAYER + ";TorchBackend.forward (a.py:1);TorchBackend._attend (a.py:2);CpuDecodeKernel.__call__ (b.py:3)"
    assert classify(frames(kernel)) == "attention: decode kernel"
    sdpa = LAYER + ";TorchBackend.forward (a.py:1);TorchBackend._attend (a.py:2)"
    assert classify(frames(sdpa)) == "attention: SDPA"
    assert classify(frames(SERVE + ";Worker._recv (executor_svc/worker.py:60)")) == "waiting for a plan"
    assert classify(frames(LAYER)) == "decoder (other)"
    assert classify(["something (x.py:1)"]) == "other"


def test_tables_from_raw_files(tmp_path):
    ex = tmp_path / "executor.txt"
    ex.write_text(
        "\n".join(
            [
                f"thread (1): {LAYER};PackedLinear.forward (executor_svc/model.py:80) 6",
                f"thread (1): {SERVE};Worker._recv (executor_svc/worker.py:60) 4",
                "thread (2): decode-attn_0;Thread._bootstrap (threading.py:1);_WorkItem.run (thread.py:58) 3",
                "thread (2): decode-attn_0;Thread._bootstrap (threading.py:1);_worker (thread.py:90) 7",
            ]
        )
    )
    rows, summary = executor_table(parse_raw(ex))
    assert summary["samples"] == 10 and summary["busy"] == 6
    assert summary["decode_kernel_helper_samples"] == 3
    assert ["linear (matmuls)", 6, 60.0, 100.0] in rows
    sched = tmp_path / "scheduler.txt"
    sched.write_text(
        "thread (9): MainThread;run (asyncio.py:1);EpollSelector.select (selectors.py:468) 9\n"
        "thread (9): MainThread;run (asyncio.py:1);Handle._run (events.py:80) 1\n"
    )
    assert scheduler_busy(parse_raw(sched)) == (1, 10)
