"""Driving the built-in producer (transport.dcp.ThreadedServer) from a test without sleeps:
`served(model, n, proc)` waits until the producer has sent `n` stream frames in all (a seeded
kill point counted in frames, not seconds), and `stop_live_updates(srv)` returns once the
bucket of a `ThreadedServer(model, rate=...)` has stopped changing."""

from __future__ import annotations

import asyncio
import subprocess
import time


def served(model, frames: int, proc: subprocess.Popen | None = None, timeout: float = 120.0) -> None:
    """Until `model` has served `frames` stream frames to all its connections together; fails
    if `proc` (the client under test) exits first or the deadline passes."""
    deadline = time.monotonic() + timeout
    while model.stream_frames < frames:
        assert proc is None or proc.poll() is None, "the client ended before its kill point"
        assert time.monotonic() < deadline, f"the producer never served {frames} frames"
        time.sleep(0.002)   # polling the condition, bounded by the deadline


def stop_live_updates(srv, timeout: float = 30.0) -> None:
    """No more live mutations from `srv` once this returns: the rate is set to 0 on the
    server's own event loop (the live task reads it there, so none runs in between)."""
    async def _stop():
        srv.server.rate = 0.0
    asyncio.run_coroutine_threadsafe(_stop(), srv.loop).result(timeout)
