"""The retention ring of a long-running capture (`capture --retain-segments N`,
`--retain-size SIZE`, `--retain-age DURATION`): the oldest finished segments of the
directory (of this capture's shard) are deleted once there are more than N of them, once
together they hold more than SIZE bytes, or once one was finished longer than DURATION ago.

Only finished, durable segments are candidates: a `.parquet` whose in-progress `.arrows`
twin is gone (the writer removes it after the rename and the directory fsync), never the
segment being written. Before a segment is deleted, what it held is folded into the
directory's retained-state record (replay/store/retained.py: the resume state per
vbucket or stream after it), written with fsync and rename, so a crash at any point
leaves a record that covers at least what is missing. The ring runs on its own thread,
every `interval` seconds, and once more when the capture closes."""

from __future__ import annotations

import dataclasses
import json
import os
import threading
import time

import pyarrow.parquet as pq

from dcptool.replay.store import retained
from dcptool.replay.store.compact import compact
from dcptool.replay.store.files import arrow_source, fsync_path
from dcptool.replay.store.naming import IN_PROGRESS_SUFFIX, SEGMENT_NAME_RE, named_range
from dcptool.replay.store.reader import describe
from dcptool.replay.store.resume import (
    dcp_resume_state,
    same_origin,
    synapse_resume_state,
)


@dataclasses.dataclass(frozen=True)
class Retention:
    segments: int | None = None     # keep at most this many finished segments
    size: int | None = None         # ... holding at most this many bytes together
    age: float | None = None        # ... each finished at most this many seconds ago

    def __bool__(self) -> bool:
        return any(x is not None for x in (self.segments, self.size, self.age))


@dataclasses.dataclass
class Segment:
    path: str
    size: int
    finished: float     # mtime: when the writer renamed it into place
    durable: bool = True   # False: its `.arrows` twin is still there (not yet durable, or a crash's leftover)


class Ring:
    """The ring of one capture: `apply()` deletes what the retention asks (returns the paths
    deleted); `start()` / `stop()` run it on a thread. `clock()` is the wall clock (tests
    pass their own)."""

    def __init__(self, directory: str, protocol: str, source: str, retention: Retention, *,
                 shard: str | None = None, clock=time.time, interval: float = 1.0, source_id: str | None = ""):
        self.directory = os.fspath(directory)
        self.protocol, self.source, self.shard = protocol, source, shard
        self.retention = retention
        self.clock = clock
        self.interval = interval
        self.record_path = os.path.join(self.directory, retained.record_name(shard))
        self.deleted: list[str] = []
        self.error: BaseException | None = None
        self._mine: dict[str, bool] = {}     # path -> of this source and shard (its metadata says)
        # the source's identity (dcptool.source_id, "" when it gives none); a capture's ring
        # starts with None, deleting nothing until its connection is set up (identify)
        self.source_id = source_id
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()

    # -- which segments
    def finished(self) -> list[Segment]:
        """This source's and shard's finished segments, oldest first."""
        try:
            names = sorted(os.listdir(self.directory))
        except OSError:
            return []
        present = set(names)
        merged = _merged_ranges(names)
        out = []
        for name in names:
            m = SEGMENT_NAME_RE.match(name)
            if m is None or m.group(1) != self.protocol or m.group(5) != "parquet" or _covered(name, merged):
                continue      # a part a merged segment covers (a compaction's crash left it) is not one
            path = os.path.join(self.directory, name)
            if not self._is_mine(path):
                continue
            try:
                st = os.stat(path)
            except OSError:
                continue
            # renamed, but not yet durable (the directory fsync comes first), or what a crash
            # left before `--resume` finished it: neither it nor anything after it goes
            durable = name[:-len(".parquet")] + IN_PROGRESS_SUFFIX not in present
            out.append(Segment(path, st.st_size, st.st_mtime, durable))
        return out

    def _is_mine(self, path: str) -> bool:
        """A segment of this source (`--force-new` may have put another's next to it, of another
        identity on the same host too) and shard."""
        if path not in self._mine:
            source, shard, source_id = origin_of_file(path)
            self._mine[path] = source is not None and shard == self.shard and \
                same_origin(source, source_id or "", self.source, self.source_id or "")
        return self._mine[path]

    def identify(self, source_id: str) -> None:
        """The capture's source identity is known (its connection is set up): the ring runs."""
        with self._lock:
            self.source_id = source_id
            self._mine.clear()

    def plan(self, segs: list[Segment]) -> list[Segment]:
        """The oldest segments to delete so that what is left fits the retention."""
        r, now = self.retention, self.clock()
        total = sum(s.size for s in segs)
        drop = []
        for i, s in enumerate(segs):
            left = len(segs) - i
            if not s.durable:
                break
            if (r.segments is not None and left > r.segments) or (r.size is not None and total > r.size) \
                    or (r.age is not None and now - s.finished > r.age):
                drop.append(s)
                total -= s.size
            else:
                break
        return drop

    # -- deleting
    def apply(self) -> list[str]:
        with self._lock:
            done: list[str] = []
            if self.source_id is None:     # whose segments are whose is not known yet
                return done
            for seg in self.plan(self.finished()):
                self._drop(seg)
                done.append(seg.path)
            self.deleted.extend(done)
            return done

    def _drop(self, seg: Segment) -> None:
        f = describe(seg.path)
        rec = retained.load(self.record_path) or retained.empty(self.protocol, self.source, self.shard)
        rows = fold(rec, f)
        rec["segments_dropped"] += 1
        rec["rows_dropped"] += rows
        rec["bytes_dropped"] += seg.size
        caps = rec["captures"]
        caps[f.capture_id] = max(int(caps.get(f.capture_id, -1)), f.last_segment)   # merged: all it covers
        retained.save(self.record_path, rec)        # durable before anything is deleted
        for part in _covered_by(seg.path):          # a compaction's leftovers first: hidden while it is there
            try:
                os.unlink(part)
            except FileNotFoundError:
                pass
        os.unlink(seg.path)
        fsync_path(self.directory)
        self._mine.pop(seg.path, None)

    # -- the thread
    def start(self) -> "Ring":
        self._thread = threading.Thread(target=self._run, name="dcptool-ring", daemon=True)
        self._thread.start()
        return self

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            try:
                self.apply()
            except Exception as exc:  # noqa: BLE001 - said at the end; nothing is lost by not deleting
                self.error = exc
                return

    def stop(self) -> None:
        """Stop the thread and apply the ring once more (the segments the close finished)."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        if self.error is None:
            try:
                self.apply()
            except Exception as exc:  # noqa: BLE001 - reported by the caller
                self.error = exc


def _merged_ranges(names: list[str]) -> dict[str, list[tuple[int, int]]]:
    """capture name prefix -> the (first, last) ranges of its merged segments (compaction)."""
    out: dict[str, list[tuple[int, int]]] = {}
    for name in names:
        m, r = SEGMENT_NAME_RE.match(name), named_range(name)
        if m is not None and r is not None and r[0] != r[1] and m.group(5) == "parquet":
            out.setdefault(f"{m.group(1)}-{m.group(2)}-{m.group(3)}", []).append(r)
    return out


def _covered(name: str, merged: dict[str, list[tuple[int, int]]]) -> bool:
    m, r = SEGMENT_NAME_RE.match(name), named_range(name)
    ranges = merged.get(f"{m.group(1)}-{m.group(2)}-{m.group(3)}", ()) if m else ()
    return r is not None and any(a <= r[0] and r[1] <= b and (a, b) != r for a, b in ranges)


def _covered_by(path: str) -> list[str]:
    """The parts a merged segment covers still in its directory (a compaction's crash left them)."""
    directory, name = os.path.split(path)
    r = named_range(name)
    if r is None or r[0] == r[1]:
        return []
    try:
        names = sorted(os.listdir(directory))
    except OSError:
        return []
    ranges = {k: [x for x in v if x == r] for k, v in _merged_ranges([name]).items()}
    return [os.path.join(directory, n) for n in names if n != name and n.endswith(".parquet")
            and _covered(n, ranges)]


def fold(rec: dict, f) -> int:
    """Fold the state of segment `f` (a reader.CaptureFile) into the record; its row count."""
    rows = pq.ParquetFile(arrow_source(f.path)).metadata.num_rows
    if f.protocol == "dcp":
        state = dcp_resume_state([f], initial=retained.vb_states(rec))
        rec["vbuckets"] = {str(vb): retained.vb_to_json(s) for vb, s in sorted(state.items())}
    else:
        tokens = {**retained.stream_tokens(rec), **synapse_resume_state([f])}
        rec["streams"] = [{"stream": s, "instance": i, "token": t} for (s, i), t in sorted(
            tokens.items(), key=lambda kv: (kv[0][0], kv[0][1] or ""))]
    return rows


def origin_of_file(path: str) -> tuple[str | None, str | None, str | None]:
    """The source, the `shard` (None: not sharded) and the source's identity a segment's
    metadata names; (None, None, None) for a file that cannot be read (no segment of ours)."""
    try:
        meta = describe(path).metadata
        opts = json.loads(meta.get("dcptool.options") or "{}")
    except Exception:  # noqa: BLE001 - whatever it is, the ring leaves it alone
        return None, None, None
    return (meta.get("dcptool.source"), opts.get("shard") if isinstance(opts, dict) else None,
            meta.get("dcptool.source_id"))


def start_ring(directory: str, protocol: str, source: str, retention: Retention | None,
               shard: str | None = None) -> Ring | None:
    """The running ring of a capture, or None without retention options."""
    if not retention:
        return None
    return Ring(directory, protocol, source, retention, shard=shard, source_id=None).start()


def retention(settings) -> Retention:
    """The retention of CaptureSettings (capture/options.py)."""
    return Retention(segments=settings.retain_segments, size=settings.retain_size, age=settings.retain_age)


def stop_ring(ring: Ring | None, files: list, note) -> list:
    """Stop a capture's ring (None: none); the finished segments of the run still on disk.
    A ring that failed only kept segments: `note` says so."""
    if ring is None:
        return files
    ring.stop()
    if ring.error is not None:
        text = str(ring.error).replace("[", "(").replace("]", ")")
        note(f"dcptool: warning: the retention ring stopped deleting segments: {text}")
    gone = set(ring.deleted)
    return [f for f in files if f.get("path") not in gone]


# `capture` merges the small finished segments of its source and shard at its end (and so, in
# a `--resume` run, those an earlier run left) once a run of at least this many is there: a
# short --rotate-interval or a quiet source leaves many small files, each costing every reader
COMPACT_MIN_PARTS = 64


def compact_finished(directory: str, source: str, shard: str | None, files: list, note,
                     source_id: str | None = None) -> list:
    """Compact the small finished segments of this source and shard in `directory` (after the
    ring stopped: nothing else deletes them now); `files` (the run's finished segments, dicts
    with "path") with merged ones in place of their parts. A failure keeps every part (the
    merged file is written aside and renamed first): `note` says so, the capture stands."""

    def mine(f) -> bool:
        try:
            opts = json.loads(f.metadata.get("dcptool.options") or "{}")
        except ValueError:
            return False
        return same_origin(f.metadata.get("dcptool.source") or "", f.metadata.get("dcptool.source_id") or "",
                           source, source_id or "") and (opts.get("shard") if isinstance(opts, dict) else None) == shard

    if not os.path.isdir(directory):
        return files
    try:
        done = compact(directory, select=mine, min_parts=COMPACT_MIN_PARTS, check_busy=False)
    except Exception as exc:  # noqa: BLE001 - the parts are all there; said, not fatal
        text = str(exc).replace("[", "(").replace("]", ")").splitlines()[0] if str(exc) else type(exc).__name__
        note(f"dcptool: warning: compaction of small segments stopped (every segment kept): {text}")
        return files
    if not done.merged and not done.parts_removed:
        return files
    gone = {p for m in done.merged for p in m["part_paths"]}
    kept = [f for f in files if f.get("path") not in gone and os.path.exists(f.get("path", ""))]
    ours = {f.get("path") for f in files}
    return kept + [{"path": m["path"], "rows": m["rows"], "bytes": m["bytes"]} for m in done.merged
                   if ours & set(m["part_paths"])]
