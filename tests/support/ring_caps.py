"""Captures for the retention-ring and shard tests: a DCP capture of an in-process producer
(seeded), and the same frames rewritten as a capture of several segments (a ring needs
segments to delete; the writer's own rotation depends on timing)."""

from __future__ import annotations

import json
import os

from dcptool.replay.store.reader import find_captures, read_capture_table
from dcptool.replay.store.schema import META_OPTIONS, META_SOURCE


def dcp_capture(out, *, vbuckets: int = 4, items: int = 400, seed: int = 5, settings: dict | None = None,
                **opts):
    """One capture of a seeded `serve dcp` producer (in this process) into `out`; the result."""
    from dcptool.capture import CaptureSettings, LiveOptions, capture, parse_source
    from dcptool.protocol.dcp.server import producer as P
    from dcptool.protocol.transport.dcp import ThreadedServer
    model = P.server_from_options(vbuckets=vbuckets, items=items, seed=seed)
    with ThreadedServer(model) as srv:
        lo = LiveOptions(source=parse_source(f"couchbase://{srv.host}:{srv.port}/default"), user=None,
                         name="ring-test", **opts)
        return capture(lo, CaptureSettings(output=str(out), **(settings or {})))


def resegmented(src, dst, pieces: int) -> list[str]:
    """The capture in `src` written again into `dst` as `pieces` segments of one capture
    (same frames, source and options); their paths in order."""
    from dcptool.replay.store.writer import CaptureWriter
    files = find_captures([str(src)])
    meta = files[0].metadata
    t = read_capture_table(files).drop_columns(["capture_id"])
    w = CaptureWriter(str(dst), files[0].protocol, source=meta[META_SOURCE],
                      options=json.loads(meta[META_OPTIONS]))
    step = -(-t.num_rows // pieces)
    for i in range(pieces):
        part = t.slice(i * step, step)
        if part.num_rows:
            w.write(part)
            w.rotate()
    return [seg["path"] for seg in w.close()]


def set_finished(paths, when: float) -> None:
    """Give segments a finish time (their mtime), for a ring's --retain-age."""
    for p in paths:
        os.utime(p, (when, when))
