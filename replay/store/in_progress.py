"""Reading an in-progress segment (`.arrows`, an Arrow IPC stream) batch by batch, and
telling what could not be read: a crash can cut its last message short, and a damaged disk
or a stray write can put garbage anywhere in it. Every whole batch before the first bad
byte is returned; `unread` then says how many bytes after it were not (CAPTURE_FORMAT.md
"Crash recovery"). Recovery keeps a file with unread bytes aside as `<name>.arrows.damaged`
instead of deleting it: nothing recorded is deleted unless it was copied whole."""

from __future__ import annotations

import fcntl
import os
from typing import Any, Iterator

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

    def damage(self) -> str | None:
        """One line on what could not be read, or None when every byte was read."""
        if not self.unread:
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
