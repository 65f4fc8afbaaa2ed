"""Reading runs of small finished segments together (reader.read_segments): each file in one
request with its parsed footer, on a few threads, and the columns read from the last runs
kept for the rest of the command (RunCache), so that a second pass over a run opens no file
again. What many small segments cost is per file, not per row (issue 24.15)."""

from __future__ import annotations

import os
import threading

import pyarrow as pa
import pyarrow.parquet as pq

from dcptool.replay.store.capture_errors import CaptureError
from dcptool.replay.store.files import first_line, shown  # noqa: F401 (run_reads.first_line: the name callers use)
from dcptool.replay.store.footers import footer, in_threads, top_names
from dcptool.replay.store.schema import capture_schema


def conform(table: pa.Table, schema: pa.Schema) -> pa.Table:
    """`table` with exactly the columns of `schema` (missing ones null), cast to its types."""
    cols = []
    for fld in schema:
        if fld.name in table.column_names:
            col = table.column(fld.name)
            if col.type != fld.type:
                col = col.cast(fld.type)
            cols.append(col)
        else:
            cols.append(pa.nulls(table.num_rows, fld.type))
    return pa.Table.from_arrays(cols, schema=schema)


def scan_segments(files: list, names: list[str], checked: bool) -> pa.Table:
    """Columns `names` of finished segments (paths pyarrow can encode), in file order, as one
    table of single-chunk columns: each file read whole in one request with the footer
    already parsed (footers.footer), on a few threads (pyarrow reads without the GIL). With
    `checked`, the page checksums are verified (as verify does file by file). Per small file
    this costs about 60% of the CPU of a pyarrow dataset scan of the same files (measured
    with pyarrow 26: ~0.25 ms a file and ~0.02 ms a column, after ~0.27 ms for its footer)."""
    SCANS.append(len(files))
    full = capture_schema(files[0].protocol)

    def one(f) -> pa.Table:
        try:
            md = footer(f.path)
            present = top_names(md)
            pf = pq.ParquetFile(f.path, metadata=md, pre_buffer=True, page_checksum_verification=checked)
            return pf.read(columns=[n for n in names if n in present], use_threads=False)
        except (OSError, pa.ArrowException) as exc:
            raise CaptureError(f"{shown(f.path)}: unreadable ({first_line(exc)})") from exc
    tables = in_threads(one, files)
    want = pa.schema([full.field(n) for n in names])
    try:
        whole = pa.concat_tables(tables)      # one layout (the usual case): no unification
    except pa.ArrowException:
        try:
            whole = pa.concat_tables(tables, promote_options="permissive")
        except pa.ArrowException:        # segments of layouts too different to concatenate
            whole = pa.concat_tables([conform(t, want) for t in tables])
    return conform(whole.combine_chunks(), want)


SCANS: list[int] = []     # the files of each run read (one number a run read: tests count them)


# read with any columns of a run of small segments: the frame header columns most passes
# look at (the cluster-config candidates of replay/rules/topology.py among them), so that a
# second pass over the run finds them read (a column costs ~0.02 ms a small file, opening
# and reading the file again ~0.25 ms; measured with pyarrow 26)
ALWAYS_READ = ("capture_id", "frame_no", "direction", "magic", "opcode", "status")


class RunCache:
    """The columns read from the last runs of small segments scanned, up to BYTES of them, the
    oldest run dropped first. Keyed by each file's path, size and mtime, so a file rewritten
    since is read again; a pass asking for columns already read gets them without a scan,
    one asking for more scans only the missing ones (a scan costs per file, far more than
    per column, when the files are small)."""

    BYTES = 64 << 20

    def __init__(self):
        self.runs: dict[tuple, dict[str, pa.ChunkedArray]] = {}
        self.lock = threading.Lock()     # runs may be read on the replay's worker threads

    def table(self, files: list, names: list[str], checked: bool) -> pa.Table:
        names = list(dict.fromkeys(["frame_no", *names]))
        key = (checked, tuple(_version(f.path) for f in files))
        with self.lock:
            have = dict(self.runs.pop(key, {}))
            missing = [n for n in names if n not in have]
            if missing:
                full = capture_schema(files[0].protocol)
                also = [n for n in ALWAYS_READ if n in full.names and n not in have and n not in missing]
                got = scan_segments(files, missing + also, checked)
                have.update(zip(got.column_names, got.columns))
            self.runs[key] = have          # the newest last
            while self.runs and sum(c.nbytes for run in self.runs.values() for c in run.values()) > self.BYTES:
                del self.runs[next(iter(self.runs))]
        full = capture_schema(files[0].protocol)
        return pa.Table.from_arrays([have[n] for n in names], schema=pa.schema([full.field(n) for n in names]))

    def clear(self) -> None:
        with self.lock:
            self.runs.clear()


def _version(path: str) -> tuple:
    try:
        st = os.stat(path)
    except OSError as exc:
        raise CaptureError(f"{shown(path)}: unreadable ({first_line(exc)})") from exc
    return (path, st.st_size, st.st_mtime_ns)


RUN_CACHE = RunCache()
