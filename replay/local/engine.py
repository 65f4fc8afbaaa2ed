"""The in-process engine. The relational tables of REPLAY.md (`documents`, `undone`,
`rollbacks`, `failover`, `history`) are the SQL of replay/rules/plans.py, run by DuckDB
(replay/local/duck.py: the same definitions Spark runs); the tables of the per-vbucket rules
(`vbuckets`, `snapshots`) and `topology` come from the shared rule modules over the capture in
frame order, in bounded memory; the Synapse tables from replay/rules/synapse_stream.py.

The per-vbucket pass: the rollback answers are read first (a pass skipped when the Parquet
statistics show none). One thread reads the chunks in order, two prepare them
(DcpState.prepare: the work that needs no state) and the caller's thread applies them in
order (DcpState.apply), with a few chunks in flight at most (`_pipeline`). The pass tracks no
document: its state grows with vbuckets and snapshots, not documents, so it runs in one pass
whatever the memory budget. `vbuckets`' live / deleted / expired counts are a GROUP BY over
DuckDB's `documents` (duck.DuckFrames.document_counts), or over the `documents` table itself
when the replay built it already.
Connections are told apart by `_conn` (capture rank << 32 | conn): a reconnect is a change
of `_conn`."""

from __future__ import annotations

import contextlib
import queue
import threading
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Callable, Iterator

import numpy as np
import pyarrow as pa

from dcptool.replay.local import duck
from dcptool.replay.local.duck import doc_budget  # noqa: F401 (engine.doc_budget: the name callers use)
from dcptool.replay.rules import tables as T
from dcptool.replay.rules.as_of import AS_OF_COLUMNS, AsOf
from dcptool.replay.rules.columns import (
    CHUNK_ROWS,
    as_numpy,
    as_strings,
    ordered_frames,
)
from dcptool.replay.rules.dcp_vbuckets import (
    DCP_FILTER_COLUMNS,
    DCP_ROLLBACK_COLUMNS,
    DCP_STATE_COLUMNS,
    DOC_STATES,
    DcpState,
    dcp_vbucket_frames,
    rollback_mask,
    with_document_counts,
)
from dcptool.replay.store import reader
from dcptool.replay.store.schema import capture_schema


@dataclass
class Replay:
    """Result of a replay: canonical pyarrow tables by name (frames read on demand)."""
    protocol: str
    files: list
    results: dict[str, pa.Table]
    as_of: AsOf | None = None
    memory: int | None = -1       # DCP: the budget of the replay (see replay_local)
    streaming: duck.DuckFrames | None = None   # the connection of stream()

    def names(self) -> list[str]:
        return T.table_names(self.protocol)

    def table(self, name: str) -> pa.Table:
        if name not in self.results and name == "topology" and self.protocol == "dcp":
            from dcptool.replay.rules.topology import (
                local_topology,  # read when asked for
            )
            self.results[name] = local_topology(self.files, as_of=self.as_of)
        if name not in self.results and name == "lag":
            from dcptool.replay.rules import lag  # read when asked for
            self.results[name] = (lag.local_lag(self.files, as_of=self.as_of) if self.protocol == "dcp"
                                  else lag.local_synapse_lag(self.files))
        if name not in self.results and self.protocol == "dcp" and name in PLAN_TABLES:
            # a table the replay was told would not be asked for: DuckDB runs its plan now
            self.results.update(_plan_tables(self.files, [name], self.as_of, self.memory))
        if name not in self.results and self.protocol == "dcp" and name in STATE_TABLES:
            self.results.update(_state_tables(self.files, DCP_CHUNK_ROWS, self.as_of, self.memory,
                                              self.results.get("documents")))
        if name not in self.results:
            if name != "frames":
                raise KeyError(name)
            frames = reader.read_capture_table(self.files)
            if self.as_of:
                frames = frames.filter(pa.array(self.as_of.mask(frames)))
            self.results[name] = T.canonical(self.protocol, "frames", frames)
        return self.results[name]

    def stream(self, name: str) -> pa.Table | T.Batches:
        """`table(name)`, or for a DCP plan table not built yet, its canonical record batches
        as DuckDB streams its sorted result (T.Batches, read once): written and checksummed
        batch by batch (replay/results.py write_tables), never whole in memory. The tables
        streamed share one DuckDB connection, which `close` ends."""
        if name in self.results or self.protocol != "dcp" or name not in PLAN_TABLES:
            return self.table(name)
        if self.streaming is None:
            self.streaming = duck.DuckFrames(self.files, self.as_of, doc_budget() if self.memory == -1 else self.memory)
        return T.Batches(T.schema_of("dcp", name), self.streaming.batches(name))

    def close(self) -> None:
        if self.streaming is not None:
            self.streaming.close()
            self.streaming = None


def replay_local(files: list, chunk_rows: int | None = None, tables=None, as_of: AsOf | None = None,
                 memory: int | None = -1, stream: bool = False) -> Replay:
    """`tables`: the names that will be asked for (None: any); Synapse skips building
    `rows` when it is not among them. `as_of` (DCP): only the frames it keeps count
    (replay/rules/as_of.py). `memory` (DCP): bytes the documents of one pass may hold (None: no
    limit; -1: doc_budget()): DuckDB's memory limit. `stream` (DCP): the plan tables are left
    for Replay.stream to hand on as DuckDB makes them (`documents` is built here all the same
    when `vbuckets` counts its states)."""
    protocol = reader.protocol_of(files)
    ranks = reader.capture_ranks(files)
    if protocol == "dcp":
        want = set(T.table_names("dcp") if tables is None else tables)
        built = [n for n in PLAN_TABLES if n in want and (not stream or (n == "documents" and "vbuckets" in want))]
        results = _plan_tables(files, built, as_of or None, memory)
        if want & set(STATE_TABLES):
            results.update(_state_tables(files, chunk_rows or DCP_CHUNK_ROWS, as_of or None, memory,
                                         results.get("documents")))
        return Replay(protocol, files, results, as_of or None, memory)
    if as_of:
        raise ValueError("a point in time (--as-of) applies to DCP captures only")
    return Replay(protocol, files, _replay_synapse(files, ranks, tables, chunk_rows or CHUNK_ROWS))


# the tables DuckDB computes from the plans of replay/rules/plans.py (the ones Spark runs as SQL too)
PLAN_TABLES = duck.PLAN_TABLES
# the tables of the per-vbucket rules (DcpState, replay/rules/dcp_vbuckets.py), fed in frame order
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


def _state_tables(files, chunk_rows, as_of: AsOf | None, memory: int | None,
                  documents: pa.Table | None = None) -> dict[str, pa.Table]:
    """`vbuckets` and `snapshots`: the per-vbucket pass, and the document counts from
    `documents` when given (the same table), else from DuckDB's documents plan."""
    out = _replay_dcp(files, reader.capture_ranks(files), chunk_rows, as_of)
    if documents is not None:
        counts = document_counts(documents)
    else:
        frames = duck.DuckFrames(files, as_of, doc_budget() if memory == -1 else memory)
        try:
            counts = frames.document_counts()
        finally:
            frames.close()
    out["vbuckets"] = with_document_counts(out["vbuckets"], counts)
    return out


def document_counts(documents: pa.Table) -> pa.Table:
    """(vbucket, live, deleted, expired) of a `documents` table, as DuckFrames.document_counts."""
    vb = as_numpy(documents.column("vbucket"), dtype=np.int64)
    state = as_strings(documents.column("state")).to_numpy(zero_copy_only=False)
    counts = {name: np.bincount(vb[state == name], minlength=1 << 16) for name in DOC_STATES.values()}
    seen = np.flatnonzero(np.bincount(vb, minlength=1 << 16))
    return pa.table({"vbucket": pa.array(seen, pa.int64()),
                     **{name: pa.array(c[seen], pa.int64()) for name, c in counts.items()}})


# rows per DCP chunk: a reading thread holds about three times a chunk's columns (measured
# 10M frames, 100k documents: peak RSS 64k-row chunks 350 MiB, 128k 430 MiB, 256k 500 MiB)
DCP_CHUNK_ROWS = 1 << 16


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
        except BaseException as exc:   # noqa: BLE001 - an unreadable file: raised on the consuming thread
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


def _replay_dcp(files, ranks, chunk_rows, as_of: AsOf | None = None) -> dict[str, pa.Table]:
    """`vbuckets` (document counts 0) and `snapshots`: the rollback answers first, then one
    pass of the per-vbucket rules over the vbucket frames."""
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
        return _dcp_pass(files, rollbacks, chunk_rows, as_of)


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


def _dcp_pass(files, rollbacks: pa.Table, chunk_rows, as_of: AsOf | None) -> dict[str, pa.Table]:
    """One pass over every vbucket frame, in order, chunk by chunk: worker threads read row
    groups and do the stateless part of the work on them (DcpState.prepare) ahead of the
    stateful part on this thread (DcpState.apply). No document is tracked."""
    # the columns the rules read (rollbacks are known already)
    state_cols = [c for c in DCP_STATE_COLUMNS if c != "rollback_seqno"]
    cols = list(dict.fromkeys(DCP_FILTER_COLUMNS + state_cols))

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
        return state.prepare(chunk.select(state_cols + ["_seq"]))

    state = DcpState(rollbacks)
    for prepared in _pipeline(parts(), prepare, chunk_rows):
        state.apply(prepared)
    return state.finish()


def _replay_synapse(files, ranks, tables=None, chunk_rows: int = CHUNK_ROWS) -> dict[str, pa.Table]:
    """Every Synapse table but `frames`, in one pass over the capture in chunks of
    `chunk_rows` (replay/rules/synapse_stream.py); `rows` only when `tables` asks for it."""
    from dcptool.replay.rules.synapse_stream import lazy_results
    return lazy_results(files, ranks, tables, chunk_rows)
