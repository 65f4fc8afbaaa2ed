"""The in-process SQL engine: DuckDB runs the plans of replay/rules/plans.py (the same
definitions Spark runs) over the capture's Parquet, and hands the results over as Arrow.

`DuckFrames.document_counts` gives `vbuckets` its live / deleted / expired counts (a GROUP BY
over the same `documents` plan). A `DuckFrames` is one DuckDB connection with two views: `frames` (every frame: the capture
columns, `ts` as bigint nanoseconds, `_rank` and `_seq` as plans.py describes) and
`vb_frames` (the vbucket frames, the `--as-of` cut applied, and `_cas_bits`). In-progress
segments are converted to Parquet first (their complete batches, reader.parquet_paths) in a
temporary directory, which also holds DuckDB's spill files; `close` removes it.

Memory: DuckDB's `memory_limit` is DCPTOOL_REPLAY_MEMORY (engine.doc_budget: a quarter of the
machine by default); past it DuckDB spills to that directory. Threads: DuckDB's default (every
core). External access is off once the views exist (`enable_external_access=false`, then the
configuration locked), so a query on the connection reads nothing but the capture."""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
from typing import Iterator

import pyarrow as pa

from dcptool.protocol.errors import DcptoolError
from dcptool.replay.rules import dcp as dcp_rules, plans, tables as T
from dcptool.replay.store import reader

D = plans.DUCKDB
# the least memory_limit given to DuckDB: below it a hash aggregate of a few thousand groups
# already runs out (DuckDB spills, but keeps a working set of its own)
MIN_MEMORY = 128 << 20
# captures of at most this many frames are read into a DuckDB table once, for all the plans
SMALL_ROWS = 1 << 16
# rows per record batch of a streamed table (DuckFrames.batches; one row group each in -o files)
BATCH_ROWS = 1 << 17


class DuckFrames:
    """One capture's frames in DuckDB (see the module)."""

    def __init__(self, files: list, as_of=None, memory: int | None = None):
        import duckdb
        self.files = files
        self.ranks = reader.capture_ranks(files)
        self.facts = None
        self.tmp = tempfile.mkdtemp(prefix="dcptool-duckdb-")
        try:
            paths = _utf8_paths([os.path.abspath(p) for p in reader.parquet_paths(files, self.tmp)], self.tmp)
            config = {"temp_directory": os.path.join(self.tmp, "spill")}
            if memory:
                config["memory_limit"] = f"{max(int(memory), MIN_MEMORY) >> 20}MiB"
            self.con = duckdb.connect(":memory:", config=config)
            # DuckDB's own progress bar would write to the terminal: stdout carries only data
            self.con.execute("SET enable_progress_bar = false")
            # memory DuckDB frees in bulk (a hash table, the aggregate's states) goes back to the
            # system at once, not kept by its allocator: the Parquet writer and the checksum
            # that read the result stream then fit under the query's peak (measured 1M frames,
            # 100k documents: peak RSS 19 MiB less)
            with contextlib.suppress(duckdb.Error):   # a setting of DuckDB >= 1.2
                self.con.execute("SET allocator_bulk_deallocation_flush_threshold = '1MiB'")
            self._views(paths, as_of)
            # the views read these files when a query runs: they stay readable, nothing else
            self.con.execute("SET allowed_paths = " + _list(paths))
            self.con.execute("SET enable_external_access = false")
            self.con.execute("SET lock_configuration = true")
            self.source = "vb_frames"
            if _rows(paths) <= SMALL_ROWS:
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
        ops = ", ".join(f"'{op}'" for op in dcp_rules.VB_OPS)
        self.con.execute(
            "CREATE VIEW vb_frames AS SELECT *, cas AS _cas_bits FROM frames WHERE direction = 'in' "
            f"AND vbucket IS NOT NULL AND decode_error IS NULL AND op IN ({ops}){cut}")

    def arrow(self, sql: str) -> pa.Table:
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
        except duckdb.OutOfMemoryException as exc:
            raise ReplayMemoryError(f"replay: out of memory ({_first_line(exc)}); raise DCPTOOL_REPLAY_MEMORY "
                                    "(or 0: no limit)") from exc
        except duckdb.Error as exc:
            raise self._capture_error(exc) from exc

    def _capture_error(self, exc: BaseException) -> DcptoolError:
        """DuckDB names no file: the reader's own one line names the damaged segment."""
        for f in self.files:
            try:
                reader.read_file(f)
            except reader.CaptureError as damaged:
                return damaged
        return reader.CaptureError(f"replay: {_first_line(exc)}")

    def _facts(self) -> plans.PlanFacts:
        if self.facts is None:
            # the ops the vbucket frames hold, asked of DuckDB: its memory is the query's to reuse
            # (pyarrow's reading of the `op` dictionaries, spark/arrow.py ops_present, left
            # 20 MiB in pyarrow's pool at 1M frames)
            with self._errors():
                ops = {op for (op,) in self.con.sql(f"SELECT DISTINCT op FROM {self.source}").fetchall()}
            self.facts = plans.PlanFacts.of(self.files, ops)
        return self.facts

    def document_counts(self) -> pa.Table:
        """(vbucket, live, deleted, expired): the documents of each vbucket in each state, a
        GROUP BY over the `documents` plan (for `vbuckets`, dcp_rules.with_document_counts)."""
        sql = plans.table_sql(D, "documents", self.source, self._facts())
        states = ", ".join(f"count(*) FILTER (WHERE state = '{s}') AS {s}" for s in dcp_rules.DOC_STATES.values())
        return self.arrow(f"SELECT vbucket, {states} FROM ({sql}) _d GROUP BY vbucket")

    def table(self, name: str) -> pa.Table:
        """One of the plans' tables, canonical (replay/rules/tables.py)."""
        sql = self._sorted_sql(name)
        if sql is None:
            return T.schema_of("dcp", name).empty_table()
        return T.canonical("dcp", name, self.arrow(sql), presorted=True)

    def batches(self, name: str, rows: int | None = None) -> Iterator[pa.RecordBatch]:
        """`table(name)` as canonical record batches of about `rows` rows (BATCH_ROWS), in
        order: DuckDB's sorted result streamed, never the whole table in this process at once."""
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
        self._facts()
        if name in ("undone", "rollbacks") and not self.facts.rollbacks:
            # no ROLLBACK answer by the Parquet statistics: both are empty, no query to plan
            return None
        sql = plans.table_sql(D, name, self.source, self.facts)
        keys = ", ".join(f"{k} NULLS FIRST" for k in T.table_specs("dcp")[name][1])
        return f"SELECT * FROM ({sql}) _t ORDER BY {keys}"

    def close(self) -> None:
        con = getattr(self, "con", None)
        if con is not None:
            con.close()
            self.con = None
        shutil.rmtree(self.tmp, ignore_errors=True)


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
    return sum(reader.footer(p).num_rows for p in paths)


def _list(paths: list[str]) -> str:
    return "[" + ", ".join(D.string(p) for p in paths) + "]"


PLAN_TABLES = plans.PLAN_TABLES
