"""The in-process engine (the reference): reads the captures in order and runs the rules of
REPLAY.md over them, one pass, in bounded memory. The rules live in dcp_rules.py and
synapse_rules.py / synapse_stream.py, shared with the Spark engine.

DCP state is built in one pass over the frames in order, so that memory grows with
documents, not frames. The rollback answers are read first (a pass skipped when the Parquet
statistics show none). Each chunk is prepared on a worker thread (DcpState.prepare: the
work that needs no state) and applied in order on the main one (DcpState.apply); documents
keep each one's last change, merged from per-chunk changes in the background.
Connections are told apart by `_conn` (capture rank << 32 | conn): a reconnect is a change
of `_conn`.
"""

from __future__ import annotations

import collections
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Callable, Iterator

import numpy as np
import pyarrow as pa

from dcptool.replay import tables as T
from dcptool.replay.as_of import AS_OF_COLUMNS, AsOf
from dcptool.replay.columns import CHUNK_ROWS, ordered_frames
from dcptool.replay.dcp_rules import (DCP_FILTER_COLUMNS, DCP_ROLLBACK_COLUMNS, DCP_STATE_COLUMNS, DcpState,
                                      dcp_vbucket_frames, rollback_mask)
from dcptool.replay.store import reader
from dcptool.replay.store.schema import capture_schema



@dataclass
class Replay:
    """Result of a replay: canonical pyarrow tables by name (frames read on demand)."""
    protocol: str
    files: list
    results: dict[str, pa.Table]
    as_of: AsOf | None = None

    def names(self) -> list[str]:
        return T.table_names(self.protocol)

    def table(self, name: str) -> pa.Table:
        if name not in self.results:
            if name != "frames":
                raise KeyError(name)
            frames = reader.read_capture_table(self.files)
            if self.as_of:
                frames = frames.filter(pa.array(self.as_of.mask(frames)))
            self.results[name] = T.canonical(self.protocol, "frames", frames)
        return self.results[name]


def replay_local(files: list, chunk_rows: int = CHUNK_ROWS, tables=None, as_of: AsOf | None = None) -> Replay:
    """`tables`: the names that will be asked for (None: any); Synapse skips building
    `rows` when it is not among them. `as_of` (DCP): only the frames it keeps count
    (replay/as_of.py)."""
    protocol = reader.protocol_of(files)
    ranks = reader.capture_ranks(files)
    if protocol == "dcp":
        return Replay(protocol, files, _replay_dcp(files, ranks, chunk_rows, as_of or None), as_of or None)
    if as_of:
        raise ValueError("a point in time (--as-of) applies to DCP captures only")
    return Replay(protocol, files, _replay_synapse(files, ranks, tables, chunk_rows))


def _in_order(work: Callable, items: Iterator, pool: ThreadPoolExecutor, ahead: int = 3) -> Iterator:
    """work(item) for each item, computed on `pool` up to `ahead` items in advance, yielded
    in order. Iterating `items` stays on the caller's thread; pyarrow and numpy release the
    GIL, so the pool's threads use the other cores."""
    pending: collections.deque = collections.deque()
    try:
        for item in items:
            pending.append(pool.submit(work, item))
            if len(pending) > ahead:
                yield pending.popleft().result()
        while pending:
            yield pending.popleft().result()
    finally:
        for f in pending:
            f.cancel()


def _chunks(t: pa.Table, rows: int) -> Iterator[pa.Table]:
    for s in range(0, t.num_rows, rows):
        yield t.slice(s, rows)


def _replay_dcp(files, ranks, chunk_rows, as_of: AsOf | None = None) -> dict[str, pa.Table]:
    # the rollbacks first: they are rare, and the Parquet statistics usually tell there are none
    cols = list(dict.fromkeys(DCP_FILTER_COLUMNS + DCP_ROLLBACK_COLUMNS + (AS_OF_COLUMNS if as_of else [])))
    rollbacks = []
    if reader.may_have_values(files, "rollback_seqno"):
        for t in ordered_frames(files, cols, ranks):
            keep = dcp_vbucket_frames(t) & rollback_mask(t)
            if as_of:
                keep &= as_of.mask(t)
            if keep.any():
                rollbacks.append(t.filter(pa.array(keep)).select(DCP_ROLLBACK_COLUMNS + ["_seq"]))
    schema = pa.schema([capture_schema("dcp").field(c) for c in DCP_ROLLBACK_COLUMNS] + [("_seq", pa.int64())])
    rollbacks = pa.concat_tables(rollbacks) if rollbacks else schema.empty_table()

    # then every vbucket frame, in order, chunk by chunk: two threads read row groups and do
    # the stateless part of the work on them (DcpState.prepare) ahead of the stateful part on
    # this thread (DcpState.apply); a third merges document changes in the background
    cols = list(dict.fromkeys(DCP_FILTER_COLUMNS + DCP_STATE_COLUMNS))

    def parts():
        pos = 0
        for rows, read in reader.iter_capture_parts(files, cols, batch_rows=chunk_rows):
            yield pos, read
            pos += rows

    def prepare(chunk: pa.Table):
        keep = dcp_vbucket_frames(chunk)
        if as_of:
            keep &= as_of.mask(chunk)
        if not keep.all():
            chunk = chunk.filter(pa.array(keep))
        return state.prepare(chunk.select(DCP_STATE_COLUMNS + ["_seq"]))

    def read(part) -> list:
        """Reads a part (a row group) and queues each of its chunks for `prepare`."""
        pos, read_part = part
        futures = []
        for t in read_part():
            t = t.append_column("_seq", pa.array(np.arange(pos, pos + t.num_rows, dtype=np.int64)))
            pos += t.num_rows
            futures.extend(pool.submit(prepare, c) for c in _chunks(t, chunk_rows))
        return futures

    with ThreadPoolExecutor(2, thread_name_prefix="dcptool-replay") as pool, \
            ThreadPoolExecutor(1, thread_name_prefix="dcptool-merge") as merger:
        state = DcpState(rollbacks, merger)
        try:
            for futures in _in_order(read, parts(), pool, ahead=1):
                for f in futures:
                    state.apply(f.result())
        except BaseException:   # an unreadable file, Ctrl-C: queued chunks are not worked on
            pool.shutdown(wait=False, cancel_futures=True)
            raise
        return state.finish()


def _replay_synapse(files, ranks, tables=None, chunk_rows: int = CHUNK_ROWS) -> dict[str, pa.Table]:
    """Every Synapse table but `frames`, in one pass over the capture in chunks of
    `chunk_rows` (replay/synapse_stream.py); `rows` only when `tables` asks for it."""
    from dcptool.replay.synapse_stream import lazy_results
    return lazy_results(files, ranks, tables, chunk_rows)
