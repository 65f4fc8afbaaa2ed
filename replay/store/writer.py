"""The capture writer: segments, rotation and crash safety (CAPTURE_FORMAT.md). The on-disk
segment is segment.py, names naming.py, redaction redact.py, the writer thread background.py,
the encoder thread encoder.py.

Every batch handed to `CaptureWriter.write` goes two ways:

* into the in-progress segment, an Arrow IPC stream `<segment>.arrows` written through an
  unbuffered OS file, so that what was written is in the page cache at once and survives a
  SIGKILL of the process (with `fsync_in_progress=True` also fsync'ed each `flush_interval`, for power loss);
* into a bounded row-group buffer that is handed to the writer's encoder thread whenever it
  holds `ROW_GROUP_BYTES`, and encoded there to `<segment>.parquet.tmp` while the next one
  fills (at most `ENCODER_QUEUE_ROW_GROUPS` handed over and not yet written; a hand-off
  waits for room). One encoder thread serves the segments in turn, so each file gets its
  row groups in `frame_no` order.

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

import concurrent.futures
import errno
import fcntl
import json
import os
import time
import uuid

import numpy as np
import pyarrow as pa
import pyarrow.ipc as ipc

from dcptool.replay.store import schema as S
from dcptool.replay.store.encoder import RowGroupEncoder
from dcptool.replay.store.files import (
    arrow_path,
    one_line,
    remove_quiet,
    shown,
    unlink_quiet,
)
from dcptool.replay.store.naming import (
    TMP_SUFFIX,
    final_path,
    in_progress_path,
    segment_name,
    utcnow,
)
from dcptool.replay.store.redact import mask_sasl_credentials, strip_secrets
from dcptool.replay.store.segment import (
    Finishing,
    ParquetSegment,
    WriterError,
    abandon_files,
    finish_from_memory,
    finish_in_progress,
    ipc_compression,
    parquet_compression,
)

COALESCE_BYTES = 4 * 2**20         # small batches are merged up to this size ...
COALESCE_ROWS = 32_768             # ... or this many rows before they reach the IPC stream
COALESCE_MIN_ROWS = 4_096          # a batch with this many rows ...
COALESCE_MIN_BYTES = 512 * 2**10   # ... or this many bytes is not merged (large values: no copy)


# ----------------------------------------------------------------------------- helpers

def _coalesced(batches: list) -> list:
    """Runs of small batches merged into one (one copy of little data buys one IPC message
    instead of many); a batch of COALESCE_MIN_ROWS rows or COALESCE_MIN_BYTES bytes passes as
    it is, so large values (a few hundred 16 KiB frames per receive) are never copied here."""
    out: list = []
    run: list = []

    def end_run() -> None:
        if run:
            out.append(run[0] if len(run) == 1 else pa.concat_batches(run))
            run.clear()

    for b in batches:
        if b.num_rows < COALESCE_MIN_ROWS and b.nbytes < COALESCE_MIN_BYTES:
            run.append(b)
        else:
            end_run()
            out.append(b)
    end_run()
    return out


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
        self.compression = parquet_compression(compression)
        self.rotate_size = int(rotate_size) if rotate_size else 0
        self.rotate_interval = float(rotate_interval) if rotate_interval else 0.0
        self.flush_interval = float(flush_interval)
        # SIGKILL does not need it (the page cache outlives the process); a power cut does,
        # at the price of writing every in-progress byte to the disk each second
        self.fsync_in_progress = bool(fsync_in_progress)
        self.capture_id = capture_id or str(uuid.uuid4())
        started = utcnow()
        self._started_dt = started
        self.started_at = started.strftime("%Y-%m-%dT%H:%M:%S.%fZ")
        self.set_options(options)
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

        self._ipc: ipc.RecordBatchStreamWriter | None = None
        self._ipc_sink: pa.OSFile | None = None
        self._lock_fd: int | None = None
        self._arrows: str | None = None
        self._pq: ParquetSegment | None = None
        self._seg_bytes = 0
        self._seg_rows = 0
        self._seg_opened = 0.0
        self._last_fsync = 0.0
        self._ipc_bytes = 0
        self._finishing: tuple | None = None     # (Finishing, Future) of a rotated segment
        self._finisher: concurrent.futures.ThreadPoolExecutor | None = None
        self._encoder: RowGroupEncoder | None = None   # started with the first segment
        self._unfinished: list[str] = []         # in-progress files a disk error left behind
        self._abandoning = False
        self._closed = False

        try:
            os.makedirs(self.directory, exist_ok=True)
            if not os.access(self.directory, os.W_OK | os.X_OK):
                raise PermissionError(errno.EACCES, "permission denied")
        except OSError as exc:
            raise WriterError(f"cannot write captures to {self.directory}: {one_line(exc)}") from exc

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
        self._stop_encoder()
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

    @property
    def encoder(self) -> RowGroupEncoder | None:
        """The thread encoding row groups (its counters show how full its queue got)."""
        return self._encoder

    # -- conforming batches to the schema ------------------------------------------------

    def set_options(self, options: dict, source_id: str | None = None) -> None:
        """The dcptool.options metadata (and the source's identity, dcptool.source_id) of segments
        started from now on (a capture learns them when its connection is set up)."""
        self._source_id = source_id or None
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
        raw_i = batch.schema.get_field_index("raw")
        raw = batch.column(raw_i)
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
        return batch.set_column(raw_i, batch.schema.field(raw_i), pa.array(values, pa.binary()))

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
            S.META_OPTIONS: self._options_json, **({S.META_SOURCE_ID: self._source_id} if self._source_id else {}),
        }

    def _open_segment(self, now: float, sample: pa.RecordBatch) -> None:
        self.segment += 1
        final = os.path.join(self.directory, segment_name(self.protocol, self._started_dt,
                                                          self.capture_id, self.segment))
        arrows = in_progress_path(final)
        schema = self._base_schema.with_metadata(self._segment_metadata(self.segment))
        codec = ipc_compression(sample)   # before the file exists: no window with an empty one
        fd = os.open(arrows, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        sink = writer = pq_seg = None
        try:
            # the lock tells `finish_in_progress` in another process that we are alive
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            # an unbuffered OS file: each IPC message is in the page cache when write returns.
            # Append mode: the file was just created empty, and opening it again with O_TRUNC
            # would make ext4 (auto_da_alloc) start writing it back to the disk on close, tens
            # of ms for a file that is about to be deleted.
            sink = pa.OSFile(arrow_path(arrows), "ab")
            writer = ipc.new_stream(sink, schema, options=ipc.IpcWriteOptions(compression=codec))
            if self._encoder is None:
                self._encoder = RowGroupEncoder()
            pq_seg = ParquetSegment(final, schema, self.compression, self._encoder)
        except BaseException:
            # no row is in the new segment yet: leave no file of it behind (disk full ...)
            abandon_files(pq_seg, writer, sink, fd)
            unlink_quiet(arrows)
            unlink_quiet(final + TMP_SUFFIX)
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
            batches, since = _coalesced(self._pending), self._pending_since
            self._pending, self._pending_bytes, self._pending_rows = [], 0, 0
            if self._ipc is None:
                # the segment's age counts from its first row, not from this flush
                self._open_segment(min(since, now), max(batches, key=lambda b: b.nbytes))
            assert self._ipc is not None and self._pq is not None and self._ipc_sink is not None  # open
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
        if self._lock_fd is not None:     # always, as tick and flush call it
            os.fsync(self._lock_fd)
        self._last_fsync = now

    def _finish_segment(self, wait: bool = True) -> None:
        """Finish the current segment: its Parquet file whole and renamed into place, then
        its in-progress file removed. wait=False (rotation) leaves that to a helper thread
        while the next segment fills, so a rotation does not stall the writer (and with it
        the network side) for the last row group, the fsync and the rename. One segment
        finishes at a time; finished segments are recorded in order."""
        self._collect_finished(block=True)
        if self._ipc is None or self._pq is None:      # (no segment open: both None)
            return
        # the last row group goes to the encoder from here, ahead of the next segment's
        self._pq.flush_row_group(wait=False)
        seg = Finishing(self._pq, self._ipc, self._ipc_sink, self._arrows, self._lock_fd,
                         self._ipc_bytes)
        self._ipc = self._ipc_sink = self._pq = self._arrows = self._lock_fd = None
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

    def _record(self, seg: "Finishing", size: int) -> None:
        self.bytes_written += size - seg.ipc_bytes
        self.segments.append({"path": seg.pq.final, "rows": seg.pq.rows, "bytes": size})

    def _failed_finishing(self, seg: "Finishing", exc: OSError) -> None:
        seg.abandon()
        self._unfinished.append(seg.arrows)
        where = seg.pq.tmp if seg.pq.tmp in str(exc) else seg.arrows
        self.error = WriterError(f"cannot write capture segment {where}: {one_line(exc)}")
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
        abandon_files(self._pq, self._ipc, self._ipc_sink, self._lock_fd)
        if self._arrows is not None and self._arrows not in self._unfinished:
            self._unfinished.append(self._arrows)
        self._ipc = self._ipc_sink = self._pq = self._arrows = self._lock_fd = None
        self._pending = []
        self._stop_finisher()
        self._stop_encoder()
        pending = sorted(self._unfinished)        # segment order (the names differ only there)
        salvaged = [self._salvage(path, pending[i + 1:]) for i, path in enumerate(pending)]
        self._unfinished = []
        notes = [n for n in salvaged if n]
        if notes and self.error is not None and self.error.args:
            self.error.args = (f"{self.error.args[0]}; " + "; ".join(notes),) + self.error.args[1:]

    def _salvage(self, arrows: str, later: list[str]) -> str | None:
        """Finish or remove one unfinished segment after a disk error (see above). `later`: the
        unfinished segments after it, given up when it needs their room (the capture stays a
        prefix of the stream, with no hole: a resumed capture fetches their frames again)."""
        final = final_path(arrows)
        done, dropped = None, ""
        if os.path.exists(arrows):
            try:
                done = finish_in_progress(arrows, self.compression)
            except (WriterError, OSError):
                # no room for the Parquet file next to its in-progress copy: the later segments
                # give theirs back, the rows go to memory, the copy goes, and its space takes
                # the Parquet file
                gone = [p for p in later if os.path.exists(p)]
                for p in gone:
                    remove_quiet(p)
                    remove_quiet(final_path(p) + TMP_SUFFIX)
                dropped = "".join(f"; removed {os.path.basename(p)} (the end of the capture, after it)" for p in gone)
                done, lost = finish_from_memory(arrows, self.compression)
                if done is None:
                    remove_quiet(final + TMP_SUFFIX)
                    return (f"removed {os.path.basename(arrows)}: its {lost} rows could not be saved"
                            if lost else f"removed {os.path.basename(arrows)} (no whole row)") + dropped
        remove_quiet(final + TMP_SUFFIX)
        if done is None:
            return dropped[2:] or None     # it held no whole row: finish_in_progress removed it
        if done.get("path") is None:
            return (done.get("note") or "") + dropped or None     # damaged or torn, no whole row
        self.segments.append({k: done[k] for k in ("path", "rows", "bytes")})
        self.segments.sort(key=lambda seg: seg["path"])
        text = f"finished {os.path.basename(shown(done['path']))} ({done['rows']} rows)"
        return (f"{text}; {done['note']}" if done.get("note") else text) + dropped

    def _stop_finisher(self) -> None:
        if self._finisher is not None:
            self._finisher.shutdown(wait=True)
            self._finisher = None

    def _stop_encoder(self) -> None:
        if self._encoder is not None:
            self._encoder.close()      # kept: its counters stay readable

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
            self.error = WriterError(f"cannot write capture segment {where}: {one_line(exc)}")
            self.error.__cause__ = exc
            # at once, not at close: the files are right even if the process dies next
            self._abandon_segment()
            raise self.error from exc


# ------------------------------------------------------------------------ background writer
