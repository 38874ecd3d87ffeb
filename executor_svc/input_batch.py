"""The persistent batch: the executor's requests as rows of preallocated arrays (vLLM's InputBatch).

Each request the executor holds owns one row of `token_ids` (prompt + generated so far),
`block_table`, and the counters beside them. A step changes those rows in place — a new
request writes its row once, a cached one appends its new blocks, each sampled token is
one store — and the step's flat inputs are gathered from them with a few vectorized numpy
indexing ops, never rebuilt from Python lists:

    input_ids[t]  = token_ids[row[seq(t)], position[t]]
    slot[t]       = block_table[row[seq(t)], position[t] // B] * B + position[t] % B

A model with several KV cache groups (`executor_svc.kv_cache_spec`) has one block table
per group, all of one length per row, and a step gathers a slot mapping and a block table
per group. In a sliding-window group (window W) the step's table gives the null block for
every block wholly before the window of the row's first query, `num_computed - W + 1`:
the scheduler freed those without a word (`pagoda.step`), so their ids here are stale.

The gathered arrays land in staging buffers that are reused step after step; on CUDA those
are pinned, so the copies to the device are asynchronous (`non_blocking`). Rows are not
compacted: a step gathers the rows it schedules, in the order it wants (decodes first).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from pagoda.step import per_group


class BatchError(ValueError):
    """A plan that does not fit the rows it names (the model runner turns it into a PlanError)."""


@dataclass
class Gathered:
    """One step's flat batch, gathered on the host (numpy views of the staging buffers)."""

    rows: np.ndarray  # [S] the scheduled requests' rows, in batch order
    query_lens: np.ndarray  # [S]
    input_ids: np.ndarray  # [T]
    positions: np.ndarray  # [T]
    slot_mappings: tuple[np.ndarray, ...]  # per KV cache group: [T]
    query_start_loc: np.ndarray  # [S + 1]
    seq_lens: np.ndarray  # [S]
    block_tables: tuple[np.ndarray, ...]  # per KV cache group: [S, num_cols]
    sampled: np.ndarray  # [num sampled requests] indices into the batch order
    logits_indices: np.ndarray  # [num sampled + drafts] rows of the flat batch that get logits

    @property
    def slot_mapping(self) -> np.ndarray:
        """The first (for a model with only full attention, the one) group's."""
        return self.slot_mappings[0]

    @property
    def block_table(self) -> np.ndarray:
        return self.block_tables[0]


class _Staging:
    """Reusable host buffers (pinned where the device is CUDA), grown by doubling."""

    def __init__(self, pin: bool) -> None:
        self._pin = pin
        self._buffers: dict[str, tuple[torch.Tensor, np.ndarray]] = {}  # the tensor keeps the pinned memory

    def array(self, name: str, numel: int, dtype: torch.dtype) -> np.ndarray:
        entry = self._buffers.get(name)
        if entry is None or entry[1].shape[0] < numel:
            buf = torch.empty(max(64, 1 << max(numel - 1, 1).bit_length()), dtype=dtype, pin_memory=self._pin)
            entry = self._buffers[name] = (buf, buf.numpy())
        return entry[1][:numel]


class InputBatch:
    def __init__(
        self,
        max_model_len: int,
        block_size: int,
        device: torch.device,
        initial_rows: int = 16,
        sliding_windows: tuple[int | None, ...] = (None,),
    ) -> None:
        """`sliding_windows`: one per KV cache group, None for full attention."""
        self.block_size = block_size
        self.sliding_windows = tuple(sliding_windows)
        self.device = device
        self._pin = device.type == "cuda" and torch.cuda.is_available()
        self._width = max(int(max_model_len), 1)
        self._max_blocks = -(-self._width // block_size)
        self.token_ids = np.zeros((initial_rows, self._width), dtype=np.int64)
        # every group's block table in one array [groups, rows, blocks]: a step gathers them all at once
        self._tables = np.zeros((len(self.sliding_windows), initial_rows, self._max_blocks), dtype=np.int32)
        # each group's window (full attention: one longer than any position), for the mask of freed blocks
        self._windows = np.array([np.iinfo(np.int64).max // 4 if w is None else w for w in self.sliding_windows])
        self._any_window = any(w is not None for w in self.sliding_windows)
        self.num_tokens = np.zeros(initial_rows, dtype=np.int64)
        self.num_computed = np.zeros(initial_rows, dtype=np.int64)
        self.num_blocks = np.zeros(initial_rows, dtype=np.int64)
        self._free = list(range(initial_rows - 1, -1, -1))  # a stack: the lowest row is reused first
        self._staging = _Staging(self._pin)

    @property
    def block_tables(self) -> tuple[np.ndarray, ...]:
        """Each KV cache group's rows (views)."""
        return tuple(self._tables)

    @property
    def block_table(self) -> np.ndarray:
        """The first (for a model with only full attention, the one) group's rows."""
        return self._tables[0]

    # -- rows ------------------------------------------------------------------------------
    def add(self, token_ids: list[int], block_ids: tuple[list[int], ...], num_computed: int) -> int:
        """A row for a new request; `block_ids` one list per KV cache group."""
        if not self._free:
            self._grow_rows()
        row = self._free.pop()
        n = len(token_ids)
        if n > self._width:
            self._grow_cols(n)
        self.token_ids[row, :n] = token_ids
        self.num_tokens[row] = n
        self.num_computed[row] = num_computed
        self.num_blocks[row] = 0
        self.append_blocks(row, block_ids)
        return row

    def remove(self, row: int) -> None:
        self.num_tokens[row] = self.num_computed[row] = self.num_blocks[row] = 0
        self._free.append(row)

    def clear(self) -> None:
        rows = len(self.num_tokens)
        self.num_tokens[:] = self.num_computed[:] = self.num_blocks[:] = 0
        self._free = list(range(rows - 1, -1, -1))

    def append_blocks(self, row: int, block_ids: tuple[list[int], ...]) -> None:
        """Append one list of block ids per KV cache group, all of one length."""
        block_ids = per_group(block_ids)
        if len(block_ids) != len(self._tables) or len({len(ids) for ids in block_ids}) > 1:
            raise BatchError(
                f"block ids for {len(block_ids)} groups of lengths {[len(ids) for ids in block_ids]}: "
                f"expected {len(self._tables)} of one length"
            )
        start = int(self.num_blocks[row])
        end = start + len(block_ids[0])
        if end > self._max_blocks:
            raise BatchError(f"{end} blocks: more than max_model_len {self._width} needs ({self._max_blocks})")
        if end > start:
            self._tables[:, row, start:end] = block_ids
        self.num_blocks[row] = end

    def append_token(self, row: int, token_id: int) -> None:
        n = int(self.num_tokens[row])
        if n >= self.token_ids.shape[1]:
            self._grow_cols(n + 1)
        self.token_ids[row, n] = token_id
        self.num_tokens[row] = n + 1

    def write_drafts(self, row: int, draft: list[int]) -> None:
        """Draft tokens go after the row's last token; the tokens accepted overwrite them later."""
        n = int(self.num_tokens[row])
        if n + len(draft) > self.token_ids.shape[1]:
            self._grow_cols(n + len(draft))
        self.token_ids[row, n : n + len(draft)] = draft

    def _grow_rows(self) -> None:
        old = len(self.num_tokens)
        new = 2 * old
        self.token_ids = np.concatenate([self.token_ids, np.zeros_like(self.token_ids)])
        self._tables = np.concatenate([self._tables, np.zeros_like(self._tables)], axis=1)
        for name in ("num_tokens", "num_computed", "num_blocks"):
            setattr(self, name, np.concatenate([getattr(self, name), np.zeros(old, dtype=np.int64)]))
        self._free = list(range(new - 1, old - 1, -1)) + self._free

    def _grow_cols(self, width: int) -> None:
        width = max(width, 2 * self.token_ids.shape[1])
        self.token_ids = np.pad(self.token_ids, ((0, 0), (0, width - self.token_ids.shape[1])))

    # -- one step --------------------------------------------------------------------------
    def gather(self, rows_list: list[int], query_lens_list: list[int], draft_lens_list: list[int]) -> Gathered:
        """The flat batch of the given rows (in that order) and query lengths; raises BatchError
        where a row lacks the tokens or blocks its query needs."""
        num_seqs = len(rows_list)
        stage = self._staging.array
        rows = np.asarray(rows_list, dtype=np.int64)
        query_lens = np.asarray(query_lens_list, dtype=np.int64)
        draft_lens = np.asarray(draft_lens_list, dtype=np.int64)
        starts = self.num_computed[rows]
        seq_lens = starts + query_lens
        known = self.num_tokens[rows] + draft_lens
        bad = (seq_lens > known) | (seq_lens > self.num_blocks[rows] * self.block_size)
        if bad.any():
            i = int(np.flatnonzero(bad)[0])
            raise BatchError(
                f"row {int(rows[i])}: {int(seq_lens[i])} tokens scheduled, it has {int(self.num_tokens[rows[i]])} tokens, "
                f"{int(draft_lens[i])} drafts and {int(self.num_blocks[rows[i]])} blocks"
            )
        if ((draft_lens > 0) & (seq_lens != known)).any():
            raise BatchError("drafts scheduled before a request's last token")

        query_start_loc = stage("query_start_loc", num_seqs + 1, torch.int32)  # (the attention metadata's dtype)
        if all_decodes := int(query_lens.max()) == 1:  # the common step: one token each
            query_start_loc[:] = np.arange(num_seqs + 1)
            num_tokens = num_seqs
            positions = stage("positions", num_tokens, torch.int64)
            positions[:] = starts
            token_rows = rows
        else:
            query_start_loc[0] = 0
            np.cumsum(query_lens, out=query_start_loc[1:])
            num_tokens = int(query_start_loc[-1])
            seq_index = np.repeat(np.arange(num_seqs), query_lens)
            positions = stage("positions", num_tokens, torch.int64)
            np.subtract(np.arange(num_tokens), query_start_loc[:-1][seq_index], out=positions)
            positions += starts[seq_index]
            token_rows = rows[seq_index]
        input_ids = stage("input_ids", num_tokens, torch.int64)
        input_ids[:] = self.token_ids[token_rows, positions]

        num_cols = -(-int(seq_lens.max()) // self.block_size)
        cols = np.arange(num_cols)
        past_end = cols >= -(-seq_lens // self.block_size)[:, None]
        block_index, offsets = positions // self.block_size, positions % self.block_size
        groups = self._tables.shape[0]  # every group at once: [groups, seqs, cols] and [groups, tokens]
        tables = stage("block_tables", groups * num_seqs * num_cols, torch.int32).reshape(groups, num_seqs, num_cols)
        np.take(self._tables[:, :, :num_cols], rows, axis=1, out=tables)
        # Past a sequence's last block: the null block (0), as the attention backends expect
        # (the rows there may hold blocks allocated ahead, or an earlier owner's); in a
        # sliding window, also before the window of the first query (freed, stale ids).
        tables[:, past_end] = 0
        if self._any_window:
            first_kept = np.maximum(starts[None, :] - self._windows[:, None] + 1, 0) // self.block_size  # [groups, seqs]
            tables[cols[None, None, :] < first_kept[:, :, None]] = 0
        slots = stage("slot_mappings", groups * num_tokens, torch.int64).reshape(groups, num_tokens)
        slots[:] = self._tables[:, token_rows, block_index]
        slots *= self.block_size
        slots += offsets
        block_tables, slot_mappings = tuple(tables), tuple(slots)

        seq_lens_out = stage("seq_lens", num_seqs, torch.int32)
        seq_lens_out[:] = seq_lens
        sampled = np.flatnonzero(seq_lens == known)
        if all_decodes:  # (a query of one token has no drafts)
            logits_indices = sampled
        else:
            counts = draft_lens[sampled] + 1
            ends = query_start_loc[1:][sampled]
            logits_indices = np.repeat(ends - counts, counts) + (np.arange(int(counts.sum())) - np.repeat(np.cumsum(counts) - counts, counts))
        return Gathered(
            rows=rows,
            query_lens=query_lens,
            input_ids=input_ids,
            positions=positions,
            slot_mappings=slot_mappings,
            query_start_loc=query_start_loc,
            seq_lens=seq_lens_out,
            block_tables=block_tables,
            sampled=sampled,
            logits_indices=logits_indices,
        )

    def to_device(self, array: np.ndarray, dtype: torch.dtype | None = None) -> torch.Tensor:
        tensor = torch.from_numpy(array)
        if self.device.type == "cpu":
            return tensor if dtype is None else tensor.to(dtype)
        return tensor.to(self.device, dtype=dtype, non_blocking=self._pin)
