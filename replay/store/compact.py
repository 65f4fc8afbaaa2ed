"""Compaction of a capture directory's small finished segments (`dcptool compact`, and
`capture` at its end): a run of consecutive small segments of one capture becomes one
merged segment `...-{first:06d}-{last:06d}.parquet` (CAPTURE_FORMAT.md "Merged segments").

Crash safety: the merged file is written under `.parquet.tmp` with the segment writer's
own settings (segment.ParquetSegment: row groups, encodings, statistics and key index),
fsynced, renamed into place and the directory fsynced; only then are its parts deleted.
A crash before the rename leaves a `.tmp` nobody reads (removed here next time); a crash
after it leaves the merged segment next to some of its parts: readers and `verify` read the
merged one and ignore the parts it covers (reader.without_covered), and the next compaction
(or `capture` at its end) deletes them."""

from __future__ import annotations

import concurrent.futures
import os
from dataclasses import dataclass, field
from typing import Callable

import pyarrow as pa
import pyarrow.parquet as pq

from dcptool.replay.store import reader
from dcptool.replay.store.capture_errors import CaptureError
from dcptool.replay.store.files import arrow_source, fsync_dir, shown
from dcptool.replay.store.in_progress import held_by_writer
from dcptool.replay.store.naming import (
    IN_PROGRESS_SUFFIX,
    META_SEGMENT_LAST,
    SEGMENT_NAME_RE,
    TMP_SUFFIX,
    merged_name,
    named_range,
)
from dcptool.replay.store.schema import (
    META_FORMAT,
    META_OPTIONS,
    META_SOURCE,
    META_STARTED_AT,
    META_VERSION,
)
from dcptool.replay.store.segment import ParquetSegment

SMALL_BYTES = 8 << 20      # a part: a finished segment smaller than this
MERGED_BYTES = 128 << 20   # a merged segment: at most this many bytes of parts
READ_THREADS = 4
# what must be equal between the parts of one merged segment (its metadata is the first's)
_SAME = (META_FORMAT, META_STARTED_AT, META_VERSION, META_SOURCE, META_OPTIONS)


class CompactBusy(CaptureError):
    """`dcptool compact` of a directory a running capture writes into."""


@dataclass
class Compaction:
    merged: list[dict] = field(default_factory=list)   # {"path", "parts", "rows", "bytes", "part_paths"}
    parts_removed: int = 0       # parts deleted (those merged now and leftovers of a crash)
    leftovers_removed: int = 0   # of them: parts a crash left next to their merged segment
    bytes_before: int = 0
    bytes_after: int = 0

    def summary(self) -> str:
        """One line: what was merged and removed."""
        parts = sum(m["parts"] for m in self.merged)
        text = (f"compacted {parts:,} segments into {len(self.merged):,} ({self.bytes_before:,} -> "
                f"{self.bytes_after:,} bytes)" if self.merged else "nothing to compact")
        if self.leftovers_removed:
            text += f"; removed {self.leftovers_removed:,} parts an interrupted compaction left"
        return text


def _finished(directory: str, small_bytes: int) -> tuple[list[reader.CaptureFile], list[str]]:
    """The finished (durable: no `.arrows` twin) small or merged segments of a directory,
    and the `.tmp` files an interrupted compaction left."""
    names = sorted(os.listdir(directory))
    present = set(names)
    paths, tmps = [], []
    for name in names:
        if name.endswith(".parquet" + TMP_SUFFIX):
            r = named_range(name[:-len(TMP_SUFFIX)])
            if r is not None and r[0] != r[1]:      # a merged segment's, never a writer's
                tmps.append(os.path.join(directory, name))
            continue
        m = SEGMENT_NAME_RE.match(name)
        if m is None or m.group(5) != "parquet":
            continue
        if name[:-len(".parquet")] + IN_PROGRESS_SUFFIX in present:
            continue
        full = os.path.join(directory, name)
        r = named_range(name)
        try:
            if os.path.getsize(full) >= small_bytes and r is not None and r[0] == r[1]:
                continue       # neither a part nor a merged segment that may cover one: not read
        except OSError:
            continue
        paths.append(full)
    reader.prefetch_footers(paths)
    files = []
    for p in paths:
        try:
            files.append(reader.describe(p))
        except (CaptureError, OSError):
            continue       # not ours to touch
    return files, tmps


def _runs(files: list[reader.CaptureFile], small_bytes: int, min_parts: int) -> list[list[reader.CaptureFile]]:
    """Runs of consecutive small segments of one capture, same metadata, same columns."""
    out: list[list[reader.CaptureFile]] = []
    run: list[reader.CaptureFile] = []
    size = 0

    def close():
        if len(run) >= max(2, min_parts):
            out.append(list(run))
        run.clear()

    for f in sorted(files, key=lambda f: (f.capture_id, f.segment)):
        n = os.path.getsize(f.path)
        if n >= small_bytes:
            close()
            size = 0
            continue
        if run:
            prev = run[-1]
            if (f.capture_id != prev.capture_id or f.segment != prev.last_segment + 1
                    or any(f.metadata.get(k) != prev.metadata.get(k) for k in _SAME)
                    or size + n > MERGED_BYTES
                    or not reader.footer(f.path).schema.to_arrow_schema().remove_metadata().equals(
                        reader.footer(prev.path).schema.to_arrow_schema().remove_metadata())):
                close()
                size = 0
        run.append(f)
        size += n
    close()
    return out


def _codec(f: reader.CaptureFile) -> str:
    md = reader.footer(f.path)
    if md.num_row_groups and md.num_columns:
        c = md.row_group(0).column(0).compression.lower()
        return "none" if c == "uncompressed" else c
    return "zstd"


def _read(path: str) -> pa.Table:
    """One part whole, its footer as already parsed (a ParquetFile, not the dataset reader:
    a third of the time a small file)."""
    return pq.ParquetFile(arrow_source(path), metadata=reader.footer(path)).read(use_threads=False) \
        .replace_schema_metadata(None)


def merge(run: list[reader.CaptureFile]) -> dict:
    """Write the merged segment of `run` (rename, directory fsync), then delete its parts."""
    first, last = run[0], run[-1]
    directory = os.path.dirname(first.path)
    final = os.path.join(directory, merged_name(first.protocol, reader.parse_started(first.started_at),
                                                first.capture_id, first.segment, last.last_segment))
    raw = reader.footer(first.path).schema.to_arrow_schema()
    meta = {k.decode(): v.decode() for k, v in (raw.metadata or {}).items()}
    meta[META_SEGMENT_LAST] = str(last.last_segment)
    schema = raw.with_metadata(meta)
    seg = ParquetSegment(final, schema, _codec(first))
    try:
        with concurrent.futures.ThreadPoolExecutor(READ_THREADS) as pool:
            plain = schema.remove_metadata()
            for table in pool.map(_read, [f.path for f in run]):
                for batch in (table if table.schema.equals(plain) else table.cast(plain)).to_batches():
                    seg.add(batch)
        size = seg.finish()      # fsync, rename, directory fsync: durable before any part goes
    except BaseException:
        seg.abandon()
        raise
    before = sum(os.path.getsize(f.path) for f in run)
    for f in run:
        _unlink(f.path)
    fsync_dir(directory)
    return {"path": final, "parts": len(run), "rows": seg.rows, "bytes": size, "bytes_before": before,
            "part_paths": [f.path for f in run]}


def _unlink(path: str) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass


def compact(directory, *, select: Callable[[reader.CaptureFile], bool] | None = None,
            small_bytes: int = SMALL_BYTES, min_parts: int = 2, check_busy: bool = True) -> Compaction:
    """Merge the runs of small finished segments in `directory` (those `select` accepts; all
    by default) and delete the parts a crashed compaction left next to their merged segment.
    `min_parts`: only runs of at least this many segments are merged. With `check_busy`,
    a directory a live capture writes into is refused (CompactBusy): its ring may be deleting."""
    directory = os.fspath(directory)
    if not os.path.isdir(directory):
        raise CaptureError(f"{shown(directory)}: not a directory")
    if check_busy:
        for name in sorted(os.listdir(directory)):
            full = os.path.join(directory, name)
            if name.endswith(IN_PROGRESS_SUFFIX) and held_by_writer(full):
                raise CompactBusy(f"{shown(directory)}: a capture is writing into it ({name}); "
                                  "compact it once the capture has ended")
    files, tmps = _finished(directory, small_bytes)
    if select is not None:
        files = [f for f in files if select(f)]
    out = Compaction()
    ids = {f.capture_id.replace("-", "")[:8].lower() for f in files}
    for tmp in tmps:      # an interrupted compaction's (of the captures selected)
        m = SEGMENT_NAME_RE.match(os.path.basename(tmp)[:-len(TMP_SUFFIX)])
        if check_busy or (m and m.group(3).lower() in ids):
            _unlink(tmp)
    kept, covered = reader.without_covered(files)
    for f in covered:
        _unlink(f.path)
    if covered:
        fsync_dir(directory)
        out.parts_removed += len(covered)
        out.leftovers_removed = len(covered)
    for run in _runs(kept, small_bytes, min_parts):
        done = merge(run)
        out.merged.append(done)
        out.parts_removed += done["parts"]
        out.bytes_before += done.pop("bytes_before")
        out.bytes_after += done["bytes"]
    return out
