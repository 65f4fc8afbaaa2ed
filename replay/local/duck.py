"""The in-process SQL engine: DuckDB runs the plans of replay/rules/plans.py (the same
definitions Spark runs) over the capture's Parquet, and hands the results over as Arrow, or
writes a plan table to a Parquet file itself (`write`: `replay -o DIR`, the path that loads
neither pyarrow nor numpy; this module loads them only when a result is handed over as Arrow
or a segment in progress is converted).

`DuckFrames.document_counts` gives `vbuckets` its live / deleted / expired counts (a GROUP BY
over the same `documents` plan). A `DuckFrames` is one DuckDB connection with two views: `frames` (every frame: the capture
columns, `ts` as bigint nanoseconds, `_rank` and `_seq` as plans.py describes) and
`vb_frames` (the vbucket frames, the `--as-of` cut applied, and `_cas_bits`). In-progress
segments are converted to Parquet first (their complete batches, reader.parquet_paths) in a
temporary directory, which also holds DuckDB's spill files; `close` removes it.

Memory: DuckDB's `memory_limit` is DCPTOOL_REPLAY_MEMORY (doc_budget: a quarter of the
machine by default); past it DuckDB spills to that directory. Threads: DuckDB's default (every
core). External access is off once the views exist (`enable_external_access=false`, then the
configuration locked), so a query on the connection reads nothing but the capture and writes
nothing but the files named as `outputs`. The session's time zone is UTC, so a bigint of
nanoseconds cast to TIMESTAMPTZ_NS is that instant whatever the machine's zone."""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import tempfile
from typing import TYPE_CHECKING, Iterator

from dcptool.protocol.errors import DcptoolError, Interrupted
from dcptool.replay.rules import bodies, dcp_names, plans
from dcptool.replay.rules.table_types import PLAN_COLUMNS, PLAN_KEYS
from dcptool.replay.store import discovery, footers
from dcptool.replay.store.capture_errors import CaptureError

if TYPE_CHECKING:      # pyarrow is loaded only where a result is handed over as Arrow
    import pyarrow as pa

D = plans.DUCKDB
# the least memory_limit given to DuckDB: below it a hash aggregate of a few thousand groups
# already runs out (DuckDB spills, but keeps a working set of its own)
MIN_MEMORY = 128 << 20
# captures of at most this many frames are read into a DuckDB table once, for all the plans
SMALL_ROWS = 1 << 16
# rows per record batch of a streamed table (DuckFrames.batches), and per row group of a file
# DuckDB writes (DuckFrames.write)
BATCH_ROWS = 1 << 17


class DuckFrames:
    """One capture's frames in DuckDB (see the module)."""

    def __init__(self, files: list, as_of=None, memory: int | None = None, outputs: tuple = (),
                 one_query: bool = False):
        """`outputs`: the files `write` may write (absolute UTF-8 paths). `one_query`: the caller
        runs one plan only (restore), so a small capture is not first copied into memory for
        the plans to share (0.15-0.25 s of a 20k-document restore)."""
        import duckdb
        self.files = files
        self.ranks = discovery.capture_ranks(files)
        self.facts: plans.PlanFacts | None = None
        self.tmp = tempfile.mkdtemp(prefix="dcptool-duckdb-")
        try:
            paths = _utf8_paths([os.path.abspath(p) for p in _parquet_paths(files, self.tmp)], self.tmp)
            config: dict[str, str | bool | int | float | list[str]] = {"temp_directory": os.path.join(self.tmp, "spill")}
            if memory:
                config["memory_limit"] = f"{max(int(memory), MIN_MEMORY) >> 20}MiB"
            self.con = duckdb.connect(":memory:", config=config)
            # DuckDB's own progress bar would write to the terminal: stdout carries only data
            self.con.execute("SET enable_progress_bar = false")
            # memory DuckDB frees in bulk (a hash table, the aggregate's states) goes back to the
            # system past 32 MiB, not kept by its allocator: the Parquet writer and the checksum
            # that read the result stream then fit under the query's peak (measured 1M frames,
            # 100k documents: peak RSS 19 MiB less than no flush). 32 MiB rather than 1 MiB:
            # the bodies' blocks were returned and faulted in again (1M frames with bodies: 0.9
            # -> 0.35 s of system CPU, peak RSS 268 -> 300-312 MiB; 300k bodies of 512 bytes:
            # 2.2-2.4 -> 1.4-1.7 s, 796 -> 806-820 MiB)
            with contextlib.suppress(duckdb.Error):   # a setting of DuckDB >= 1.2
                self.con.execute("SET allocator_bulk_deallocation_flush_threshold = '32MiB'")
            with contextlib.suppress(duckdb.Error):   # without ICU, TIMESTAMPTZ is UTC already
                self.con.execute("SET TimeZone = 'UTC'")
            self._views(paths, as_of)
            # the views read these files when a query runs: they stay readable, and the
            # outputs writable, nothing else
            self.con.execute("SET allowed_paths = " + _list(paths + list(outputs)))
            self.con.execute("SET enable_external_access = false")
            self.con.execute("SET lock_configuration = true")
            self.source = "vb_frames"
            if not one_query and _rows(paths) <= SMALL_ROWS:
                # a small capture is read once into memory: each plan then scans that table,
                # not the files again (most of a small replay is per-query work)
                self.con.execute("CREATE TEMP TABLE vb_small AS SELECT * FROM vb_frames")
                self.source = "vb_small"
        except duckdb.Error as exc:
            self.close()
            raise self._capture_error(exc) from exc
        except BaseException:
            self.close()
            raise

    def _views(self, paths: list[str], as_of) -> None:
        listed = _list(paths)
        if len(self.ranks) <= 1:
            rank = "CAST(0 AS BIGINT)"
        else:
            rank = ("CAST(CASE capture_id " + " ".join(f"WHEN {D.string(c)} THEN {r}" for c, r in self.ranks.items())
                    + " END AS BIGINT)")
        self.con.execute(
            "CREATE VIEW frames AS SELECT * REPLACE (epoch_ns(ts) AS ts), "
            f"{rank} AS _rank, {rank} * {1 << plans.SEQ_SHIFT} + frame_no AS _seq "
            f"FROM read_parquet({listed}, union_by_name = true)")
        cut = f" AND ({plans.as_of_sql(as_of)})" if as_of else ""
        ops = ", ".join(f"'{op}'" for op in dcp_names.VB_OPS)
        self.con.execute(
            "CREATE VIEW vb_frames AS SELECT *, cas AS _cas_bits FROM frames WHERE direction = 'in' "
            f"AND vbucket IS NOT NULL AND decode_error IS NULL AND op IN ({ops}){cut}")

    def arrow(self, sql: str) -> "pa.Table":
        with self._errors():
            rel = self.con.sql(sql)
            fetch = getattr(rel, "to_arrow_table", None) or rel.arrow
            return fetch()

    @contextlib.contextmanager
    def _errors(self):
        """DuckDB's errors as ours: out of memory, or the capture's own one line."""
        import duckdb
        try:
            yield
        except duckdb.InterruptException as exc:   # a stop signal: not the capture's fault
            raise Interrupted(signal.SIGINT) from exc
        except duckdb.OutOfMemoryException as exc:
            raise ReplayMemoryError(f"replay: out of memory ({_first_line(exc)}); raise DCPTOOL_REPLAY_MEMORY "
                                    "(or 0: no limit)") from exc
        except duckdb.Error as exc:
            raise self._capture_error(exc) from exc

    def _capture_error(self, exc: BaseException) -> DcptoolError:
        """DuckDB names no file: the reader's own one line names the damaged segment."""
        from dcptool.replay.store import reader
        for f in self.files:
            try:
                reader.read_file(f)
            except reader.CaptureError as damaged:
                return damaged
        return CaptureError(f"replay: {_first_line(exc)}")

    def _facts(self) -> plans.PlanFacts:
        if self.facts is None:
            # the ops the vbucket frames may hold, asked of DuckDB: its memory is the query's to
            # reuse (pyarrow's reading of the `op` dictionaries, spark/arrow.py ops_present, left
            # 20 MiB in pyarrow's pool at 1M frames). Over the files, every frame's op: a
            # superset is as true ("may hold") and reads one column, not the view's five (1M
            # frames: 0.015 s against 0.03 s); a small capture's table is in memory already
            # The same pass tells whether a change may carry Snappy or xattrs (the datatype
            # column too): only then do the bodies call Python (bodies.FUNCTION)
            source = "frames" if self.source == "vb_frames" else self.source
            with self._errors():
                found = self.con.sql(f"SELECT op, bool_or((coalesce(datatype, 0) & {bodies.CODED}) <> 0) "
                                     f"FROM {source} GROUP BY op").fetchall()
            coded = any(flag for op, flag in found if op in plans.BODY_OPS)
            self.facts = plans.PlanFacts.of(self.files, {op for op, _ in found}, coded)
            if coded:
                self._body_function()
        return self.facts

    def _body_function(self) -> None:
        """bodies.split as DuckDB's `dcp_body(value, datatype)`, a Python scalar function
        called only for the rows whose datatype says Snappy or xattrs (DuckDB evaluates a CASE
        branch for its rows only). Registering it loads numpy (DuckDB's Python functions do):
        the `-o` path of a capture without either loads neither numpy nor pyarrow."""
        with self._errors():
            # a native function (DuckDB's default type): called a row at a time with Python values
            self.con.create_function(bodies.FUNCTION, bodies.split_struct, ["BLOB", "INTEGER"],
                                     "STRUCT(value BLOB, xattrs VARCHAR)", side_effects=False)

    def document_counts(self) -> "pa.Table":
        """(vbucket, live, deleted, expired): the documents of each vbucket in each state, a
        GROUP BY over the `documents` plan (for `vbuckets`, dcp_rules.with_document_counts)."""
        sql = plans.table_sql(D, "documents", self.source, self._facts(), bodies=False)
        states = ", ".join(f"count(*) FILTER (WHERE state = '{s}') AS {s}" for s in dcp_names.DOC_STATES.values())
        return self.arrow(f"SELECT vbucket, {states} FROM ({sql}) _d GROUP BY vbucket")

    def table(self, name: str) -> "pa.Table":
        """One of the plans' tables, canonical (replay/rules/tables.py)."""
        from dcptool.replay.rules import tables as T
        sql = self._sorted_sql(name)
        if sql is None:
            return T.schema_of("dcp", name).empty_table()
        return T.canonical("dcp", name, self.arrow(sql), presorted=True)

    def batches(self, name: str, rows: int | None = None) -> "Iterator[pa.RecordBatch]":
        """`table(name)` as canonical record batches of about `rows` rows (BATCH_ROWS), in
        order: DuckDB's sorted result streamed, never the whole table in this process at once."""
        from dcptool.replay.rules import tables as T
        sql = self._sorted_sql(name)
        if sql is None:
            return
        with self._errors():
            rel = self.con.sql(sql)
            stream = getattr(rel, "to_arrow_reader", None) or rel.fetch_record_batch
            for batch in stream(rows or BATCH_ROWS):
                yield T.canonical_batch("dcp", name, batch)

    def _sorted_sql(self, name: str) -> str | None:
        """The plan of `name` sorted by DuckDB (in parallel, spilling when it must) in the
        canonical order: the table's key, nulls first, blobs bytewise; None: the table is empty."""
        return self._plan_sql(name, sort=True)

    def _plan_sql(self, name: str, sort: bool = False) -> str | None:
        """The plan of `name`, unsorted, or `sort`: in the canonical order; None: the table is
        empty."""
        facts = self._facts()
        if name in ("undone", "rollbacks") and not facts.rollbacks:
            # no ROLLBACK answer by the Parquet statistics: both are empty, no query to plan
            return None
        return plans.table_sql(D, name, self.source, facts, order=_order(name) if sort else None)

    def write(self, name: str, path: str) -> int:
        """The plan table `name` written by DuckDB to the Parquet file `path` (one of the
        `outputs`), its rows: the canonical table (sorted, each column cast to its type of
        replay/rules/table_types.py), zstd, BATCH_ROWS rows a row group; read back by pyarrow
        it equals `table(name)`. A file left partial by a failed query is removed."""
        sql = self._plan_sql(name, sort=True)     # the casts below keep its order
        columns = PLAN_COLUMNS[name]
        if sql is None:      # no rows: the schema alone
            body = ("SELECT " + ", ".join(f"CAST(NULL AS {t}) AS {c}" for c, t in columns)
                    + " WHERE false")
        else:
            with self._errors():
                given = {r[0]: r[1] for r in self.con.execute(f"DESCRIBE {sql}").fetchall()}
            body = f"SELECT {', '.join(_cast(c, t, given.get(c, t)) for c, t in columns)} FROM ({sql}) _t"
        copy = (f"COPY ({body}) TO {D.string(path)} (FORMAT parquet, COMPRESSION zstd, COMPRESSION_LEVEL 1, "
                f"ROW_GROUP_SIZE {BATCH_ROWS}, USE_TMP_FILE false)")
        try:
            with self._errors():
                (rows,), = self.con.execute(copy).fetchall()
        except BaseException:
            with contextlib.suppress(OSError):
                os.remove(path)
            raise
        return int(rows)

    def close(self) -> None:
        con = getattr(self, "con", None)
        if con is not None:
            con.close()
            del self.con       # closed: no connection (getattr above finds none on a second close)
        shutil.rmtree(self.tmp, ignore_errors=True)


def is_interrupt(exc: BaseException) -> bool:
    """Whether `exc` is DuckDB's answer to a signal during a query. Its Python client checks
    for signals as a query runs; when a handler raised (Ctrl-C's KeyboardInterrupt, or
    cli/process.py's stop signals), it interrupts the query and raises RuntimeError("Query
    interrupted") in place of what the handler raised; an interrupt from another thread
    (`interrupt()`) is an InterruptException."""
    import duckdb
    return isinstance(exc, duckdb.InterruptException) or (
        type(exc) is RuntimeError and str(exc).strip() == "Query interrupted")


class ReplayMemoryError(DcptoolError):
    """DuckDB needed more than its memory limit (DCPTOOL_REPLAY_MEMORY) and could not spill."""


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__


def _utf8_paths(paths: list, tmp: str) -> list[str]:
    """DuckDB takes paths as UTF-8 text: a path that is not (bytes, or a str carrying the
    surrogates of undecodable bytes, as under a C locale) is read through a symlink of an
    ASCII name in the temporary directory."""
    out = []
    for i, p in enumerate(paths):
        try:
            text = p.decode("utf-8") if isinstance(p, bytes) else p
            text.encode("utf-8")
        except UnicodeError:
            text = os.path.join(tmp, f"segment-{i}.parquet")
            os.symlink(os.fsencode(p), text)
        out.append(text)
    return out


def _rows(paths: list[str]) -> int:
    return sum(footers.num_rows(p) for p in paths)


def _parquet_paths(files: list, tmp: str) -> list:
    """The Parquet files of `files`: segments in progress converted in `tmp` (pyarrow's work,
    loaded only then: reader.parquet_paths)."""
    if not any(f.in_progress for f in files):
        return [f.path for f in files]
    from dcptool.replay.store import reader
    return reader.parquet_paths(files, tmp)


def _order(name: str) -> str:
    return ", ".join(f"{k} NULLS FIRST" for k in PLAN_KEYS[name])


def _cast(column: str, to: str, given: str) -> str:
    """`column` as DuckDB type `to`, nullable in the file as in pyarrow's (DuckDB writes a
    column it knows holds no null, such as a key the view filters on, as REQUIRED: the CASE
    hides that); a time as bigint nanoseconds (the plans' `ts`) becomes that instant (the
    session's zone is UTC)."""
    value = column
    if to == "TIMESTAMPTZ_NS" and given in ("BIGINT", "HUGEINT", "INTEGER"):
        value = f"CAST(make_timestamp_ns(CAST({column} AS BIGINT)) AS {to})"
    elif to != given:
        value = f"CAST({column} AS {to})"
    return f"CASE WHEN {column} IS NULL THEN NULL ELSE {value} END AS {column}"


def doc_budget() -> int | None:
    """Bytes DuckDB's memory limit allows (DCPTOOL_REPLAY_MEMORY, e.g. `2G`; `0`: no
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


def _list(paths: list[str]) -> str:
    return "[" + ", ".join(D.string(p) for p in paths) + "]"


PLAN_TABLES = plans.PLAN_TABLES
