"""Reading captures at rest: the rows of capture files (finished Parquet segments and
in-progress Arrow IPC streams) in the capture schema of replay/store/schema.py, in frame order
(started_at of the capture, capture_id, frame_no). Finding, describing and ordering the files
is replay/store/discovery.py (no pyarrow), whose names this module re-exports
(reader.find_captures, reader.CaptureFile ...).

An in-progress segment is an Arrow IPC *stream* file ending in `.arrows`; after a crash
its last message may be cut short, so it is read batch by batch and the truncated tail is
ignored."""

from __future__ import annotations

import functools
import os
from typing import Callable, Iterator

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.ipc as ipc
import pyarrow.parquet as pq

from dcptool.replay.store.capture_errors import (  # noqa: F401 (reader.CaptureError ...: the names callers use)
    CaptureError,
    NotACapture,
    UnsupportedFormat,
)
from dcptool.replay.store.discovery import (  # noqa: F401 (reader.find_captures ...: the names callers use)
    FINISHED_SUFFIX,
    CaptureFile,
    capture_ranks,
    describe,
    find_captures,
    null_by_statistics,
    order_key,
    parse_started,
    protocol_of,
    warn,
    without_covered,
)
from dcptool.replay.store.files import arrow_path, arrow_source, shown
from dcptool.replay.store.footers import footer, leaf_index, prefetch_footers  # noqa: F401 (footer, leaf_index: also for the engines)
from dcptool.replay.store.in_progress import InProgress, held_by_writer
from dcptool.replay.store.naming import IN_PROGRESS_SUFFIX
from dcptool.replay.store.run_reads import RUN_CACHE, SCANS, conform, first_line  # noqa: F401 (SCANS: for tests; conform: also for the checks)
from dcptool.replay.store.schema import capture_schema
from dcptool.replay.store.segment import dictionary_columns

_first_line = first_line


def schema_of(path: str, in_progress: bool) -> pa.Schema:
    """The Arrow schema of one segment (its columns and metadata)."""
    if in_progress:
        with pa.OSFile(arrow_path(path), "rb") as fh:
            return ipc.open_stream(fh).schema
    return footer(path).schema.to_arrow_schema()


def parquet_file(f: "CaptureFile", **kw) -> pq.ParquetFile:
    """A finished segment opened for reading, with its footer as already read."""
    return pq.ParquetFile(arrow_source(f.path), metadata=footer(f.path), **kw)


def _read_in_progress(path: str) -> pa.Table:
    """Every complete record batch of an in-progress segment; a torn tail is ignored."""
    ip = InProgress(path)
    if ip.schema is None:
        raise CaptureError(f"{shown(path)}: unreadable in-progress segment (no schema written)")
    batches = ip.read_all()
    damage = ip.damage()
    if damage and not held_by_writer(path):
        warn(f"{shown(path)}: {damage} (`dcptool verify` reports it; `capture --resume` keeps the file)")
    return pa.Table.from_batches(batches, schema=ip.schema)


def read_file(f: CaptureFile, columns: list[str] | None = None) -> pa.Table:
    """One segment in the capture schema (restricted to `columns`), rows in frame_no order."""
    full = capture_schema(f.protocol)
    schema = full if columns is None else pa.schema([full.field(c) for c in columns])
    try:
        if f.in_progress:
            table = _read_in_progress(f.path)
            table = table.select([c for c in schema.names if c in table.column_names])
        else:
            pf = parquet_file(f)
            present = set(pf.schema_arrow.names)
            table = pf.read(columns=[c for c in schema.names if c in present])
    except CaptureError:
        raise
    except (OSError, pa.ArrowException) as exc:
        raise CaptureError(f"{shown(f.path)}: unreadable ({_first_line(exc)})") from exc
    table = conform(table, schema)
    if "frame_no" in table.column_names and table.num_rows > 1:
        fn = table.column("frame_no")
        if not pc.all(pc.greater_equal(fn.slice(1), fn.slice(0, len(fn) - 1))).as_py():
            table = table.take(pc.sort_indices(fn))
    return table


_FRAME_RANGES: dict[tuple, tuple[int, int] | None] = {}


def frame_range(f: CaptureFile) -> tuple[int, int] | None:
    """(first, last) frame_no of a finished segment whose frame numbers strictly increase
    (empty: (-1, -1)), else None. Remembered per file version: a replay asks once per pass."""
    if f.in_progress:
        return None
    try:
        st = os.stat(f.path)
    except OSError as exc:
        raise CaptureError(f"{shown(f.path)}: unreadable ({_first_line(exc)})") from exc
    key = (f.path, st.st_size, st.st_mtime_ns)
    if key not in _FRAME_RANGES and footer(f.path).num_rows <= 1:
        rng = _one_row_range(f)         # no data to read: the statistics say it
        if rng is not None:
            _FRAME_RANGES[key] = rng
    if key not in _FRAME_RANGES:
        pf = parquet_file(f, pre_buffer=False)
        rng = None
        if "frame_no" in pf.schema_arrow.names:
            # batch by batch: the whole column of a long segment is 8 bytes a frame
            first = last = None
            rng = (-1, -1)
            for b in pf.iter_batches(batch_size=1 << 20, columns=["frame_no"], use_threads=False):
                fn = b.column(0)
                if fn.null_count or (len(fn) and last is not None and fn[0].as_py() <= last) or (
                        len(fn) > 1 and not pc.all(pc.greater(fn.slice(1), fn.slice(0, len(fn) - 1))).as_py()):
                    rng = None
                    break
                if len(fn):
                    first = fn[0].as_py() if first is None else first
                    last = fn[-1].as_py()
            if rng is not None and first is not None and last is not None:
                rng = (first, last)
        _FRAME_RANGES[key] = rng
    return _FRAME_RANGES[key]


def _one_row_range(f: CaptureFile) -> tuple[int, int] | None:
    """frame_range of a segment of at most one row, from its footer's statistics (None
    without them: the column is read)."""
    md = footer(f.path)
    if md.num_rows == 0:
        return (-1, -1)
    col = leaf_index(md, "frame_no")
    if col is None:
        return None
    for r in range(md.num_row_groups):
        if md.row_group(r).num_rows:
            st = md.row_group(r).column(col).statistics
            if st is not None and st.has_min_max and st.null_count == 0:
                return (int(st.min), int(st.max))
    return None


def may_have_values(files: list[CaptureFile], column: str) -> bool:
    """False when `column` is null in every row of `files`, as far as the Parquet statistics
    tell without reading data (a file without them, or in progress, is read)."""
    for f in files:
        if not f.in_progress and null_by_statistics([f], column):
            continue
        t = read_file(f, [column])
        if t.column(column).null_count < t.num_rows:
            return True
    return False


def stream_file(f: CaptureFile, cols, batch_rows: int, threads: bool = True,
                 row_groups: list[int] | None = None) -> Iterator[pa.Table]:
    full = capture_schema(f.protocol)
    schema = full if cols is None else pa.schema([full.field(c) for c in cols])
    try:
        # no pre-buffering: its cache keeps every column chunk read until the file is closed, so
        # memory grew with the segment (measured 10M frames: +4 MB per 256k rows; also 30% more CPU)
        # buffered: column chunks are read a piece at a time, not whole (-18 MB a reader at 128k rows)
        pf = parquet_file(f, pre_buffer=False, buffer_size=1 << 18)
        present = set(pf.schema_arrow.names)
        for batch in pf.iter_batches(batch_size=batch_rows, row_groups=row_groups, use_threads=threads,
                                     columns=[c for c in schema.names if c in present]):
            yield conform(pa.Table.from_batches([batch]), schema)
    except (OSError, pa.ArrowException) as exc:
        raise CaptureError(f"{shown(f.path)}: unreadable ({_first_line(exc)})") from exc


def capture_groups(files: list[CaptureFile]) -> Iterator[tuple[list[CaptureFile], bool]]:
    """The files of each capture, in replay order, and whether they can be streamed: finished
    segments whose frame numbers already increase across the whole capture."""
    files = sorted(files, key=order_key)
    i = 0
    while i < len(files):
        j = i
        while j < len(files) and files[j].capture_id == files[i].capture_id:
            j += 1
        group = files[i:j]
        streamable, last = True, None
        for f in group:
            rng = frame_range(f)
            if rng is None:
                streamable = False
                break
            if rng != (-1, -1):
                if last is not None and rng[0] <= last:
                    streamable = False
                    break
                last = rng[1]
        yield group, streamable
        i = j


def _read_sorted(group: list[CaptureFile], cols) -> pa.Table | None:
    tables = [read_file(f, cols) for f in group]
    whole = pa.concat_tables(tables) if tables else None
    if whole is None or whole.num_rows == 0:
        return None
    return whole.take(pc.sort_indices(whole.column("frame_no")))


# Many small segments (a short --rotate-interval, a quiet source) are read together: one
# scan over a run of them, its files opened and decoded in parallel by pyarrow, instead of a
# reader, a Python loop turn and a compute pass per file (issue 24.15: 5,000 one-row segments
# took 50-100x the time of one file of the same rows).
SMALL_SEGMENT_ROWS = 1 << 16
RUN_FILES = 2048


def small(f: CaptureFile) -> bool:
    """A finished segment small enough to be read together with its neighbours."""
    return not f.in_progress and footer(f.path).num_rows <= SMALL_SEGMENT_ROWS


def runs(group: list[CaptureFile], batch_rows: int) -> Iterator[list[CaptureFile]]:
    """`group` (a streamable capture's segments in order) cut into runs: consecutive small
    segments together (at most `batch_rows` rows and RUN_FILES files a run), any other alone."""
    run: list[CaptureFile] = []
    rows = 0
    for f in group:
        if small(f):
            n = footer(f.path).num_rows
            if run and (rows + n > batch_rows or len(run) >= RUN_FILES):
                yield run
                run, rows = [], 0
            run.append(f)
            rows += n
            continue
        if run:
            yield run
            run, rows = [], 0
        yield [f]
    if run:
        yield run


def read_segments(files: list[CaptureFile], cols, sort: bool = True) -> pa.Table:
    """The rows of finished segments of one protocol, in their order, as one table of
    `cols` (None: all), read together on a few threads (files named in bytes one by one); with
    sort, in frame_no order whatever the files hold (verify wants them as they are, and its
    reads check the page checksums). The columns of the last runs read are kept
    (run_reads.RunCache): a later pass over the same files reads only the columns it has not
    read yet."""
    full = capture_schema(files[0].protocol)
    schema = full if cols is None else pa.schema([full.field(c) for c in cols])
    if len(files) == 1 or any(not isinstance(arrow_path(f.path), str) for f in files):
        tables = [_read_plain(f, schema) if not sort else read_file(f, None if cols is None else list(cols))
                  for f in files]
        return pa.concat_tables(tables) if tables else schema.empty_table()
    table = RUN_CACHE.table(files, schema.names, checked=not sort)
    fn = table.column("frame_no")
    if sort and table.num_rows > 1 and not pc.all(pc.greater(fn.slice(1), fn.slice(0, len(fn) - 1))).as_py():
        table = table.take(pc.sort_indices(fn))
    return table.select(schema.names)


def _read_plain(f: CaptureFile, schema: pa.Schema) -> pa.Table:
    """A finished segment's rows of `schema`, in file order."""
    try:
        pf = parquet_file(f)
        present = set(pf.schema_arrow.names)
        return conform(pf.read(columns=[c for c in schema.names if c in present]), schema)
    except (OSError, pa.ArrowException) as exc:
        raise CaptureError(f"{shown(f.path)}: unreadable ({_first_line(exc)})") from exc


def _read_run(run: list[CaptureFile], cols, batch_rows: int) -> Iterator[pa.Table]:
    whole = read_segments(run, cols)
    for start in range(0, whole.num_rows, batch_rows):
        yield whole.slice(start, batch_rows)


def iter_capture_tables(files: list[CaptureFile], columns: list[str] | None = None,
                        batch_rows: int = 1 << 20, threads: bool = True) -> Iterator[pa.Table]:
    """Every row of `files` in frame order, as a sequence of tables of `columns` (always
    with `frame_no`). Finished segments already in frame_no order (the normal case) are
    streamed `batch_rows` at a time (runs of small ones read together), so memory does not
    grow with the capture; anything else is read whole and sorted, one capture at a time."""
    cols = None if columns is None else list(dict.fromkeys(["frame_no", *columns]))
    for group, streamable in capture_groups(files):
        if streamable:
            for run in runs(group, batch_rows):
                if len(run) > 1:
                    yield from _read_run(run, cols, batch_rows)
                else:
                    yield from stream_file(run[0], cols, batch_rows, threads)
        else:
            whole = _read_sorted(group, cols)
            if whole is not None:
                yield whole


def iter_capture_parts(files: list[CaptureFile], columns: list[str] | None = None, batch_rows: int = 1 << 20
                       ) -> Iterator[tuple[int, Callable[[], Iterator[pa.Table]]]]:
    """The rows of iter_capture_tables as (row count, read) pairs, for reading on other
    threads: `read()` iterates the part's rows as tables of at most `batch_rows` rows, and
    may be called from any thread. Parts of streamable captures are their Parquet row
    groups (a run of small segments one part); anything else is read whole and sorted here,
    one capture at a time."""
    cols = None if columns is None else list(dict.fromkeys(["frame_no", *columns]))
    for group, streamable in capture_groups(files):
        if streamable:
            for run in runs(group, batch_rows):
                if len(run) > 1:
                    yield sum(footer(f.path).num_rows for f in run), functools.partial(_read_run, run, cols, batch_rows)
                    continue
                f = run[0]
                md = footer(f.path)
                for i in range(md.num_row_groups):
                    yield md.row_group(i).num_rows, functools.partial(stream_file, f, cols, batch_rows, False, [i])
        else:
            whole = _read_sorted(group, cols)
            if whole is not None:
                yield whole.num_rows, functools.partial(iter, [whole])


def read_capture_table(files: list[CaptureFile], columns: list[str] | None = None) -> pa.Table:
    """All rows of `files` (the full schema of their protocol, or `columns`), missing
    columns filled with nulls, ordered by (started_at, capture_id, frame_no)."""
    protocol = protocol_of(files)
    full = capture_schema(protocol)
    schema = full if columns is None else pa.schema([full.field(c) for c in columns])
    tables = [t.select(schema.names) for t in iter_capture_tables(files, columns)]
    if not tables:
        return schema.empty_table()
    return pa.concat_tables(tables)


def parquet_paths(files: list[CaptureFile], tmpdir: str) -> list[str]:
    """Parquet paths for Spark: finished segments as they are, in-progress segments
    converted (their complete batches) to Parquet in `tmpdir`."""
    out = []
    for f in files:
        if not f.in_progress:
            out.append(f.path)
            continue
        table = read_file(f)
        table = table.replace_schema_metadata(capture_schema(f.protocol, f.metadata).metadata)
        name = os.path.basename(f.path)[: -len(IN_PROGRESS_SUFFIX)] + FINISHED_SUFFIX
        dest = os.path.join(tmpdir, name)
        pq.write_table(table, dest, compression="zstd", use_dictionary=dictionary_columns(table.schema))
        out.append(dest)
    return out


def without_dictionary(paths: list[str], column: str) -> bool:
    """True when no row group of these Parquet files keeps `column` dictionary-encoded (the
    capture writer never does for `cas`; files from other writers may): Spark can then read a
    uint64 column as the long of the same bits instead of as decimal(20,0)."""
    for path in paths:
        meta = pq.read_metadata(arrow_source(path))
        names = [meta.schema.column(i).path for i in range(meta.num_columns)]
        if column not in names:
            return False
        i = names.index(column)
        if any(meta.row_group(g).column(i).has_dictionary_page for g in range(meta.num_row_groups)):
            return False
    return True
