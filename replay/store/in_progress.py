"""Reading an in-progress segment (`.arrows`, an Arrow IPC stream) batch by batch, and
telling what could not be read: a crash can cut its last message short, and a damaged disk
or a stray write can put garbage anywhere in it. Every whole batch before the first bad
byte is returned; `unread` then says how many bytes after it were not (CAPTURE_FORMAT.md
"Crash recovery"). A torn tail (`torn`: the unread bytes are one IPC message cut short, or
zeros, what a crash or a full disk leaves at the end of a log) is the end of the file, not
damage: recovery truncates it to the last whole batch. A file with other unread bytes is kept
aside as `<name>.arrows.damaged` instead of deleted: nothing recorded is deleted unless it was
copied whole."""

from __future__ import annotations

import fcntl
import os
import struct
from typing import Any, BinaryIO, Iterator

import pyarrow as pa
import pyarrow.ipc as ipc

from dcptool.replay.store.files import arrow_path, shown
from dcptool.replay.store.naming import DAMAGED_SUFFIX  # noqa: F401 (in_progress.DAMAGED_SUFFIX: the name callers use)


class InProgress:
    """One in-progress segment opened for reading. Iterate it for its whole batches (each
    validated: a batch whose buffers do not hold together counts as damage, not as rows);
    after the iteration `rows`, `batches`, `good_end` (the byte after the last whole batch)
    and `unread` (bytes after it that could not be read, 0 for a clean file or a clean end
    of stream) describe the file, `error` the first failure."""

    def __init__(self, path: str, validate: bool = True):
        self.path = path
        self.validate = validate
        self.size = os.path.getsize(arrow_path(path))
        self.schema: pa.Schema | None = None
        self.rows = 0
        self.batches = 0
        self.good_end = 0
        self.error: str | None = None
        self._torn: bool | None = None
        self._done = self.size == 0
        self._source: Any = None        # pyarrow's memory map and stream reader (untyped)
        self._reader: Any = None
        if self.size == 0:
            return
        try:
            self._source = pa.memory_map(arrow_path(path), "r")
            self._reader = ipc.open_stream(self._source)
            self.schema = self._reader.schema
            self.good_end = self._source.tell()
        except (pa.ArrowException, OSError, EOFError, ValueError) as exc:
            self.error = _one_line(exc)
            self._close()
            self._done = True

    def __iter__(self) -> Iterator[pa.RecordBatch]:
        if self._done:
            return
        try:
            while True:
                try:
                    batch = self._reader.read_next_batch()
                    if self.validate:
                        batch.validate(full=True)
                except StopIteration:
                    self.good_end = self._source.tell()     # past a clean end-of-stream marker
                    return
                except (pa.ArrowException, OSError, EOFError, ValueError) as exc:
                    self.error = _one_line(exc)
                    return
                self.good_end = self._source.tell()
                self.rows += batch.num_rows
                self.batches += 1
                yield batch
        finally:
            self._done = True
            self._close()

    def read_all(self) -> list[pa.RecordBatch]:
        return list(self)

    @property
    def unread(self) -> int:
        """Bytes after the last whole batch that could not be read (after the iteration)."""
        return max(0, self.size - self.good_end)

    @property
    def torn(self) -> bool:
        """Whether the unread bytes (after the iteration) are only a torn tail: the start of one
        IPC message whose declared length runs past the end of the file, or zeros."""
        if not self.unread:
            return False
        if self._torn is None:
            self._torn = torn_tail(self.path, self.good_end, self.size)
        return self._torn

    def tail(self) -> str | None:
        """One line on a torn tail (None when there is none): info, never damage."""
        if not self.torn:
            return None
        return (f"a torn tail of {self.unread:,} bytes after byte {self.good_end:,} (its last batch cut "
                f"short by a crash or a full disk) dropped; {self.rows:,} rows in {self.batches:,} whole "
                "batches before it")

    def damage(self) -> str | None:
        """One line on what could not be read, or None when every byte was read or only a torn
        tail was not (`tail`)."""
        if not self.unread or self.torn:
            return None
        why = f": {self.error}" if self.error else ""
        if self.schema is None:
            return f"{self.unread:,} bytes unreadable, not even the schema (no row){why}"
        return (f"{self.unread:,} bytes after byte {self.good_end:,} unreadable{why}; "
                f"{self.rows:,} rows in {self.batches:,} whole batches before them read")

    def _close(self) -> None:
        if self._source is not None:
            try:
                self._source.close()
            except Exception:  # noqa: BLE001 - closing a read-only map
                pass
            self._source = None


CONTINUATION = b"\xff\xff\xff\xff"
_MAX_METADATA = 1 << 24     # an IPC message's flatbuffer header is small; a larger length is garbage


def torn_tail(path: str, start: int, size: int) -> bool:
    """Whether the bytes of `path` from `start` to `size` are a torn tail: whole dictionary
    messages (which the reader takes with the batch after them), then zeros (blocks a crash left
    unwritten) or one IPC message cut short (its continuation marker and metadata length, cut
    anywhere, or whole with a body that runs past the end of the file). Garbage, or a whole
    record batch that did not read, is damage."""
    with open(arrow_path(path), "rb") as fh:
        pos = start
        while True:
            fh.seek(pos)
            head = fh.read(8)
            if not head.strip(b"\0") and _zeros(fh):
                return True
            if len(head) < 8:
                return CONTINUATION.startswith(head[:4]) and (len(head) <= 4 or head[:4] == CONTINUATION)
            meta_len = struct.unpack_from("<i", head, 4)[0]
            if head[:4] != CONTINUATION or not 0 < meta_len <= _MAX_METADATA:
                return False
            meta = fh.read(meta_len)
            if len(meta) < meta_len:
                return True     # cut inside the message's metadata
            fields = _message_fields(meta)
            if fields is None:
                return False
            kind, body = fields
            end = pos + 8 + meta_len + body
            if end > size:
                return True     # the body runs past the end: cut short
            if kind != _DICTIONARY_BATCH:
                return False    # a whole message the reader could not read: damage
            pos = end


def _zeros(fh: BinaryIO) -> bool:
    """Whether the rest of the file from where `fh` stands (less its first 8 bytes) is zeros."""
    while True:
        chunk = fh.read(1 << 20)
        if not chunk:
            return True
        if chunk.strip(b"\0"):
            return False


_DICTIONARY_BATCH = 2     # MessageHeader union tag of a DictionaryBatch (Arrow's Message.fbs)


def _message_fields(meta: bytes) -> tuple[int, int] | None:
    """(header type, bodyLength) of an Arrow IPC Message flatbuffer (fields 1 and 3 of its root
    table), or None when the buffer does not hold together."""
    try:
        table = struct.unpack_from("<I", meta, 0)[0]
        vtable = table - struct.unpack_from("<i", meta, table)[0]
        vt_size = struct.unpack_from("<H", meta, vtable)[0]

        def field(i: int, fmt: str) -> int:
            if vt_size < 4 + 2 * (i + 1):
                return 0
            off = struct.unpack_from("<H", meta, vtable + 4 + 2 * i)[0]
            return int(struct.unpack_from(fmt, meta, table + off)[0]) if off else 0
        kind, body = field(1, "<B"), field(3, "<q")
    except struct.error:
        return None
    return (kind, body) if body >= 0 else None


def held_by_writer(path: str) -> bool:
    """True while a live capture writes the file (it holds its lock): its last message may be
    half written right now, which is not damage."""
    try:
        fd = os.open(arrow_path(path), os.O_RDONLY)
    except OSError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        return False
    except BlockingIOError:
        return True
    except OSError:
        return False
    finally:
        os.close(fd)


def set_aside(path: str) -> str:
    """Rename a damaged in-progress file to `<name>.damaged` (`.damaged.1` ... when taken);
    the new path."""
    base = path + DAMAGED_SUFFIX
    dest, n = base, 0
    while os.path.lexists(dest):
        n += 1
        dest = f"{base}.{n}"
    os.rename(path, dest)
    return dest


def _one_line(exc: BaseException) -> str:
    text = str(exc).strip() or type(exc).__name__
    return shown(text.splitlines()[0])
