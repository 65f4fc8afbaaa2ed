"""One writer per capture directory and shard (issue 36): a live `capture` holds a lock in its
directory for its whole run (recovery of `--resume`, the stream, the end-of-run merge), and
`compact` holds it while it merges. The locks are `flock`s on hidden files in the directory,
released by the kernel when the process ends however it ends: a SIGKILL never leaves a stale
lock. The last holder of a file removes it while it still holds it, and a holder that finds
its file gone (or replaced) after locking it takes the new one: no file is left behind after a
clean end, and two holders never hold two files of one name.

* `.dcptool.lock`: a capture without `--shard` and `compact` hold it exclusively; a capture
  with `--shard K/N` holds it shared, so that the shards of one bucket may write into one
  directory side by side while neither an unsharded capture nor `compact` can start;
* `.dcptool.lock.K-N` (a capture with `--shard K/N`), `.dcptool.lock.all` (one without) and
  `.dcptool.lock.compact`: each holder holds its own exclusively, so a second process of the
  same shard is refused, and writes who it is there (pid, start time, shard, command); a
  refusal names the live holders (`DirectoryBusy`, a usage error: exit 2)."""

from __future__ import annotations

import datetime as dt
import errno
import fcntl
import json
import os
from dataclasses import dataclass, field
from typing import Any

from dcptool.protocol.errors import DcptoolError, LateUsageError
from dcptool.replay.store.files import shown

LOCK_NAME = ".dcptool.lock"


class LockFailed(DcptoolError):
    """The lock file of a capture directory cannot be made or opened (read-only, no room ...)."""


class DirectoryBusy(LateUsageError):
    """Another live capture (of the same shard, or any capture for an unsharded one or for
    `compact`) holds the capture directory: refused before anything is read or written."""


@dataclass
class DirectoryLock:
    """The locks one process holds on a capture directory; `release` (or the process's end)
    gives them back."""
    directory: str
    fds: list[tuple[int, str]] = field(default_factory=list)

    def release(self) -> None:
        for fd, path in reversed(self.fds):
            try:
                if _try(fd, fcntl.LOCK_EX) and _same_file(fd, path):
                    os.unlink(path)   # nobody else holds it: removed while still held
            except OSError:
                pass
            try:
                os.close(fd)      # closing the only descriptor of the open file drops its flock
            except OSError:
                pass
        self.fds = []

    def __enter__(self) -> DirectoryLock:
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()


def own_lock_name(shard: str | None, command: str = "capture") -> str:
    """The lock file a holder holds exclusively and describes itself in."""
    return f"{LOCK_NAME}.{'compact' if command == 'compact' else shard.replace('/', '-') if shard else 'all'}"


def _same_file(fd: int, path: str) -> bool:
    try:
        st, now = os.fstat(fd), os.stat(path)
    except OSError:
        return False
    return (st.st_dev, st.st_ino) == (now.st_dev, now.st_ino)


def _try(fd: int, mode: int) -> bool:
    try:
        fcntl.flock(fd, mode | fcntl.LOCK_NB)
    except BlockingIOError:
        return False
    return True


def _lock(lock: DirectoryLock, path: str, mode: int) -> int | None:
    """Open (create) the lock file at `path` and flock it with `mode`: its descriptor, kept in
    `lock`, or None when another process holds it. A file removed by its last holder between
    our open and our lock is opened again."""
    for _ in range(100):
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
        if not _try(fd, mode):
            os.close(fd)
            return None
        if _same_file(fd, path):
            lock.fds.append((fd, path))
            return fd
        os.close(fd)
    raise OSError(errno.EAGAIN, "its lock file keeps being replaced")


def _holder(path: str) -> dict[str, Any] | None:
    """Who holds the lock file at `path` (what it wrote), or None when nobody holds it."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    except OSError:
        return None
    try:
        if _try(fd, fcntl.LOCK_EX):
            return None           # free (we held it for an instant; closing gives it back)
        try:
            info = json.loads(os.pread(fd, 4096, 0) or b"{}")
        except (ValueError, OSError):
            info = {}
        return info if isinstance(info, dict) else {}
    finally:
        os.close(fd)


def holders(directory: str) -> list[dict[str, Any]]:
    """The live holders of the locks of `directory` (each: pid, started, shard, command)."""
    try:
        names = sorted(n for n in os.listdir(directory) if n.startswith(LOCK_NAME + "."))
    except OSError:
        return []
    return [h for n in names if (h := _holder(os.path.join(directory, n))) is not None]


def _who(found: list[dict[str, Any]]) -> str:
    if not found:
        return "another process"
    parts = []
    for h in found:
        shard = f", shard {h['shard']}" if h.get("shard") else ""
        parts.append(f"{h.get('command', 'capture')} (pid {h.get('pid', '?')}, started {h.get('started', '?')}{shard})")
    return "; ".join(parts)


def _busy(directory: str, what: str, only: str | None = None) -> DirectoryBusy:
    found = holders(directory)
    if only is not None:
        found = [h for h in found if h.get("shard") == only] or found
    return DirectoryBusy(f"{shown(directory)}: {_who(found)} writes into this capture directory: one writer per "
                         f"capture directory and shard; {what}")


def hold(directory: str, *, shard: str | None = None, command: str = "capture") -> DirectoryLock:
    """Take the locks of `directory` (created if missing) for a capture (of `shard`, a "K/N"
    string, or of every vbucket) or, with command "compact", for compaction. Raises
    DirectoryBusy naming the holders when another live process has them."""
    os.makedirs(directory, exist_ok=True)
    lock = DirectoryLock(directory)
    advice = ("wait for it to end" if command == "compact"
              else "stop it first, or capture into another --output")
    try:
        if _lock(lock, os.path.join(directory, LOCK_NAME), fcntl.LOCK_SH if shard else fcntl.LOCK_EX) is None:
            raise _busy(directory, advice)
        own = _lock(lock, os.path.join(directory, own_lock_name(shard, command)), fcntl.LOCK_EX)
        if own is None:
            raise _busy(directory, advice, only=shard)
        info = {"pid": os.getpid(), "command": command, "shard": shard,
                "started": dt.datetime.now(dt.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")}
        os.ftruncate(own, 0)
        os.pwrite(own, json.dumps(info).encode(), 0)
    except OSError as exc:
        lock.release()
        raise LockFailed(f"{shown(directory)}: cannot take the capture directory's lock ({exc.strerror})") from None
    except BaseException:
        lock.release()
        raise
    return lock
