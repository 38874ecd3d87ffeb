"""The model runners of a tensor-parallel group: rank 0 leads, the other ranks follow its steps.

Rank 0 is the normal `Worker` with a `LeaderRunner`: before running a step it broadcasts
one message to every rank,

    flags (u8: reset, stop, all_logits) | plan length (u32) | StepPlan bytes | StepResult bytes

whose StepResult is the previous step's sampled tokens and request errors: only rank 0
samples, and the other ranks append those tokens to their requests (their next decode reads
them) and mark those failed requests as rank 0 does (so every rank skips them alike) before
running the plan. So a step costs one broadcast, never a second collective for the tokens. Every
rank puts the scheduled requests in one order (`in_batch_order`), so every rank's flat
batch has the same rows.
Every rank then runs the same plan through the same `ModelRunner` code (the same request
state, the same flat batch); the model's collectives keep them in lock step.
"""

from __future__ import annotations

import logging
import struct
import time

from executor_svc.model_runner import ModelRunner, PlanError
from executor_svc.parallel.group import ProcessGroupTP
from pagoda import wire
from pagoda.step import RequestError, SampledToken, StepPlan
from pagoda.v1 import executor_pb2 as pb

log = logging.getLogger(__name__)

RESET, STOP, ALL_LOGITS = 1, 2, 4
_HEADER = struct.Struct("<BI")


def encode_step(flags: int, plan: StepPlan | None, sampled: list[SampledToken], errors: list[RequestError] = ()) -> bytes:
    plan_bytes = b"" if plan is None else wire.plan_to_proto(plan).SerializeToString()
    result = pb.StepResult(
        sampled=[pb.SampledToken(req_id=t.req_id, token_id=t.token_id) for t in sampled],
        errors=[pb.RequestError(req_id=e.req_id, message=e.message) for e in errors],
    )
    return _HEADER.pack(flags, len(plan_bytes)) + plan_bytes + result.SerializeToString()


def decode_step(data: bytes) -> tuple[int, StepPlan | None, list[tuple[str, int]], dict[str, str]]:
    flags, plan_len = _HEADER.unpack_from(data)
    start = _HEADER.size
    plan = None
    if not flags & STOP:
        msg = pb.StepPlan()
        msg.ParseFromString(data[start : start + plan_len])
        plan = in_batch_order(wire.plan_from_proto(msg))
    result = pb.StepResult()
    result.ParseFromString(data[start + plan_len :])
    return flags, plan, [(t.req_id, t.token_id) for t in result.sampled], {e.req_id: e.message for e in result.errors}


def in_batch_order(plan: StepPlan) -> StepPlan:
    """The plan with its scheduled requests sorted by id.

    A protobuf map's iteration order differs from process to process (its hash is seeded
    per process), and the runner lays out the batch in `num_scheduled_tokens`' order: the
    ranks' all-reduces would sum rows of different tokens.
    """
    plan.num_scheduled_tokens = dict(sorted(plan.num_scheduled_tokens.items()))
    return plan


class LeaderRunner(ModelRunner):
    """Rank 0: a `ModelRunner` that sends each step to the other ranks before running it."""

    def __init__(self, group: ProcessGroupTP, model_dir, **options) -> None:
        super().__init__(model_dir, tp=group, **options)
        self.group = group
        self._sampled: list[SampledToken] = []
        self._errors: list[RequestError] = []
        self._reset = False

    def _execute(self, plan: StepPlan, all_logits: bool):
        if plan.scheduled_spec_decode_tokens:  # the other ranks could not roll back rejected drafts
            raise ValueError("speculative decoding is not supported with --tensor-parallel-size > 1")
        flags = (RESET if self._reset else 0) | (ALL_LOGITS if all_logits else 0)
        self.group.broadcast_bytes(encode_step(flags, plan, self._sampled, self._errors))
        self._reset, self._sampled, self._errors = False, [], []
        plan = in_batch_order(plan)
        self.group.step_started = time.monotonic()
        try:
            result, logits = super()._execute(plan, all_logits)
        finally:
            self.group.step_started = None
        self._sampled, self._errors = result.sampled, result.errors
        return result, logits

    def reset(self) -> None:
        super().reset()
        self._reset, self._sampled, self._errors = True, [], []

    def stop(self) -> None:
        """Tell the other ranks to leave (the worker is done)."""
        self.group.leaving = True
        self.group.broadcast_bytes(encode_step(STOP, None, []))


class FollowerRunner(ModelRunner):
    """Ranks 1..N-1: run every step rank 0 broadcasts; never sample, never answer."""

    def __init__(self, group: ProcessGroupTP, model_dir, **options) -> None:
        super().__init__(model_dir, tp=group, **options)
        self.group = group

    def sample(self, logits, req_ids):
        return [], []  # rank 0 samples (tokens, errors); its tokens arrive with the next step

    def serve(self) -> int:
        while True:
            flags, plan, sampled, errors = decode_step(self.group.broadcast_bytes(None))
            if flags & STOP:
                self.group.leaving = True
                log.info("rank %d: rank 0 is done, leaving", self.group.rank)
                return 0
            for req_id, token_id in sampled:
                state = self.requests.get(req_id)
                if state is not None:
                    state.append_token(token_id)
            self.failed.update((r, m) for r, m in errors.items() if r in self.requests)
            if flags & RESET:
                self.reset()
            self.group.step_started = time.monotonic()
            try:
                self._execute(plan, bool(flags & ALL_LOGITS))
            except PlanError:  # rank 0 failed the same way, before any collective
                log.exception("rank %d: step %d", self.group.rank, plan.step_id)
                self.reset()
            finally:
                self.group.step_started = None
