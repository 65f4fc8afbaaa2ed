"""File-system steps the store takes with care: fsync of files and directories, early
writeback, quiet removal, and one-line descriptions of OS errors."""

from __future__ import annotations

import errno
import os

def one_line(exc: BaseException) -> str:
    """The OS error as one line: `No space left on device (ENOSPC)` for an errno (pyarrow's
    own text, `Error writing bytes to file. Detail: [errno 28] ...`, says less)."""
    code = getattr(exc, "errno", None)
    if isinstance(code, int) and code in errno.errorcode:
        return f"{os.strerror(code)} ({errno.errorcode[code]})"
    text = (getattr(exc, "strerror", None) or str(exc) or type(exc).__name__)
    return text.splitlines()[0]


def fsync_dir(directory: str) -> None:
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


def start_writeback(path: str) -> None:
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


def fsync_path(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def unlink_quiet(path: str) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass


def remove_quiet(path: str) -> None:
    """Unlink, ignoring every error: used while the disk is failing already."""
    try:
        os.unlink(path)
    except OSError:
        pass
