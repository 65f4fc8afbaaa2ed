"""One capture segment on disk: the in-progress Arrow IPC file (written as rows arrive, read
back by `open_in_progress`), its Parquet twin encoded row group by row group on the writer's
encoder thread (`ParquetSegment`, encoder.py), finishing (fsync, rename, removal of the `.arrows`) and recovery of a
segment a crashed or failed run left behind (`finish_in_progress`, `finish_from_memory`)."""

from __future__ import annotations

import collections
import fcntl
import os
from typing import Any, Iterator

import pyarrow as pa
import pyarrow.ipc as ipc
import pyarrow.parquet as pq

from dcptool.protocol.errors import DcptoolError
from dcptool.replay.store import COMPRESSIONS
from dcptool.replay.store.encoder import RowGroupEncoder
from dcptool.replay.store.files import (
    arrow_path,
    arrow_source,
    fsync_dir,
    fsync_path,
    one_line,
    remove_quiet,
    shown,
    start_writeback,
    unlink_quiet,
)
from dcptool.replay.store.in_progress import InProgress, set_aside
from dcptool.replay.store.key_index import bloom_options
from dcptool.replay.store.naming import TMP_SUFFIX, final_path

# Uncompressed Arrow bytes buffered per Parquet row group. Small enough that the row group
# being encoded, the one filling and the writer's queue stay well inside the capture's RSS
# budget (one 8 MiB receive of 128 B frames is ~23 MiB of Arrow: a row group per receive);
# large enough that per-row-group overhead is noise (~10 KB of footer per 65k rows).
ROW_GROUP_BYTES = 16 * 2**20
ROW_GROUP_ROWS = 1_000_000

# The in-progress copy is compressed per buffer where that pays: the many all-null columns
# of small DCP rows shrink to nothing, which costs less than pushing their zeros through the
# page cache (and perhaps the disk) for a file that is deleted once its Parquet twin is in
# place. LZ4, not zstd: the file is transient and the capture hot path shares two cores with
# the network loop (tests/bench/bench_capture.py: 405k -> 565k frames/s). Large values that
# LZ4 cannot shrink (random or already compressed bytes) make it pure cost: 1.4-1.7 GB/s
# with LZ4 against 4-4.6 GB/s without for 1 KiB and 16 KiB values of random hex. So each
# segment tries LZ4 on a sample of its first rows and keeps it only when it at least halves
# them (`IPC_MIN_SAVINGS`); a reader sees the codec per message and needs no option.
IPC_COMPRESSION = "lz4"
IPC_MIN_SAVINGS = 0.5
_SAMPLE_BYTES = 1 << 20

# The same judgement for the Parquet file's frame bytes: LZ4 (or snappy, or zstd) on values
# that do not shrink is pure cost on the encoder thread, the capture's bottleneck for large
# values (16 KiB of random hex: LZ4 adds 0.7 s of CPU per 820 MB for 0% saved). Each segment
# compresses its `raw` column only when the codec saves PARQUET_MIN_SAVINGS on a sample of
# its first rows; every other column keeps the codec. Readers need nothing: Parquet records
# the codec per column chunk.
PARQUET_MIN_SAVINGS = 0.05

# Parquet dictionary encoding only where values repeat; hashing every `raw` frame for a
# dictionary that is then abandoned costs more than the whole zstd pass.
_DICT_INT_COLUMNS = ("conn", "magic", "opcode", "status", "vbucket", "datatype", "stream_id",
                     "collection_id", "item_flags", "snap_flags", "stream_end_reason",
                     "req_flags", "system_event_id")


class WriterError(DcptoolError):
    """A capture could not be written (disk full, unwritable directory ...). The message is
    one line naming the path; finished segments are left intact."""


def abandon_files(pq_segment, ipc, ipc_sink, lock_fd) -> None:
    """After an error: drop the partial Parquet file, close the in-progress file (it stays)
    and release the lock, ignoring further errors (the disk is failing already)."""
    if pq_segment is not None:
        pq_segment.abandon()
    for closer in (getattr(ipc, "close", None), getattr(ipc_sink, "close", None)):
        if closer is not None:
            try:
                closer()
            except Exception:  # noqa: BLE001 - the disk is failing already
                pass
    if lock_fd is not None:
        try:
            os.close(lock_fd)
        except OSError:
            pass


def parquet_compression(compression: str | None) -> str:
    c = (compression or "none").lower()
    if c not in COMPRESSIONS:
        raise ValueError(f"compression must be one of {', '.join(COMPRESSIONS)}, not {compression!r}")
    return c


def dictionary_columns(schema: pa.Schema) -> list[str]:
    return [f.name for f in schema
            if pa.types.is_dictionary(f.type) or f.name in _DICT_INT_COLUMNS]


# ------------------------------------------------------------- reading in-progress segments

def open_in_progress(path: str) -> tuple[pa.Schema | None, Iterator[pa.RecordBatch]]:
    """Open an in-progress `.arrows` segment, possibly cut short by a crash or still being
    written: (schema or None when not even the schema made it to disk, iterator over every
    whole batch; a torn batch at the end is left out, never returned in part). What could
    not be read is told by in_progress.InProgress, which this wraps."""
    ip = InProgress(path)
    return ip.schema, iter(ip)


def _tail(batch):
    """The last rows of batch (a RecordBatch or Table), about _SAMPLE_BYTES of them (the
    newest data), or None with less than 64 KiB to judge by (a few control frames)."""
    n, nbytes = batch.num_rows, batch.nbytes
    if n == 0 or nbytes < _SAMPLE_BYTES // 16:
        return None
    rows = max(1, min(n, int(n * _SAMPLE_BYTES / nbytes)))
    return batch.slice(n - rows, rows)


def ipc_compression(batch: pa.RecordBatch) -> str | None:
    """IPC_COMPRESSION unless it fails to save IPC_MIN_SAVINGS on the last rows of batch
    (`_tail`; with too little to judge by, IPC_COMPRESSION)."""
    sample = _tail(batch)
    if sample is None:
        return IPC_COMPRESSION
    sizes = []
    for codec in (None, IPC_COMPRESSION):
        sink = pa.BufferOutputStream()
        with ipc.new_stream(sink, batch.schema, options=ipc.IpcWriteOptions(compression=codec)) as w:
            w.write_batch(sample)
        sizes.append(sink.tell())
    return IPC_COMPRESSION if sizes[1] <= sizes[0] * (1 - IPC_MIN_SAVINGS) else None


def column_compression(table: pa.Table, compression: str) -> str | dict[str, str]:
    """The Parquet codec of a segment whose first row group is table: `compression` for
    every column, except that the frame bytes (`raw`) are stored uncompressed when the codec
    fails to save PARQUET_MIN_SAVINGS on the frames of its last rows (`_tail`)."""
    if compression == "none" or "raw" not in table.schema.names:
        return compression
    sample = _tail(table.select(["raw"]))
    if sample is None:                   # a few control frames: nothing to judge by
        return compression
    frames = b"".join(v for v in sample.column(0).to_pylist() if v is not None)
    if len(pa.Codec(compression).compress(frames)) <= len(frames) * (1 - PARQUET_MIN_SAVINGS):
        return compression
    return {path: ("none" if path == "raw" else compression) for path in _leaf_paths(table.schema)}


def _leaf_paths(schema: pa.Schema) -> list[str]:
    """The Parquet column paths of schema (a per-column codec is given by leaf path, and a
    leaf left out is written uncompressed)."""
    def walk(prefix: str, typ: pa.DataType):
        if pa.types.is_list(typ) or pa.types.is_large_list(typ):
            yield from walk(prefix + ".list.element", typ.value_type)
        elif pa.types.is_struct(typ):
            for i in range(typ.num_fields):
                yield from walk(prefix + "." + typ.field(i).name, typ.field(i).type)
        else:
            yield prefix
    return [p for f in schema for p in walk(f.name, f.type)]


def delta_columns(schema: pa.Schema) -> dict[str, str]:
    """DELTA_BINARY_PACKED for the 64-bit integer and timestamp columns (`frame_no`, `cas`,
    the seqnos, `ts`, `mono_ns` ...): they count up or repeat, so their deltas pack into a few
    bits, which zstd then finds little left in. Cheaper on the encoder thread than zstd over
    their 8 plain bytes a row, and smaller (tests/bench/bench_capture.py; docs/BENCHMARKS.md).
    Every Parquet reader dcptool documents (pyarrow, DuckDB, Spark) reads it; unsigned values
    wrap as the format says."""
    return {f.name: "DELTA_BINARY_PACKED" for f in schema
            if f.name not in _DICT_INT_COLUMNS and not pa.types.is_dictionary(f.type)
            and (pa.types.is_timestamp(f.type) or (pa.types.is_integer(f.type) and f.type.bit_width == 64))}


def _statistics_columns(schema: pa.Schema) -> list[str]:
    """Min/max statistics where readers prune with them (numbers, timestamps, names); not
    on the frame bytes and keys, where they cost time and help no query."""
    return [f.name for f in schema
            if not (pa.types.is_binary(f.type) or pa.types.is_large_binary(f.type)
                    or pa.types.is_list(f.type) or f.name in ("row", "args"))]


# ------------------------------------------------------------------------- Parquet segment

def parquet_writer(where, schema: pa.Schema, compression: str | dict[str, str], key_index: dict | None = None) -> pq.ParquetWriter:
    """The Parquet writer of a segment, with its encodings (where: a path or a sink; the
    benchmark times the same settings into memory); `key_index`: the Bloom filter options
    of key_index.bloom_options, written with the file when it is finished."""
    return pq.ParquetWriter(where, schema, compression=compression,
                            use_dictionary=dictionary_columns(schema),
                            column_encoding=delta_columns(schema) or None,
                            write_statistics=_statistics_columns(schema), data_page_version="2.0",
                            bloom_filter_options=key_index)


class ParquetSegment:
    """A Parquet file being written under `<final>.tmp`, one bounded row group at a time.

    A full row group is handed to a `RowGroupEncoder` (the capture writer's, shared by its
    segments in turn, or one of its own), which encodes and compresses it on its thread
    while the next one fills, so the in-progress IPC copy, and with it the network side,
    keeps moving during the zstd pass. The encoder's queue is bounded: a hand-off waits for
    room, which bounds memory. An encoder error (disk full ...) is raised by the next
    hand-off, `finish` or `flush_row_group(wait=True)`, in the caller's thread; no row group
    of this file is encoded after a failed one."""

    def __init__(self, final: str, schema: pa.Schema, compression: str,
                 encoder: RowGroupEncoder | None = None):
        self.final = final
        self.tmp = final + TMP_SUFFIX
        self.schema = schema
        self.rows = 0
        self._batches: list[pa.RecordBatch] = []
        self._buffered = 0
        self._buffered_rows = 0
        self._pending: collections.deque = collections.deque()   # futures, oldest first
        self._failed: BaseException | None = None
        self._encoder = encoder
        self._own_encoder = encoder is None
        self._compression = compression
        self._writer: pq.ParquetWriter | None = None   # opened by the first row group (column_compression)
        self._sink = None      # the tmp file opened here when its name is not UTF-8

    def add(self, batch: pa.RecordBatch) -> None:
        self._batches.append(batch)
        self._buffered += batch.nbytes
        self._buffered_rows += batch.num_rows
        self.rows += batch.num_rows
        if self._buffered >= ROW_GROUP_BYTES or self._buffered_rows >= ROW_GROUP_ROWS:
            self.flush_row_group(wait=False)

    def flush_row_group(self, wait: bool = True) -> None:
        """Hand the buffered rows to the encoder as one row group; with wait, return once
        every row group handed over is in the file."""
        self._reap(block=False)
        if self._batches:
            batches, self._batches, self._buffered, self._buffered_rows = self._batches, [], 0, 0
            if self._encoder is None:
                self._encoder = RowGroupEncoder()
            self._pending.append(self._encoder.submit(self._write_row_group, batches))
        if wait:
            self._reap(block=True)

    def _write_row_group(self, batches: list) -> None:
        if self._failed is not None:
            raise self._failed      # the file is broken already: nothing more goes into it
        try:
            table = pa.Table.from_batches(batches, schema=self.schema).unify_dictionaries()
            if self._writer is None:
                self._writer = parquet_writer(self._sink_for_tmp(), self.schema,
                                              column_compression(table, self._compression),
                                              bloom_options(self.schema, table, ROW_GROUP_BYTES, ROW_GROUP_ROWS))
            self._writer.write_table(table, row_group_size=max(1, table.num_rows))
            start_writeback(self.tmp)
        except BaseException as exc:
            self._failed = exc
            raise

    def _sink_for_tmp(self):
        """The `.parquet.tmp` path, or (a name pyarrow cannot encode) the file opened here."""
        where = arrow_source(self.tmp, "wb")
        if not isinstance(where, str):
            self._sink = where
        return where

    def _close_sink(self) -> None:
        if self._sink is not None:
            try:
                self._sink.close()
            except Exception:  # noqa: BLE001 - already written and closed, or failing anyway
                pass
            self._sink = None

    def _reap(self, block: bool) -> None:
        """Collect row groups the encoder is done with (all of them with block); the first
        error (disk full ...) is raised here, in the caller."""
        while self._pending and (block or self._pending[0].done()):
            self._pending.popleft().result()

    def _stop_encoder(self) -> None:
        if self._own_encoder and self._encoder is not None:
            self._encoder.close()
            self._encoder = None

    def finish(self) -> int:
        """Write the last row group, fsync, rename into place; the size in bytes."""
        try:
            self.flush_row_group()
        finally:
            self._stop_encoder()
        if self._writer is None:     # not a row: an empty file, the schema alone
            self._writer = parquet_writer(self._sink_for_tmp(), self.schema, self._compression)
        self._writer.close()
        self._writer = None
        self._close_sink()
        fsync_path(self.tmp)
        os.replace(self.tmp, self.final)
        fsync_dir(os.path.dirname(self.final) or ".")
        return os.path.getsize(self.final)

    def abandon(self) -> None:
        self._batches = []
        while self._pending:     # the encoder must be done with the file before it goes
            try:
                self._pending.popleft().result()
            except Exception:  # noqa: BLE001 - already failing; the tmp file goes anyway
                pass
        self._stop_encoder()
        if self._writer is not None:
            try:
                self._writer.close()
            except Exception:  # noqa: BLE001 - already failing; the tmp file goes anyway
                pass
            self._writer = None
        self._close_sink()
        try:
            os.unlink(self.tmp)
        except OSError:
            pass


def finish_in_progress(arrows_path: str, compression: str = "zstd") -> dict | None:
    """Turn a leftover in-progress segment into a normal Parquet segment.

    Returns {"path", "rows", "bytes", "damaged", "unread", "note"} for a segment written now
    (or for a damaged file with no whole row: "path" None), or None when there was nothing
    to do: the segment is still being written by a live process (its lock is held), it was
    already renamed into place before the crash, or it held no byte beyond a schema.

    Nothing recorded is deleted unless it was copied whole: every whole batch before the
    first unreadable byte goes into the Parquet segment, and a file with bytes that could
    not be read (damaged) is kept aside as `<name>.arrows.damaged` ("damaged" is its path,
    "unread" the bytes not read, "note" one line saying so). A torn tail (the last batch cut
    short by a crash or a full disk, in_progress.torn_tail) is the end of the log, not damage:
    it is dropped ("torn" the bytes, "note" one line of information, "damaged" None), as a
    resumed stream fetches those frames again from the last durable position.
    """
    try:
        lock_fd = os.open(arrow_path(arrows_path), os.O_RDONLY)
    except FileNotFoundError:
        return None
    try:
        try:
            fcntl.flock(lock_fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            return None  # a running capture owns it
        final = final_path(arrows_path)
        if os.path.exists(final):
            # killed between the rename and the unlink: the Parquet file is whole
            unlink_quiet(final + TMP_SUFFIX)
            unlink_quiet(arrows_path)
            return None
        ip = InProgress(arrows_path)
        unlink_quiet(final + TMP_SUFFIX)    # whatever Parquet file a killed run had started
        if ip.schema is None:
            if not ip.unread:   # an empty file: killed before its first write
                unlink_quiet(arrows_path)
                return None
            return _torn(arrows_path, ip, None) if ip.torn else _kept_aside(arrows_path, ip, None)
        try:
            seg = ParquetSegment(final, ip.schema, parquet_compression(compression))
            try:
                for batch in ip:
                    seg.add(batch)
                if seg.rows == 0:
                    seg.abandon()
                    if ip.unread:
                        return _torn(arrows_path, ip, None) if ip.torn else _kept_aside(arrows_path, ip, None)
                    unlink_quiet(arrows_path)
                    return None
                size = seg.finish()
            except BaseException:
                seg.abandon()
                raise
        except OSError as exc:
            raise WriterError(f"cannot write capture segment {shown(final)}: {one_line(exc)}") from exc
        done = {"path": final, "rows": seg.rows, "bytes": size}
        if ip.unread and ip.torn:
            return _torn(arrows_path, ip, done)
        if ip.unread:
            return _kept_aside(arrows_path, ip, done)
        unlink_quiet(arrows_path)
        return dict(done, damaged=None, unread=0, note=None)
    finally:
        os.close(lock_fd)


def _torn(arrows_path: str, ip: InProgress, done: dict[str, Any] | None) -> dict[str, Any]:
    """The result of finishing a file whose only unread bytes are a torn tail: truncated to its
    whole batches (in the Parquet segment), the file removed, one line of information."""
    unlink_quiet(arrows_path)
    fsync_dir(os.path.dirname(arrows_path) or ".")
    into = f" into {os.path.basename(shown(done['path']))}" if done else ""
    note = f"{os.path.basename(shown(arrows_path))}: recovered{into}: {ip.tail()}"
    base = done or {"path": None, "rows": 0, "bytes": 0}
    return dict(base, damaged=None, unread=0, torn=ip.unread, note=note)


def _kept_aside(arrows_path: str, ip: InProgress, done: dict | None) -> dict:
    """The result of finishing a damaged in-progress file: renamed aside, never deleted."""
    aside = set_aside(arrows_path)
    fsync_dir(os.path.dirname(aside) or ".")
    into = f" into {os.path.basename(shown(done['path']))}" if done else ""
    note = (f"{os.path.basename(shown(arrows_path))}: recovered {ip.rows:,} rows in {ip.batches:,} whole "
            f"batches{into}; {ip.unread:,} bytes after byte {ip.good_end:,} could not be read"
            f"{' (' + ip.error + ')' if ip.error else ''}; the file is kept as "
            f"{os.path.basename(shown(aside))}")
    base = done or {"path": None, "rows": 0, "bytes": 0}
    return dict(base, damaged=aside, unread=ip.unread, note=note)


def finish_from_memory(arrows: str, compression: str) -> tuple[dict | None, int]:
    """The last resort on a full disk: read the whole rows of an in-progress file into
    memory, remove the file, and write them as its Parquet segment into the space it
    gave back. (segment or None, rows that could not be saved); the file is gone either way."""
    batches: list = []
    schema = None
    try:
        with open(arrows, "rb") as f:
            data = f.read()
        try:
            reader = ipc.open_stream(pa.py_buffer(data))
            schema = reader.schema
            while True:
                batches.append(reader.read_next_batch())
        except StopIteration:
            pass
        except (pa.ArrowInvalid, OSError, EOFError):
            pass   # a torn tail: the whole batches before it are kept
    except OSError:
        pass
    remove_quiet(arrows)
    rows = sum(b.num_rows for b in batches)
    if schema is None or rows == 0:
        return None, 0
    final = final_path(arrows)
    seg = None
    try:
        seg = ParquetSegment(final, schema, parquet_compression(compression))
        for b in batches:
            seg.add(b)
        size = seg.finish()
    except Exception:  # noqa: BLE001 - the disk is failing: report the rows, not a trace
        if seg is not None:
            seg.abandon()
        remove_quiet(final + TMP_SUFFIX)
        if os.path.exists(final):   # renamed into place (whole) before the error
            return {"path": final, "rows": rows, "bytes": os.path.getsize(final)}, 0
        return None, rows
    return {"path": final, "rows": seg.rows, "bytes": size}, 0


class Finishing:
    """A segment handed over for finishing: its Parquet file and its in-progress file."""

    __slots__ = ("pq", "ipc", "ipc_sink", "arrows", "lock_fd", "ipc_bytes")

    def __init__(self, pq_seg, ipc_writer, ipc_sink, arrows, lock_fd, ipc_bytes):
        self.pq, self.ipc, self.ipc_sink = pq_seg, ipc_writer, ipc_sink
        self.arrows, self.lock_fd, self.ipc_bytes = arrows, lock_fd, ipc_bytes

    def complete(self) -> int:
        """Parquet file whole and in place, then the in-progress copy removed; its size."""
        size = self.pq.finish()
        self.ipc.close()
        self.ipc_sink.close()
        os.unlink(self.arrows)
        os.close(self.lock_fd)
        self.lock_fd = None
        return size

    def abandon(self) -> None:
        """After an error: drop the partial Parquet file, keep the in-progress file."""
        abandon_files(self.pq, self.ipc, self.ipc_sink, self.lock_fd)
        self.lock_fd = None


# ----------------------------------------------------------------------------- the writer
