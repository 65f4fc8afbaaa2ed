"""A live capture against the built-in producer (tests/support/threaded_server.py), driven
without sleeps: kill points are counted in frames served and in data on disk, not seconds.

- `served(model, n, proc)`: until the producer has sent `n` stream frames in all.
- `data_on_disk(out, before)`: an in-progress segment not in `before` holds a data frame.
- `stop_live_updates(srv)`: returns once a `ThreadedServer(model, rate=...)` stopped changing
  its bucket."""

from __future__ import annotations

import asyncio
import os
import subprocess
import time

from dcptool.replay.store.segment import open_in_progress


def _until(condition, what: str, proc: subprocess.Popen | None, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert proc is None or proc.poll() is None, f"the client ended before {what}"
        assert time.monotonic() < deadline, f"never {what}"
        time.sleep(0.002)   # polling the condition, bounded by the deadline


def served(model, frames: int, proc: subprocess.Popen | None = None, timeout: float = 120.0) -> None:
    """Until `model` has served `frames` stream frames to all its connections together; fails
    if `proc` (the client under test) exits first or the deadline passes."""
    _until(lambda: model.stream_frames >= frames, f"{frames} frames served", proc, timeout)


def data_on_disk(out, before=(), proc: subprocess.Popen | None = None, timeout: float = 120.0) -> None:
    """Until an in-progress segment of `out` whose name is not in `before` has a data frame in
    a whole batch on disk (a file's size says nothing: the schema message alone is over 4 KiB)."""
    def found() -> bool:
        if not os.path.isdir(out):
            return False
        for name in os.listdir(out):
            if name.endswith(".arrows") and name not in before:
                try:
                    _, batches = open_in_progress(os.path.join(out, name))
                    if any("mutation" in b.column("op").to_pylist() for b in batches):
                        return True
                except OSError:
                    continue   # finished (renamed) meanwhile
        return False
    _until(found, f"data on disk in {out}", proc, timeout)


def stop_live_updates(srv, timeout: float = 30.0) -> None:
    """No more live mutations from `srv` once this returns: the rate is set to 0 on the
    server's own event loop (the live task reads it there, so none runs in between)."""
    async def _stop():
        srv.server.rate = 0.0
    asyncio.run_coroutine_threadsafe(_stop(), srv.loop).result(timeout)
