"""Captures for the retention-ring and shard tests: a DCP capture of an in-process producer
(seeded), and the same frames rewritten as a capture of several segments (a ring needs
segments to delete; the writer's own rotation depends on timing)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

from dcptool.replay.store.reader import find_captures, read_capture_table
from dcptool.replay.store.schema import META_OPTIONS, META_SOURCE

SCRIPT = r"""
import json, sys
from dcptool.capture import CaptureSettings, LiveOptions, capture, parse_source
from dcptool.protocol.dcp.server import producer as P
from tests.support.threaded_server import ThreadedServer
out, server, settings, opts = sys.argv[1], *(json.loads(a) for a in sys.argv[2:])
with ThreadedServer(P.server_from_options(**server)) as srv:
    lo = LiveOptions(source=parse_source(f"couchbase://{srv.host}:{srv.port}/default"), user=None,
                     name="ring-test", **opts)
    result = capture(lo, CaptureSettings(output=out, **settings))
print(json.dumps({"error": None if result.error is None else repr(result.error), "summary": result.summary()}))
"""


def dcp_capture(out, *, vbuckets: int = 4, items: int = 400, seed: int = 5, settings: dict | None = None,
                **opts) -> dict:
    """One capture of a seeded `serve dcp` producer into `out`, through the library in a
    process of its own (a capture tunes its process: no pandas, fewer gc passes); its
    summary, and `error` (repr, or None)."""
    server = {"vbuckets": vbuckets, "items": items, "seed": seed}
    res = subprocess.run([sys.executable, "-c", SCRIPT, str(out), json.dumps(server), json.dumps(settings or {}),
                          json.dumps(opts)], capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr
    got = json.loads(res.stdout.splitlines()[-1])
    return {"error": got["error"], **got["summary"]}


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
