"""The capture writer: segments, rotation, crash safety and credential redaction
(CAPTURE_FORMAT.md).

Every batch handed to `CaptureWriter.write` goes two ways:

* into the in-progress segment, an Arrow IPC stream `<segment>.arrows` written through an
  unbuffered OS file, so that what was written is in the page cache at once and survives a
  SIGKILL of the process (with `fsync_in_progress=True` also fsync'ed each `flush_interval`, for power loss);
* into a bounded row-group buffer that is encoded to `<segment>.parquet.tmp` whenever it
  holds `ROW_GROUP_BYTES` (on a helper thread, one row group in flight).

When a segment is finished (rotation or close) the last row group is written, the Parquet
file is fsync'ed, renamed to its final name, the directory fsync'ed, and only then is the
`.arrows` file removed (after a rotation this happens on a helper thread while the next
segment fills; one segment finishes at a time). A crash therefore leaves, for the unfinished segment, an `.arrows`
file (and perhaps a partial `.parquet.tmp`), which `finish_in_progress` turns into a normal
segment on the next `capture --resume`; finished `.parquet` files are always whole.

Small batches are coalesced (at most `flush_interval / 2` old) so that callers writing a row
at a time do not produce one IPC message per row. `BackgroundWriter` runs a writer on a
thread behind a queue bounded in bytes, so Parquet encoding never runs on the network loop.
"""

from __future__ import annotations

import collections
import concurrent.futures
import datetime as _dt
import errno
import fcntl
import json
import os
import re
import threading
import time
import uuid
from typing import Iterator

import numpy as np
import pyarrow as pa
import pyarrow.ipc as ipc
import pyarrow.parquet as pq

from dcptool.replay import schema as S

# Uncompressed Arrow bytes buffered per Parquet row group. Small enough that the row group
# being encoded, the one filling and the writer's queue stay well inside the capture's RSS
# budget (one 8 MiB receive of 128 B frames is ~23 MiB of Arrow: a row group per receive);
# large enough that per-row-group overhead is noise (~10 KB of footer per 65k rows).
ROW_GROUP_BYTES = 16 * 2**20
ROW_GROUP_ROWS = 1_000_000
COALESCE_BYTES = 4 * 2**20         # small batches are merged up to this size ...
COALESCE_ROWS = 32_768             # ... or this many rows before they reach the IPC stream
COALESCE_MIN_ROWS = 4_096          # batches at least this big on average are not merged
COMPRESSIONS = ("zstd", "snappy", "none")
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
_IPC_SAMPLE_BYTES = 1 << 20
IN_PROGRESS_SUFFIX = ".arrows"
TMP_SUFFIX = ".tmp"

# Parquet dictionary encoding only where values repeat; hashing every `raw` frame for a
# dictionary that is then abandoned costs more than the whole zstd pass.
_DICT_INT_COLUMNS = ("conn", "magic", "opcode", "status", "vbucket", "datatype", "stream_id",
                     "collection_id", "item_flags", "snap_flags", "stream_end_reason",
                     "req_flags", "system_event_id")

_SECRET_KEY = re.compile(r"pass(word|wd|phrase)?$|secret|credential|api[_-]?key|private[_-]?key",
                         re.IGNORECASE)


class WriterError(Exception):
    """A capture could not be written (disk full, unwritable directory ...). The message is
    one line naming the path; finished segments are left intact."""


# ----------------------------------------------------------------------------- helpers

def _utcnow() -> _dt.datetime:
    return _dt.datetime.now(_dt.timezone.utc)


def segment_name(protocol: str, started: _dt.datetime, capture_id: str, segment: int) -> str:
    """`{protocol}-{started %Y%m%dT%H%M%S.%fZ}-{capture_id[:8]}-{segment:06d}.parquet`."""
    stamp = started.astimezone(_dt.timezone.utc).strftime("%Y%m%dT%H%M%S.%fZ")
    return f"{protocol}-{stamp}-{capture_id.replace('-', '')[:8]}-{segment:06d}.parquet"


def in_progress_path(parquet_path: str) -> str:
    """The in-progress (`.arrows`) name of a segment's final `.parquet` name."""
    base = parquet_path[:-len(".parquet")] if parquet_path.endswith(".parquet") else parquet_path
    return base + IN_PROGRESS_SUFFIX


def final_path(arrows_path: str) -> str:
    """The final `.parquet` name of an in-progress `.arrows` segment."""
    base = arrows_path[:-len(IN_PROGRESS_SUFFIX)] if arrows_path.endswith(IN_PROGRESS_SUFFIX) \
        else arrows_path
    return base + ".parquet"


def strip_secrets(options):
    """A copy of `options` without keys that name a secret (password, secret, api key ...),
    at any depth. The caller is expected to pass no secret; this is a second fence."""
    if isinstance(options, dict):
        return {str(k): strip_secrets(v) for k, v in options.items()
                if not _SECRET_KEY.search(str(k))}
    if isinstance(options, (list, tuple)):
        return [strip_secrets(v) for v in options]
    return options


_SASL_OPCODES = (0x21, 0x22)      # SASL_AUTH, SASL_STEP
_SASL_MAGICS = (0x80, 0x08)       # request, request with flexible framing


def mask_sasl_credentials(raw: bytes) -> bytes:
    """For a SASL AUTH/STEP request frame, the same frame with its value replaced by `*`
    bytes of the same length (header, extras and key, i.e. the mechanism, are kept). Any
    other frame, or a frame too short to parse, is returned unchanged."""
    if len(raw) < 24 or raw[0] not in _SASL_MAGICS or raw[1] not in _SASL_OPCODES:
        return raw
    if raw[0] == 0x08:
        framing, key_len = raw[2], raw[3]
    else:
        framing, key_len = 0, int.from_bytes(raw[2:4], "big")
    ext_len = raw[4]
    body_len = int.from_bytes(raw[8:12], "big")
    start = 24 + framing + ext_len + key_len
    end = min(24 + body_len, len(raw))
    if start >= end:
        return raw
    return raw[:start] + b"*" * (end - start) + raw[end:]


def _one_line(exc: BaseException) -> str:
    """The OS error as one line: `No space left on device (ENOSPC)` for an errno (pyarrow's
    own text, `Error writing bytes to file. Detail: [errno 28] ...`, says less)."""
    code = getattr(exc, "errno", None)
    if isinstance(code, int) and code in errno.errorcode:
        return f"{os.strerror(code)} ({errno.errorcode[code]})"
    text = (getattr(exc, "strerror", None) or str(exc) or type(exc).__name__)
    return text.splitlines()[0]


def _fsync_dir(directory: str) -> None:
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def _start_writeback(path: str) -> None:
    """Ask the kernel to start writing path's dirty pages to the disk now, without waiting
    (POSIX_FADV_DONTNEED writes back asynchronously, then drops pages already clean), so
    the fsync that finishes a segment waits for its last row group only."""
    if not hasattr(os, "posix_fadvise"):
        return
    fd = os.open(path, os.O_RDONLY)
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def _fsync_path(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _abandon_files(pq_segment, ipc, ipc_sink, lock_fd) -> None:
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


def _parquet_compression(compression: str | None) -> str:
    c = (compression or "none").lower()
    if c not in COMPRESSIONS:
        raise ValueError(f"compression must be one of {', '.join(COMPRESSIONS)}, not {compression!r}")
    return c


def _dictionary_columns(schema: pa.Schema) -> list[str]:
    return [f.name for f in schema
            if pa.types.is_dictionary(f.type) or f.name in _DICT_INT_COLUMNS]


# ------------------------------------------------------------- reading in-progress segments

def open_in_progress(path: str) -> tuple[pa.Schema | None, Iterator[pa.RecordBatch]]:
    """Open an in-progress `.arrows` segment, possibly cut short by a crash or still being
    written: (schema or None when not even the schema made it to disk, iterator over every
    whole batch; a torn batch at the end is left out, never returned in part)."""
    source = pa.memory_map(path, "r") if os.path.getsize(path) else None
    if source is None:
        return None, iter(())
    try:
        reader = ipc.open_stream(source)
    except (pa.ArrowInvalid, OSError, EOFError):
        source.close()
        return None, iter(())

    def batches():
        try:
            while True:
                try:
                    yield reader.read_next_batch()
                except StopIteration:
                    return
                except (pa.ArrowInvalid, OSError, EOFError):
                    return  # torn tail: everything before it is whole
        finally:
            source.close()

    return reader.schema, batches()


def _ipc_compression(batch: pa.RecordBatch) -> str | None:
    """IPC_COMPRESSION unless it fails to save IPC_MIN_SAVINGS on the last rows of batch
    (about 1 MiB of them, the newest data); with less than 64 KiB to judge by (a few
    control frames), IPC_COMPRESSION."""
    n, nbytes = batch.num_rows, batch.nbytes
    if n == 0 or nbytes < _IPC_SAMPLE_BYTES // 16:
        return IPC_COMPRESSION
    rows = max(1, min(n, int(n * _IPC_SAMPLE_BYTES / nbytes)))
    sample = batch.slice(n - rows, rows)
    sizes = []
    for codec in (None, IPC_COMPRESSION):
        sink = pa.BufferOutputStream()
        with ipc.new_stream(sink, batch.schema, options=ipc.IpcWriteOptions(compression=codec)) as w:
            w.write_batch(sample)
        sizes.append(sink.tell())
    return IPC_COMPRESSION if sizes[1] <= sizes[0] * (1 - IPC_MIN_SAVINGS) else None


def _statistics_columns(schema: pa.Schema) -> list[str]:
    """Min/max statistics where readers prune with them (numbers, timestamps, names); not
    on the frame bytes and keys, where they cost time and help no query."""
    return [f.name for f in schema
            if not (pa.types.is_binary(f.type) or pa.types.is_large_binary(f.type)
                    or pa.types.is_list(f.type) or f.name in ("row", "args"))]


# ------------------------------------------------------------------------- Parquet segment

class _ParquetSegment:
    """A Parquet file being written under `<final>.tmp`, one bounded row group at a time.

    A full row group is encoded on a helper thread (pyarrow releases the GIL while it
    encodes and compresses) while the next one fills, so the in-progress IPC copy, and
    with it the network side, keeps moving during the zstd pass. At most one row group is
    in flight: the next hand-off waits for it, which bounds memory to two row groups."""

    def __init__(self, final: str, schema: pa.Schema, compression: str):
        self.final = final
        self.tmp = final + TMP_SUFFIX
        self.schema = schema
        self.rows = 0
        self._batches: list[pa.RecordBatch] = []
        self._buffered = 0
        self._buffered_rows = 0
        self._encoding: concurrent.futures.Future | None = None
        self._encoder = None
        self._writer = pq.ParquetWriter(
            self.tmp, schema, compression=compression,
            use_dictionary=_dictionary_columns(schema), write_statistics=_statistics_columns(schema),
            data_page_version="2.0")

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
        self._wait()
        if self._batches:
            batches, self._batches, self._buffered, self._buffered_rows = self._batches, [], 0, 0
            if self._encoder is None:
                self._encoder = concurrent.futures.ThreadPoolExecutor(
                    max_workers=1, thread_name_prefix="dcptool-parquet")
            self._encoding = self._encoder.submit(self._write_row_group, batches)
        if wait:
            self._wait()

    def _write_row_group(self, batches: list) -> None:
        table = pa.Table.from_batches(batches, schema=self.schema).unify_dictionaries()
        self._writer.write_table(table, row_group_size=max(1, table.num_rows))
        _start_writeback(self.tmp)

    def _wait(self) -> None:
        fut, self._encoding = self._encoding, None
        if fut is not None:
            fut.result()   # an encoder error (disk full ...) surfaces here, in the caller

    def _stop_encoder(self) -> None:
        if self._encoder is not None:
            self._encoder.shutdown(wait=True)
            self._encoder = None

    def finish(self) -> int:
        """Write the last row group, fsync, rename into place; the size in bytes."""
        try:
            self.flush_row_group()
        finally:
            self._stop_encoder()
        self._writer.close()
        self._writer = None
        _fsync_path(self.tmp)
        os.replace(self.tmp, self.final)
        _fsync_dir(os.path.dirname(self.final) or ".")
        return os.path.getsize(self.final)

    def abandon(self) -> None:
        self._batches = []
        try:
            self._wait()
        except Exception:  # noqa: BLE001 - already failing; the tmp file goes anyway
            pass
        self._stop_encoder()
        if self._writer is not None:
            try:
                self._writer.close()
            except Exception:  # noqa: BLE001 - already failing; the tmp file goes anyway
                pass
            self._writer = None
        try:
            os.unlink(self.tmp)
        except OSError:
            pass


def finish_in_progress(arrows_path: str, compression: str = "zstd") -> dict | None:
    """Turn a leftover in-progress segment into a normal Parquet segment.

    Returns {"path", "rows", "bytes"} for a segment written now, or None when there was
    nothing to do: the segment is still being written by a live process (its lock is
    held), it was already renamed into place before the crash, or it held no whole row.
    """
    try:
        lock_fd = os.open(arrows_path, os.O_RDONLY)
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
            _unlink_quiet(final + TMP_SUFFIX)
            _unlink_quiet(arrows_path)
            return None
        schema, batches = open_in_progress(arrows_path)
        if schema is None:
            # killed before the first batch (the IPC stream writes its schema with it): no
            # row, and whatever Parquet file was started for the segment is empty too
            _unlink_quiet(final + TMP_SUFFIX)
            _unlink_quiet(arrows_path)
            return None
        try:
            seg = _ParquetSegment(final, schema, _parquet_compression(compression))
            try:
                for batch in batches:
                    seg.add(batch)
                if seg.rows == 0:
                    seg.abandon()
                    _unlink_quiet(arrows_path)
                    return None
                size = seg.finish()
            except BaseException:
                seg.abandon()
                raise
        except OSError as exc:
            raise WriterError(f"cannot write capture segment {final}: {_one_line(exc)}") from exc
        _unlink_quiet(arrows_path)
        return {"path": final, "rows": seg.rows, "bytes": size}
    finally:
        os.close(lock_fd)


def _unlink_quiet(path: str) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass


def _remove_quiet(path: str) -> None:
    """Unlink, ignoring every error: used while the disk is failing already."""
    try:
        os.unlink(path)
    except OSError:
        pass


def _finish_from_memory(arrows: str, compression: str) -> tuple[dict | None, int]:
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
    _remove_quiet(arrows)
    rows = sum(b.num_rows for b in batches)
    if schema is None or rows == 0:
        return None, 0
    final = final_path(arrows)
    seg = None
    try:
        seg = _ParquetSegment(final, schema, _parquet_compression(compression))
        for b in batches:
            seg.add(b)
        size = seg.finish()
    except Exception:  # noqa: BLE001 - the disk is failing: report the rows, not a trace
        if seg is not None:
            seg.abandon()
        _remove_quiet(final + TMP_SUFFIX)
        if os.path.exists(final):   # renamed into place (whole) before the error
            return {"path": final, "rows": rows, "bytes": os.path.getsize(final)}, 0
        return None, rows
    return {"path": final, "rows": seg.rows, "bytes": size}, 0


class _Finishing:
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
        _abandon_files(self.pq, self.ipc, self.ipc_sink, self.lock_fd)
        self.lock_fd = None


# ----------------------------------------------------------------------------- the writer

class CaptureWriter:
    """Writes one capture run as numbered segments in `directory` (see module docstring).

    `write` takes RecordBatches or Tables whose columns are a subset of the capture schema
    (missing columns become null, types are cast to the schema's); `capture_id` is filled
    in here; `frame_no` is required and must increase strictly over the whole run.

    Rotation: a new segment starts once the current one holds `rotate_size` bytes of rows
    measured as uncompressed Arrow data (which is what its in-progress `.arrows` file takes
    on disk; the finished Parquet file is several times smaller), or once it is
    `rotate_interval` seconds old. Rotation happens between batches.

    Not thread-safe: use it from one thread (`BackgroundWriter` does that for you). Call
    `tick()` now and then when no data flows, so that coalesced rows reach the disk and
    time-based rotation happens; `BackgroundWriter` ticks on its own.
    """

    def __init__(self, directory, protocol, *, source: str, options: dict,
                 capture_id: str | None = None, compression="zstd",
                 rotate_size=256 * 2**20, rotate_interval=300.0, flush_interval=1.0,
                 fsync_in_progress: bool = False):
        if protocol not in S.PROTOCOLS:
            raise ValueError(f"unknown protocol {protocol!r}")
        self.directory = os.fspath(directory)
        self.protocol = protocol
        self.source = source
        self.compression = _parquet_compression(compression)
        self.rotate_size = int(rotate_size) if rotate_size else 0
        self.rotate_interval = float(rotate_interval) if rotate_interval else 0.0
        self.flush_interval = float(flush_interval)
        # SIGKILL does not need it (the page cache outlives the process); a power cut does,
        # at the price of writing every in-progress byte to the disk each second
        self.fsync_in_progress = bool(fsync_in_progress)
        self.capture_id = capture_id or str(uuid.uuid4())
        started = _utcnow()
        self._started_dt = started
        self.started_at = started.strftime("%Y-%m-%dT%H:%M:%S.%fZ")
        self._options_json = json.dumps(strip_secrets(dict(options or {})), sort_keys=True,
                                        default=str, separators=(",", ":"))
        self._base_schema = S.capture_schema(protocol)
        self._names = set(self._base_schema.names)
        self._cid_dict = pa.array([self.capture_id], pa.string())

        self.segment = -1           # number of the segment being (or last) written
        self.segments: list[dict] = []   # finished: {"path", "rows", "bytes"}
        self.rows = 0               # rows accepted so far
        self.bytes_written = 0      # bytes of finished segments + in-progress IPC bytes
        self.error: WriterError | None = None
        self._last_frame_no: int | None = None

        self._pending: list[pa.RecordBatch] = []
        self._pending_bytes = 0
        self._pending_rows = 0
        self._pending_since = 0.0

        self._ipc = None
        self._ipc_sink = None
        self._lock_fd: int | None = None
        self._arrows: str | None = None
        self._pq: _ParquetSegment | None = None
        self._seg_bytes = 0
        self._seg_rows = 0
        self._seg_opened = 0.0
        self._last_fsync = 0.0
        self._ipc_bytes = 0
        self._finishing: tuple | None = None     # (_Finishing, Future) of a rotated segment
        self._finisher = None
        self._unfinished: list[str] = []         # in-progress files a disk error left behind
        self._abandoning = False
        self._closed = False

        try:
            os.makedirs(self.directory, exist_ok=True)
            if not os.access(self.directory, os.W_OK | os.X_OK):
                raise PermissionError(errno.EACCES, "permission denied")
        except OSError as exc:
            raise WriterError(f"cannot write captures to {self.directory}: {_one_line(exc)}") from exc

    # -- public API -----------------------------------------------------------------------

    def write(self, batch: "pa.RecordBatch | pa.Table") -> None:
        self._check_usable()
        if isinstance(batch, pa.Table):
            for b in batch.combine_chunks().to_batches():
                self.write(b)
            return
        if batch.num_rows == 0:
            return
        batch = self._conform(batch)
        self._collect_finished(block=False)
        now = time.monotonic()
        if not self._pending:
            self._pending_since = now
        self._pending.append(batch)
        self._pending_bytes += batch.nbytes
        self._pending_rows += batch.num_rows
        self.rows += batch.num_rows
        if (self._pending_bytes >= COALESCE_BYTES or self._pending_rows >= COALESCE_ROWS
                or now - self._pending_since >= self.flush_interval / 2
                or (self.rotate_size and self._seg_bytes + self._pending_bytes >= self.rotate_size)):
            self._guard(self._flush_pending, now, wait=False)
        else:
            self._guard(self._maybe_rotate, now, wait=False)

    def tick(self, now: float | None = None) -> None:
        """Push coalesced rows to the in-progress file, fsync it and rotate by time when
        due. Cheap when nothing is due."""
        if self._closed or self.error is not None:
            return
        now = time.monotonic() if now is None else now
        self._collect_finished(block=False)
        if self._pending and now - self._pending_since >= self.flush_interval / 2:
            self._guard(self._flush_pending, now)
        else:
            self._guard(self._maybe_rotate, now)
        if self.fsync_in_progress and self._lock_fd is not None \
                and now - self._last_fsync >= self.flush_interval:
            self._guard(self._fsync_in_progress, now)

    def flush(self) -> None:
        """Everything written so far onto the disk (in-progress file, fsync'ed; a rotated
        segment finished and in place)."""
        self._check_usable()
        self._guard(self._collect_finished, True)
        now = time.monotonic()
        self._guard(self._flush_pending, now, rotate=False)
        if self._lock_fd is not None:
            self._guard(self._fsync_in_progress, now)

    def rotate(self) -> None:
        """Finish the current segment now (the next write starts a new one)."""
        self._check_usable()
        self._guard(self._flush_pending, time.monotonic(), rotate=False)
        self._guard(self._finish_segment)

    def close(self) -> list[dict]:
        """Finish the current segment; the finished segments of the run. After a disk error
        this cleans up what it can (the in-progress file stays for `--resume`) and raises
        the error again."""
        if self._closed:
            if self.error is not None:
                raise self.error
            return list(self.segments)
        self._closed = True
        if self.error is None:
            try:
                self._guard(self._flush_pending, time.monotonic(), rotate=False)
                self._guard(self._finish_segment)
            except WriterError:
                pass
        if self.error is not None:
            self._abandon_segment()
            raise self.error
        self._stop_finisher()
        return list(self.segments)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        if exc[0] is None:
            self.close()
        else:
            try:
                self.close()
            except WriterError:
                if exc[0] is not WriterError:
                    raise
        return False

    @property
    def in_progress(self) -> str | None:
        return self._arrows

    # -- conforming batches to the schema ------------------------------------------------

    def set_options(self, options: dict) -> None:
        """Replace the dcptool.options metadata of segments started from now on (a DCP
        capture learns its negotiated features and controls after the handshake)."""
        self._options_json = json.dumps(strip_secrets(dict(options or {})), sort_keys=True,
                                        default=str, separators=(",", ":"))

    def _conform(self, batch: pa.RecordBatch) -> pa.RecordBatch:
        n = batch.num_rows
        if batch.schema.equals(self._base_schema):
            # already the capture schema (what `capture` hands over): only capture_id to fill
            out = batch.set_column(0, self._base_schema.field(0), self._cid_column(n))
            return self._checked(out)
        given = batch.schema.names
        unknown = [c for c in given if c not in self._names]
        if unknown:
            raise ValueError(f"columns not in the {self.protocol} capture schema: {', '.join(unknown)}")
        if "frame_no" not in given:
            raise ValueError("a capture batch needs a frame_no column")
        arrays = []
        for field in self._base_schema:
            name = field.name
            if name == "capture_id":
                arr = self._cid_column(n)
            elif name in given:
                arr = batch.column(name)
                if arr.type != field.type:
                    arr = arr.cast(field.type)
            else:
                arr = pa.nulls(n, field.type)
            arrays.append(arr)
        return self._checked(pa.RecordBatch.from_arrays(arrays, schema=self._base_schema))

    def _cid_column(self, n: int) -> pa.Array:
        return pa.DictionaryArray.from_arrays(pa.array(np.zeros(n, np.int32)), self._cid_dict)

    def _checked(self, out: pa.RecordBatch) -> pa.RecordBatch:
        self._check_order(out.column(1))
        if self.protocol == "dcp":
            out = self._mask_sasl(out)
        return out

    def _check_order(self, frame_no: pa.Array) -> None:
        if frame_no.null_count:
            raise ValueError("frame_no must not be null")
        fn = frame_no.to_numpy()
        if self._last_frame_no is not None and fn[0] <= self._last_frame_no:
            raise ValueError(f"frame_no must increase: {fn[0]} after {self._last_frame_no}")
        if len(fn) > 1 and not (np.diff(fn) > 0).all():
            raise ValueError("frame_no must increase within a batch")
        self._last_frame_no = int(fn[-1])

    def _mask_sasl(self, batch: pa.RecordBatch) -> pa.RecordBatch:
        """Find SASL AUTH/STEP requests by their header bytes, vectorised over the batch,
        and mask their values; other batches pass through untouched."""
        raw = batch.column(6)
        if raw.null_count == len(raw):
            return batch
        bufs = raw.buffers()
        if bufs[2] is None:
            return batch
        offsets = np.frombuffer(bufs[1], np.int32, count=len(raw) + 1, offset=raw.offset * 4)
        data = np.frombuffer(bufs[2], np.uint8)
        starts = offsets[:-1]
        long_enough = (offsets[1:] - starts) >= 24
        if not long_enough.any():
            return batch
        idx = np.nonzero(long_enough)[0]
        magic = data[starts[idx]]
        opcode = data[starts[idx] + 1]
        hit = ((magic == 0x80) | (magic == 0x08)) & ((opcode == 0x21) | (opcode == 0x22))
        if not hit.any():
            return batch
        values = raw.to_pylist()
        for i in idx[hit]:
            if values[i] is not None:
                values[i] = mask_sasl_credentials(values[i])
        return batch.set_column(6, batch.schema.field(6), pa.array(values, pa.binary()))

    # -- segments -------------------------------------------------------------------------

    def _segment_metadata(self, segment: int) -> dict[str, str]:
        return {
            S.META_FORMAT: S.FORMAT_VERSION,
            S.META_PROTOCOL: self.protocol,
            S.META_CAPTURE_ID: self.capture_id,
            S.META_SEGMENT: str(segment),
            S.META_STARTED_AT: self.started_at,
            S.META_VERSION: S.tool_version(),
            S.META_SOURCE: self.source,
            S.META_OPTIONS: self._options_json,
        }

    def _open_segment(self, now: float, sample: pa.RecordBatch) -> None:
        self.segment += 1
        final = os.path.join(self.directory, segment_name(self.protocol, self._started_dt,
                                                          self.capture_id, self.segment))
        arrows = in_progress_path(final)
        schema = self._base_schema.with_metadata(self._segment_metadata(self.segment))
        codec = _ipc_compression(sample)   # before the file exists: no window with an empty one
        fd = os.open(arrows, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        sink = writer = pq_seg = None
        try:
            # the lock tells `finish_in_progress` in another process that we are alive
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            # an unbuffered OS file: each IPC message is in the page cache when write returns.
            # Append mode: the file was just created empty, and opening it again with O_TRUNC
            # would make ext4 (auto_da_alloc) start writing it back to the disk on close, tens
            # of ms for a file that is about to be deleted.
            sink = pa.OSFile(arrows, "ab")
            writer = ipc.new_stream(sink, schema, options=ipc.IpcWriteOptions(compression=codec))
            pq_seg = _ParquetSegment(final, schema, self.compression)
        except BaseException:
            # no row is in the new segment yet: leave no file of it behind (disk full ...)
            _abandon_files(pq_seg, writer, sink, fd)
            _unlink_quiet(arrows)
            _unlink_quiet(final + TMP_SUFFIX)
            raise
        self._arrows, self._lock_fd = arrows, fd
        self._ipc_sink, self._ipc, self._pq = sink, writer, pq_seg
        self._seg_bytes = 0
        self._seg_rows = 0
        self._ipc_bytes = 0
        self._seg_opened = now
        self._last_fsync = now

    def _flush_pending(self, now: float, rotate: bool = True, wait: bool = True) -> None:
        if self._pending:
            batches, since = self._pending, self._pending_since
            rows = self._pending_rows
            self._pending, self._pending_bytes, self._pending_rows = [], 0, 0
            if len(batches) > 1 and rows < COALESCE_MIN_ROWS * len(batches):
                # many small batches: one copy buys one IPC message instead of many
                batches = [pa.concat_batches(batches)]
            if self._ipc is None:
                # the segment's age counts from its first row, not from this flush
                self._open_segment(min(since, now), max(batches, key=lambda b: b.nbytes))
            for batch in batches:
                self._ipc.write_batch(batch)
                self._pq.add(batch)
                self._seg_bytes += batch.nbytes
                self._seg_rows += batch.num_rows
            pos = self._ipc_sink.tell()
            self.bytes_written += pos - self._ipc_bytes
            self._ipc_bytes = pos
        if rotate:
            self._maybe_rotate(now, wait)

    def _maybe_rotate(self, now: float, wait: bool = True) -> None:
        """Rotate when due; wait=False (the write path) finishes the old segment on the
        helper thread, tick() (an idle writer) finishes it before returning."""
        if self._ipc is None:
            return
        if (self.rotate_size and self._seg_bytes >= self.rotate_size) or \
                (self.rotate_interval and now - self._seg_opened >= self.rotate_interval):
            self._flush_pending(now, rotate=False)
            self._finish_segment(wait=wait)

    def _fsync_in_progress(self, now: float) -> None:
        os.fsync(self._lock_fd)
        self._last_fsync = now

    def _finish_segment(self, wait: bool = True) -> None:
        """Finish the current segment: its Parquet file whole and renamed into place, then
        its in-progress file removed. wait=False (rotation) leaves that to a helper thread
        while the next segment fills, so a rotation does not stall the writer (and with it
        the network side) for the last row group, the fsync and the rename. One segment
        finishes at a time; finished segments are recorded in order."""
        self._collect_finished(block=True)
        if self._ipc is None:
            return
        seg = _Finishing(self._pq, self._ipc, self._ipc_sink, self._arrows, self._lock_fd,
                         self._ipc_bytes)
        self._ipc = self._ipc_sink = self._pq = self._arrows = None
        self._lock_fd = None
        self._ipc_bytes = 0
        self._seg_bytes = 0      # or the next write would flush at once, however small
        if wait:
            try:
                size = seg.complete()
            except OSError as exc:
                self._failed_finishing(seg, exc)
            self._record(seg, size)
            return
        if self._finisher is None:
            self._finisher = concurrent.futures.ThreadPoolExecutor(
                max_workers=1, thread_name_prefix="dcptool-segment")
        self._finishing = (seg, self._finisher.submit(seg.complete))

    def _collect_finished(self, block: bool) -> None:
        """Record the segment finished on the helper thread (waiting for it with block)."""
        if self._finishing is None:
            return
        seg, fut = self._finishing
        if not block and not fut.done():
            return
        self._finishing = None
        try:
            size = fut.result()
        except OSError as exc:
            self._failed_finishing(seg, exc)
        self._record(seg, size)

    def _record(self, seg: "_Finishing", size: int) -> None:
        self.bytes_written += size - seg.ipc_bytes
        self.segments.append({"path": seg.pq.final, "rows": seg.pq.rows, "bytes": size})

    def _failed_finishing(self, seg: "_Finishing", exc: OSError) -> None:
        seg.abandon()
        self._unfinished.append(seg.arrows)
        where = seg.pq.tmp if seg.pq.tmp in str(exc) else seg.arrows
        self.error = WriterError(f"cannot write capture segment {where}: {_one_line(exc)}")
        self.error.__cause__ = exc
        self._abandon_segment()
        raise self.error from exc

    def _abandon_segment(self) -> None:
        """After a disk error: drop the partial Parquet files, release everything, then make
        each unfinished segment a normal one from its in-progress file (the Parquet file just
        dropped gave the space back, and Parquet is smaller than the in-progress form). What
        cannot be finished is removed when it holds no whole row, and otherwise kept as a
        readable in-progress file that `capture --resume` finishes. The error's message says
        which happened."""
        if self._abandoning:
            return
        self._abandoning = True
        try:
            self._abandon_now()
        finally:
            self._abandoning = False

    def _abandon_now(self) -> None:
        try:
            self._collect_finished(block=True)   # a segment finishing on the helper thread
        except WriterError:
            pass
        _abandon_files(self._pq, self._ipc, self._ipc_sink, self._lock_fd)
        if self._arrows is not None and self._arrows not in self._unfinished:
            self._unfinished.append(self._arrows)
        self._ipc = self._ipc_sink = self._pq = self._arrows = None
        self._lock_fd = None
        self._pending = []
        self._stop_finisher()
        notes = [self._salvage(path) for path in self._unfinished]
        self._unfinished = []
        notes = [n for n in notes if n]
        if notes and self.error is not None and self.error.args:
            self.error.args = (f"{self.error.args[0]}; " + "; ".join(notes),) + self.error.args[1:]

    def _salvage(self, arrows: str) -> str | None:
        """Finish or remove one unfinished segment after a disk error (see above)."""
        final = final_path(arrows)
        done = None
        if os.path.exists(arrows):
            try:
                done = finish_in_progress(arrows, self.compression)
            except (WriterError, OSError):
                # no room for the Parquet file next to its in-progress copy: the rows go
                # to memory, the copy goes, and its space takes the Parquet file
                done, lost = _finish_from_memory(arrows, self.compression)
                if done is None:
                    _remove_quiet(final + TMP_SUFFIX)
                    return (f"removed {os.path.basename(arrows)}: its {lost} rows could not be saved"
                            if lost else f"removed {os.path.basename(arrows)} (no whole row)")
        _remove_quiet(final + TMP_SUFFIX)
        if done is None:
            return None     # it held no whole row: finish_in_progress removed it
        self.segments.append(done)
        self.segments.sort(key=lambda seg: seg["path"])
        return f"finished {os.path.basename(done['path'])} ({done['rows']} rows)"

    def _stop_finisher(self) -> None:
        if self._finisher is not None:
            self._finisher.shutdown(wait=True)
            self._finisher = None

    # -- errors ---------------------------------------------------------------------------

    def _check_usable(self) -> None:
        if self.error is not None:
            raise self.error
        if self._closed:
            raise ValueError("capture writer is closed")

    def _guard(self, fn, *args, **kw):
        """Run a disk operation; an OSError becomes a WriterError naming the file."""
        try:
            return fn(*args, **kw)
        except OSError as exc:
            where = self._arrows or self.directory
            if self._pq is not None and self._pq.tmp in str(exc):
                where = self._pq.tmp
            self.error = WriterError(f"cannot write capture segment {where}: {_one_line(exc)}")
            self.error.__cause__ = exc
            # at once, not at close: the files are right even if the process dies next
            self._abandon_segment()
            raise self.error from exc


# ------------------------------------------------------------------------ background writer

class BackgroundWriter:
    """Runs a CaptureWriter on its own thread behind a queue bounded in bytes.

    `submit` never drops a batch. By default it never blocks either: the network side
    watches `backlog_bytes` and stops acknowledging (DCP buffer acks) or reading once it is
    above `max_queue_bytes`, which slows the producer down. `submit(block=True)` waits for
    room instead. A disk error stops the thread; it is kept in `error` and raised by the
    next `submit` and by `close`.
    """

    def __init__(self, writer: CaptureWriter, max_queue_bytes=64 * 2**20, on_error=None):
        self.writer = writer
        # called (on the writer thread) once, when a disk error stops it: the network side
        # may be paused on the backlog and would otherwise never look at `error` again
        self.on_error = on_error
        self.max_queue_bytes = int(max_queue_bytes)
        self.error: BaseException | None = None
        self._queue: collections.deque = collections.deque()
        self._backlog = 0
        self._cv = threading.Condition()
        self._closing = False
        self._inflight = 0
        self._tick = max(0.05, writer.flush_interval / 4)
        self._thread = threading.Thread(target=self._run, name="dcptool-capture-writer",
                                        daemon=True)
        self._thread.start()

    @property
    def backlog_bytes(self) -> int:
        return self._backlog

    @property
    def congested(self) -> bool:
        return self._backlog >= self.max_queue_bytes

    def submit(self, batch, *, block: bool = False, timeout: float | None = None) -> None:
        if self.error is not None:
            raise self.error
        if self._closing:
            raise ValueError("background writer is closed")
        size = batch.nbytes
        with self._cv:
            if block:
                self._cv.wait_for(lambda: self._backlog < self.max_queue_bytes
                                  or self.error is not None, timeout=timeout)
                if self.error is not None:
                    raise self.error
            self._queue.append((batch, size))
            self._backlog += size
            self._cv.notify_all()

    def flush(self, timeout: float | None = None) -> bool:
        """Wait until everything submitted so far has been handed to the writer."""
        with self._cv:
            return self._cv.wait_for(lambda: not self._queue and self._inflight == 0
                                     or self.error is not None, timeout=timeout)

    def _run(self) -> None:
        w = self.writer
        try:
            while True:
                with self._cv:
                    if not self._queue and not self._closing:
                        self._cv.wait(timeout=self._tick)
                    items = list(self._queue)
                    self._queue.clear()
                    self._inflight = len(items)
                    stop = self._closing and not items
                for batch, size in items:
                    w.write(batch)
                    with self._cv:
                        self._backlog -= size
                        self._inflight -= 1
                        self._cv.notify_all()
                if stop:
                    return
                w.tick()
        except BaseException as exc:  # noqa: BLE001 - handed to the network side
            with self._cv:
                self.error = exc
                self._cv.notify_all()
            if self.on_error is not None:
                try:
                    self.on_error(exc)
                except Exception:  # noqa: BLE001 - the error itself is what gets reported
                    pass

    def close(self) -> list[dict]:
        """Write everything queued, finish the segment, return the finished segments."""
        with self._cv:
            self._closing = True
            self._cv.notify_all()
        self._thread.join()
        if self.error is not None:
            try:
                self.writer.close()
            except BaseException:  # noqa: BLE001 - the first error is the one to report
                pass
            raise self.error
        return self.writer.close()
