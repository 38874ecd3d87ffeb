"""The persistent batch against a from-scratch build of the same step (what the runner did before).

Hypothesis drives a sequence of adds, removals, appended tokens and blocks, and steps with
prefill chunks, decodes and drafts, over one or several KV cache groups (full attention and
sliding windows); after every change each step's gathered inputs must equal those built
from plain Python lists.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from executor_svc.input_batch import BatchError, InputBatch

B = 4  # block size
MAX_LEN = 40


def reference(reqs: dict[str, dict], order: list[tuple[str, int, list[int]]], windows=(None,)) -> dict[str, list]:
    """The step's inputs from lists, as the runner built them before the persistent batch; a
    sliding-window group's table has the null block before the window of the first query."""
    input_ids, positions, seq_lens, logits_rows = [], [], [], []
    slots, tables = [[] for _ in windows], [[] for _ in windows]
    qsl = [0]
    for req_id, n, draft in order:
        r = reqs[req_id]
        start, end = r["computed"], r["computed"] + n
        known = r["tokens"] + draft
        input_ids += known[start:end]
        positions += list(range(start, end))
        for group in range(len(windows)):
            slots[group] += [r["blocks"][group][p // B] * B + p % B for p in range(start, end)]
        seq_lens.append(end)
        qsl.append(qsl[-1] + n)
        if end == len(known):
            logits_rows += list(range(qsl[-1] - len(draft) - 1, qsl[-1]))
    cols = -(-max(seq_lens) // B)
    for req_id, n, _ in order:
        r = reqs[req_id]
        used = -(-(r["computed"] + n) // B)
        for group, window in enumerate(windows):
            skipped = 0 if window is None else max(r["computed"] - window + 1, 0) // B
            table = r["blocks"][group][:used] + [0] * (cols - used)
            tables[group].append([0] * skipped + table[skipped:])
    return dict(input_ids=input_ids, positions=positions, slot_mappings=slots, block_tables=tables,
                seq_lens=seq_lens, query_start_loc=qsl, logits_indices=logits_rows)


def check_step(batch: InputBatch, reqs: dict[str, dict], rows: dict[str, int], order) -> None:
    for req_id, _, draft in order:
        if draft:
            batch.write_drafts(rows[req_id], draft)
    g = batch.gather([rows[r] for r, _, _ in order], [n for _, n, _ in order], [len(d) for _, _, d in order])
    want = reference(reqs, order, batch.sliding_windows)
    for name, value in want.items():
        got = getattr(g, name)
        assert (got.tolist() if isinstance(got, np.ndarray) else [x.tolist() for x in got]) == value, name


@st.composite
def programs(draw):
    ops = st.sampled_from(["add", "remove", "token", "block", "step", "step"])
    start = [("add", draw(st.randoms())) for _ in range(draw(st.integers(1, 6)))]
    return start + draw(st.lists(st.tuples(ops, st.randoms()), min_size=1, max_size=40))


@settings(max_examples=150, deadline=None)
@given(programs(), st.sampled_from([(None,), (None,), (None, 3), (6, None, 1)]))
def test_gather_equals_a_build_from_scratch(program, windows):
    batch = InputBatch(MAX_LEN, B, torch.device("cpu"), initial_rows=2, sliding_windows=windows)  # rows grow on the way
    groups = range(len(windows))
    reqs: dict[str, dict] = {}
    rows: dict[str, int] = {}
    counter = 0
    for op, rng in program:
        if op == "add" or not reqs:
            counter += 1
            n = rng.randint(1, 20)
            tokens = [rng.randrange(1, 1000) for _ in range(n)]
            computed = rng.randint(0, n - 1)
            num_blocks = -(-(n + rng.randint(0, 8)) // B)
            blocks = tuple([rng.randrange(1, 64) for _ in range(num_blocks)] for _ in groups)
            req_id = f"r{counter}"
            reqs[req_id] = dict(tokens=tokens, computed=computed, blocks=blocks)
            rows[req_id] = batch.add(tokens, blocks, computed)
            assert len(set(rows.values())) == len(rows)  # rows are never shared
        elif op == "remove" and len(reqs) > 1:
            req_id = rng.choice(sorted(reqs))
            batch.remove(rows.pop(req_id))
            del reqs[req_id]
        elif op == "token":
            req_id = rng.choice(sorted(reqs))
            r = reqs[req_id]
            if len(r["tokens"]) < len(r["blocks"][0]) * B:
                token = rng.randrange(1, 1000)
                r["tokens"].append(token)
                batch.append_token(rows[req_id], token)
        elif op == "block":
            req_id = rng.choice(sorted(reqs))
            num_new = rng.randint(1, 2)
            new = tuple([rng.randrange(1, 64) for _ in range(num_new)] for _ in groups)
            if len(reqs[req_id]["blocks"][0]) + num_new <= -(-MAX_LEN // B):
                for table, ids in zip(reqs[req_id]["blocks"], new):
                    table += ids
                batch.append_blocks(rows[req_id], new)
        else:  # a step over a random subset, decodes first as the runner orders them
            order = []
            for req_id in rng.sample(sorted(reqs), rng.randint(1, len(reqs))):
                r = reqs[req_id]
                room = len(r["tokens"]) - r["computed"]
                if room <= 0:
                    continue
                draft: list[int] = []
                if room == 1 and rng.random() < 0.3:
                    k = min(rng.randint(1, 3), len(r["blocks"][0]) * B - len(r["tokens"]))
                    draft = [rng.randrange(1, 1000) for _ in range(max(k, 0))]
                n = room + len(draft) if draft else rng.randint(1, room)
                order.append((req_id, n, draft))
            if not order:
                continue
            order.sort(key=lambda item: item[1] != 1)
            check_step(batch, reqs, rows, order)
            for req_id, n, draft in order:  # the runner's finish_step, without sampling
                if not draft:
                    reqs[req_id]["computed"] += n
                    batch.num_computed[rows[req_id]] += n


def test_a_query_past_the_known_tokens_or_blocks_is_refused():
    batch = InputBatch(MAX_LEN, B, torch.device("cpu"))
    row = batch.add([5, 6, 7], [3], 0)
    with pytest.raises(BatchError, match="4 tokens scheduled"):
        batch.gather([row], [4], [0])
    batch.append_token(row, 8)
    batch.append_token(row, 9)
    with pytest.raises(BatchError, match="5 tokens scheduled.*1 blocks"):
        batch.gather([row], [5], [0])
    with pytest.raises(BatchError, match="more than max_model_len"):
        batch.append_blocks(row, list(range(1, 11)))


def test_rows_are_reused_and_the_staging_buffers_too():
    batch = InputBatch(MAX_LEN, B, torch.device("cpu"), initial_rows=2)
    a, b = batch.add([1, 2], [1], 0), batch.add([3], [2], 0)
    c = batch.add([4], [3], 0)  # grows to 4 rows
    assert len({a, b, c}) == 3 and batch.token_ids.shape[0] == 4
    batch.remove(a)
    assert batch.add([9, 9, 9], [4], 0) == a
    first = batch.gather([b, c], [1, 1], [0, 0]).input_ids
    second = batch.gather([c, b], [1, 1], [0, 0]).input_ids
    assert np.shares_memory(first, second) and second.tolist() == [4, 3]


def test_groups_get_one_list_each_of_one_length():
    batch = InputBatch(MAX_LEN, B, torch.device("cpu"), sliding_windows=(None, 4))
    row = batch.add([5, 6, 7], ([3], [8]), 0)
    with pytest.raises(BatchError, match="2 groups of lengths"):
        batch.append_blocks(row, ([1, 2], [4]))
    with pytest.raises(BatchError, match="expected 2"):
        batch.append_blocks(row, ([1],))
    batch.append_blocks(row, ([1], [4]))
    assert [t[row, :2].tolist() for t in batch.block_tables] == [[3, 1], [8, 4]]
