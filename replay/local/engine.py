"""The in-process engine. The relational tables of REPLAY.md (`documents`, `undone`,
`rollbacks`, `failover`, `history`) are the SQL of replay/rules/plans.py, run by DuckDB
(replay/local/duck.py: the same definitions Spark runs); the tables of the per-vbucket rules
(`vbuckets`, `snapshots`) and `topology` come from the shared rule modules over the capture in
frame order, in bounded memory; the Synapse tables from replay/rules/synapse_stream.py.

The per-vbucket pass: the rollback answers are read first (a pass skipped when the Parquet
statistics show none). One thread reads the chunks in order, two prepare them
(DcpState.prepare: the work that needs no state) and the caller's thread applies them in
order (DcpState.apply), with a few chunks in flight at most (`_pipeline`). Documents live in
a compact store (replay/rules/doc_state.py); when it would outgrow the memory budget
(`doc_budget`) the vbuckets are split into ranges replayed one pass each.
Connections are told apart by `_conn` (capture rank << 32 | conn): a reconnect is a change
of `_conn`."""

from __future__ import annotations

import contextlib
import math
import os
import queue
import threading
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Callable, Iterator

import numpy as np
import pyarrow as pa

from dcptool.replay.rules import tables as T
from dcptool.replay.rules.as_of import AS_OF_COLUMNS, AsOf
from dcptool.replay.rules.columns import CHUNK_ROWS, as_numpy, ordered_frames
from dcptool.replay.rules.dcp import (DCP_FILTER_COLUMNS, DCP_ROLLBACK_COLUMNS, DCP_STATE_COLUMNS, DcpState,
                                      dcp_vbucket_frames, rollback_mask)
from dcptool.replay.rules.history import HistoryState
from dcptool.replay.local import duck
from dcptool.replay.store import reader
from dcptool.replay.store.schema import capture_schema
from dcptool.protocol.errors import DcptoolError



@dataclass
class Replay:
    """Result of a replay: canonical pyarrow tables by name (frames read on demand)."""
    protocol: str
    files: list
    results: dict[str, pa.Table]
    as_of: AsOf | None = None
    memory: int | None = -1       # DCP: the budget of the replay (see replay_local)

    def names(self) -> list[str]:
        return T.table_names(self.protocol)

    def table(self, name: str) -> pa.Table:
        if name not in self.results and name == "topology" and self.protocol == "dcp":
            from dcptool.replay.rules.topology import local_topology   # read when asked for
            self.results[name] = local_topology(self.files, as_of=self.as_of)
        if name not in self.results and name == "lag":
            from dcptool.replay.rules import lag   # read when asked for
            self.results[name] = (lag.local_lag(self.files, as_of=self.as_of) if self.protocol == "dcp"
                                  else lag.local_synapse_lag(self.files))
        if name not in self.results and self.protocol == "dcp" and name in PLAN_TABLES:
            # a table the replay was told would not be asked for: DuckDB runs its plan now
            self.results.update(_plan_tables(self.files, [name], self.as_of, self.memory))
        if name not in self.results and self.protocol == "dcp" and name in STATE_TABLES:
            self.results.update(_state_tables(self.files, DCP_CHUNK_ROWS, self.as_of, self.memory))
        if name not in self.results:
            if name != "frames":
                raise KeyError(name)
            frames = reader.read_capture_table(self.files)
            if self.as_of:
                frames = frames.filter(pa.array(self.as_of.mask(frames)))
            self.results[name] = T.canonical(self.protocol, "frames", frames)
        return self.results[name]


def replay_local(files: list, chunk_rows: int | None = None, tables=None, as_of: AsOf | None = None,
                 memory: int | None = -1) -> Replay:
    """`tables`: the names that will be asked for (None: any); Synapse skips building
    `rows` when it is not among them. `as_of` (DCP): only the frames it keeps count
    (replay/rules/as_of.py). `memory` (DCP): bytes the documents of one pass may hold (None: no
    limit; -1: doc_budget())."""
    protocol = reader.protocol_of(files)
    ranks = reader.capture_ranks(files)
    if protocol == "dcp":
        want = set(T.table_names("dcp") if tables is None else tables)
        results = _plan_tables(files, [n for n in PLAN_TABLES if n in want], as_of or None, memory)
        if want & set(STATE_TABLES):
            results.update(_state_tables(files, chunk_rows or DCP_CHUNK_ROWS, as_of or None, memory))
        return Replay(protocol, files, results, as_of or None, memory)
    if as_of:
        raise ValueError("a point in time (--as-of) applies to DCP captures only")
    return Replay(protocol, files, _replay_synapse(files, ranks, tables, chunk_rows or CHUNK_ROWS))


# the tables DuckDB computes from the plans of replay/rules/plans.py (the ones Spark runs as SQL too)
PLAN_TABLES = duck.PLAN_TABLES
# the tables of the per-vbucket rules (DcpState, replay/rules/dcp.py), fed in frame order
STATE_TABLES = ("vbuckets", "snapshots")


def _plan_tables(files, names, as_of: AsOf | None, memory: int | None) -> dict[str, pa.Table]:
    """`names` (of PLAN_TABLES) run by DuckDB in this process, within `memory` bytes (-1:
    doc_budget(); None: no limit)."""
    if not names:
        return {}
    frames = duck.DuckFrames(files, as_of, doc_budget() if memory == -1 else memory)
    try:
        return {name: frames.table(name) for name in names}
    finally:
        frames.close()


def _state_tables(files, chunk_rows, as_of: AsOf | None, memory: int | None) -> dict[str, pa.Table]:
    out = _replay_dcp(files, reader.capture_ranks(files), chunk_rows, as_of, memory, True, False)
    return {name: out[name] for name in STATE_TABLES}


# rows per DCP chunk: a reading thread holds about three times a chunk's columns (measured
# 10M frames, 100k documents: peak RSS 64k-row chunks 350 MiB, 128k 430 MiB, 256k 500 MiB)
DCP_CHUNK_ROWS = 1 << 16


class _OverBudget(DcptoolError):
    """The documents of a pass outgrew the memory budget."""

    def __init__(self, done: float, nbytes: int, vbuckets: np.ndarray):
        # the share of the frames read, the store's bytes, the vbuckets seen
        self.done, self.nbytes, self.vbuckets = done, nbytes, vbuckets


def doc_budget() -> int | None:
    """Bytes the documents of one pass may hold (DCPTOOL_REPLAY_MEMORY, e.g. `2G`; `0`: no
    limit); by default a quarter of the machine's memory."""
    given = os.environ.get("DCPTOOL_REPLAY_MEMORY", "").strip()
    if given:
        text = given.upper().removesuffix("B")
        scale = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}.get(text[-1:], 1)
        try:
            value = int(float(text.rstrip("KMGT") or "x") * scale)
        except (ValueError, OverflowError):
            value = -1
        if value < 0:
            raise ValueError(f"DCPTOOL_REPLAY_MEMORY={given!r}: not a size (like 512M or 4G)")
        return value or None
    try:
        return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE") // 4
    except (ValueError, OSError, AttributeError):
        return None


def _chunks(t: pa.Table, rows: int) -> Iterator[pa.Table]:
    for s in range(0, t.num_rows, rows):
        yield t.slice(s, rows)


_DONE = object()


def _pipeline(parts: Iterator, work: Callable, chunk_rows: int, ahead: int = 4) -> Iterator:
    """work(chunk) for each chunk of each part (pos, read), yielded in order. A thread reads
    the chunks one after the other, two more work on them, and the caller takes the results;
    at most `ahead` chunks are read and not yet taken, so memory holds a few chunks whatever
    the size of a part (pyarrow and numpy release the GIL, so the threads use the cores)."""
    cancel = threading.Event()
    results: queue.Queue = queue.Queue(ahead)
    pool = ThreadPoolExecutor(2, thread_name_prefix="dcptool-replay")

    def put(item) -> bool:
        while not cancel.is_set():
            try:
                results.put(item, timeout=0.2)
                return True
            except queue.Full:
                continue
        return False

    def read_all() -> None:
        try:
            for pos, read in parts:
                for t in read():
                    for c in _chunks(t, chunk_rows):
                        c = c.append_column("_seq", pa.array(np.arange(pos, pos + c.num_rows, dtype=np.int64)))
                        pos += c.num_rows
                        if not put(pool.submit(work, c)):
                            return
            put(_DONE)
        except BaseException as exc:   # an unreadable file: raised on the consuming thread
            put(exc)

    reader_thread = threading.Thread(target=read_all, name="dcptool-read", daemon=True)
    reader_thread.start()
    try:
        while True:
            item = results.get()
            if item is _DONE:
                return
            if isinstance(item, BaseException):
                raise item
            yield item.result()
    finally:
        cancel.set()
        pool.shutdown(wait=False, cancel_futures=True)


def _replay_dcp(files, ranks, chunk_rows, as_of: AsOf | None = None, budget: int | None = -1,
                snapshots: bool = True, history: bool = True) -> dict[str, pa.Table]:
    """The DCP tables. The documents of one pass over the capture must fit in `budget` bytes
    (-1: doc_budget()); when they outgrow it the vbuckets are split into ranges, each
    replayed in a pass of its own (every rule is per vbucket), and the tables concatenated."""
    budget = doc_budget() if budget == -1 else budget
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

    with _engine_pool():
        return _replay_passes(files, rollbacks, chunk_rows, as_of, budget, snapshots, history)


@contextlib.contextmanager
def _engine_pool():
    """pyarrow's jemalloc pool while the engine runs, where there is one: with the threads
    allocating and freeing chunk after chunk it keeps a quarter less memory than mimalloc
    (measured 10M frames: peak RSS 280 MiB against 350), at the same speed."""
    try:
        pool = pa.jemalloc_memory_pool()
    except (NotImplementedError, AttributeError):
        yield
        return
    before = pa.default_memory_pool()
    pa.set_memory_pool(pool)
    try:
        yield
    finally:
        pa.set_memory_pool(before)


def _replay_passes(files, rollbacks, chunk_rows, as_of, budget, snapshots, history=True) -> dict[str, pa.Table]:
    ranges, results = [(0, 1 << 16)], []
    while ranges:
        lo, hi = ranges.pop(0)
        try:
            results.append(_dcp_pass(files, rollbacks, chunk_rows, as_of, (lo, hi), budget if hi - lo > 1 else None,
                                     snapshots, history))
        except _OverBudget as over:
            ranges[:0] = _split(lo, hi, over.vbuckets, over.nbytes / max(over.done, 1e-3) / budget * 1.5)
    if len(results) == 1:
        return results[0]
    # every table's key starts with the vbucket: ranges in order concatenate in canonical order
    return {name: pa.concat_tables([r[name] for r in results]).combine_chunks() for name in results[0]}


def _split(lo: int, hi: int, seen: np.ndarray, need: float) -> list[tuple[int, int]]:
    """[lo, hi) as about `need` ranges (at least 2), each smaller than it: cut between the
    vbuckets seen so far (`seen`, sorted) so that each range holds as many of them."""
    seen = seen[(seen >= lo) & (seen < hi)]
    if len(seen) == 1:            # one vbucket alone (a range of one runs whatever its size)
        v = int(seen[0])
        cuts = [lo, v, v + 1, hi]
    elif len(seen) == 0:
        cuts = [lo, (lo + hi) // 2, hi]
    else:
        n = int(min(len(seen), max(2, math.ceil(need))))
        cuts = [lo] + [int(seen[len(seen) * i // n]) for i in range(1, n)] + [hi]
    return [(a, b) for a, b in zip(cuts[:-1], cuts[1:]) if b > a]


def _dcp_pass(files, rollbacks: pa.Table, chunk_rows, as_of: AsOf | None, vbuckets: tuple[int, int],
              budget: int | None, snapshots: bool = True, history: bool = True) -> dict[str, pa.Table]:
    """One pass over every vbucket frame, in order, chunk by chunk: worker threads read row
    groups and do the stateless part of the work on them (DcpState.prepare) ahead of the
    stateful part on this thread (DcpState.apply), for the vbuckets lo <= vb < hi."""
    lo, hi = vbuckets
    # the columns the rules read (rollbacks are known already; snapshots only when tracked)
    state_cols = [c for c in DCP_STATE_COLUMNS if c != "rollback_seqno"
                  and (snapshots or history or not c.startswith("snap_"))]
    cols = list(dict.fromkeys(DCP_FILTER_COLUMNS + state_cols))
    whole = vbuckets == (0, 1 << 16)
    if not whole:
        vb = as_numpy(rollbacks.column("vbucket"), fill=0, dtype=np.int64)
        rollbacks = rollbacks.filter(pa.array((vb >= lo) & (vb < hi)))

    def parts():
        pos = 0
        for rows, read in reader.iter_capture_parts(files, cols, batch_rows=chunk_rows):
            yield pos, read
            pos += rows

    def prepare(chunk: pa.Table):
        keep = dcp_vbucket_frames(chunk)
        if as_of:
            keep &= as_of.mask(chunk)
        if not whole:
            vb = as_numpy(chunk.column("vbucket"), fill=0, dtype=np.int64)   # null: not a vbucket frame
            keep &= (vb >= lo) & (vb < hi)
        n = chunk.num_rows
        if not keep.all():
            chunk = chunk.filter(pa.array(keep))
        return n, state.prepare(chunk.select(state_cols + ["_seq"])), hist.prepare(chunk) if hist else None

    state = DcpState(rollbacks, snapshots)
    hist = HistoryState(state._undone_by) if history else None   # the `history` table (replay/rules/history.py)
    total = _known_rows(files) if budget else 0
    seen = 0
    for rows, prepared, hist_part in _pipeline(parts(), prepare, chunk_rows):
        state.apply(prepared)
        if hist:
            hist.apply(hist_part)
        seen += rows
        if budget and state.docs.n and state.docs.nbytes() > budget:
            raise _OverBudget(seen / total if total else 0.5, state.docs.nbytes(), np.flatnonzero(state.seen))
    out = state.finish()
    if hist:
        out["history"] = hist.finish()
    return out


def _known_rows(files) -> int:
    """Rows of the capture by the Parquet footers (0: unknown, a segment is in progress)."""
    try:
        return sum(reader.footer(f.path).num_rows for f in files if not f.in_progress) \
            if not any(f.in_progress for f in files) else 0
    except (OSError, pa.ArrowException):
        return 0


def _replay_synapse(files, ranks, tables=None, chunk_rows: int = CHUNK_ROWS) -> dict[str, pa.Table]:
    """Every Synapse table but `frames`, in one pass over the capture in chunks of
    `chunk_rows` (replay/rules/synapse_stream.py); `rows` only when `tables` asks for it."""
    from dcptool.replay.rules.synapse_stream import lazy_results
    return lazy_results(files, ranks, tables, chunk_rows)
