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


def first_line(exc: BaseException) -> str:
    """An error's first line, for a message that names a file (undecodable bytes escaped)."""
    text = str(exc).strip() or type(exc).__name__
    return shown(text.splitlines()[0])


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


def arrow_path(path: str):
    """`path` as pyarrow's OS files take it: the str itself when it is valid UTF-8 (pyarrow
    encodes str paths as UTF-8), else its file-system bytes (os.fsencode): a name that is not
    UTF-8, or a non-ASCII one under a C locale, arrives surrogate-escaped and pyarrow would
    refuse it with "surrogates not allowed"."""
    try:
        path.encode("utf-8")
        return path
    except UnicodeEncodeError:
        return os.fsencode(path)


def arrow_source(path: str, mode: str = "rb"):
    """What to hand a pyarrow reader or writer that takes a path or a file: the path when
    pyarrow can encode it, else the file opened here as a pyarrow OS file (closed when it is
    dropped, or by the caller)."""
    where = arrow_path(path)
    if isinstance(where, str):
        return where
    import pyarrow as pa
    return pa.OSFile(where, mode)


def shown(path) -> str:
    """A path for messages and output: a name that did not decode (not UTF-8, or not ASCII
    under a C locale) shows its bytes as ASCII `\\xff` escapes instead of failing to print."""
    text = os.fspath(path)
    try:
        text.encode("utf-8")
        return text
    except UnicodeEncodeError:
        return os.fsencode(text).decode("ascii", "backslashreplace")
