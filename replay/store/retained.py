"""The retained-state record of a capture ring (`capture --retain-*`, CAPTURE_FORMAT.md
"Retention ring"): what the segments a ring deleted held, written (fsync + rename) before
each deletion, so that verify, replay and `capture --resume` know the head that was
retained away even after a crash. One record per directory and shard:
`dcptool-retained.json`, `dcptool-retained-shard-K-of-N.json`.

The record holds, per capture id, the last segment number deleted; per DCP vbucket the
resume state after the deleted segments (its `last_seqno`: the changes up to it were
dropped, the first seqno still held is the first one above it); per Synapse stream and
instance the last committed token of the deleted segments."""

from __future__ import annotations

import dataclasses
import json
import os

from dcptool.protocol.errors import DcptoolError
from dcptool.replay.store.files import fsync_path

RECORD_PREFIX = "dcptool-retained"
RECORD_SUFFIX = ".json"
RECORD_FORMAT = 1


class RetainedError(DcptoolError):
    """A retained-state record that cannot be read or written."""


def record_name(shard: str | None) -> str:
    """`dcptool-retained.json`, or `dcptool-retained-shard-K-of-N.json` for shard "K/N"."""
    if not shard:
        return RECORD_PREFIX + RECORD_SUFFIX
    k, n = shard.split("/")
    return f"{RECORD_PREFIX}-shard-{int(k)}-of-{int(n)}{RECORD_SUFFIX}"


def is_record_name(name: str) -> bool:
    return name.startswith(RECORD_PREFIX) and name.endswith(RECORD_SUFFIX)


def empty(protocol: str, source: str, shard: str | None) -> dict:
    return {"format": RECORD_FORMAT, "protocol": protocol, "source": source, "shard": shard,
            "segments_dropped": 0, "rows_dropped": 0, "bytes_dropped": 0, "captures": {},
            "vbuckets": {}, "streams": []}


def load(path: str) -> dict | None:
    """The record at `path`; None when there is none."""
    try:
        with open(path, "rb") as f:
            rec = json.loads(f.read())
    except FileNotFoundError:
        return None
    except (OSError, ValueError) as exc:
        raise RetainedError(f"{path}: unreadable retained-state record: {exc}") from None
    if not isinstance(rec, dict) or rec.get("format") != RECORD_FORMAT:
        raise RetainedError(f"{path}: not a retained-state record of format {RECORD_FORMAT}")
    return rec


def load_all(directory: str) -> list[dict]:
    """Every record in `directory` (one per shard), in name order."""
    try:
        names = sorted(os.listdir(directory))
    except OSError:
        return []
    out = []
    for name in names:
        if is_record_name(name):
            rec = load(os.path.join(directory, name))
            if rec is not None:
                out.append(rec)
    return out


def save(path: str, record: dict) -> None:
    """Write the record crash-safely: a temporary file, fsync'ed, renamed over the old one,
    and the directory fsync'ed, before the caller deletes anything."""
    tmp = path + ".tmp"
    data = json.dumps(record, sort_keys=True, separators=(",", ":")).encode()
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        os.write(fd, data)
        os.fsync(fd)
    finally:
        os.close(fd)
    os.replace(tmp, path)
    fsync_path(os.path.dirname(path) or ".")   # strict: a record not durable stops the delete


def dropped_through(records: list[dict]) -> dict[str, int]:
    """capture id -> the last segment number the rings deleted."""
    out: dict[str, int] = {}
    for rec in records:
        for cid, seg in (rec.get("captures") or {}).items():
            out[cid] = max(out.get(cid, -1), int(seg))
    return out


# ---------------------------------------------------------------- DCP resume state as JSON

def vb_to_json(s) -> dict:
    """A replay/store/resume.VbResume as JSON."""
    d = {f.name: getattr(s, f.name) for f in dataclasses.fields(s) if f.name != "streams"}
    d["streams"] = {str(sid): vb_to_json(x) for sid, x in s.streams.items()}
    return d


def vb_from_json(d: dict):
    from dcptool.replay.store.resume import VbResume
    d = dict(d)
    streams = {int(sid): vb_from_json(x) for sid, x in (d.pop("streams", None) or {}).items()}
    d["failover_log"] = [(int(u), int(s)) for u, s in d.get("failover_log") or ()]
    if d.get("pending_snapshot") is not None:
        d["pending_snapshot"] = tuple(d["pending_snapshot"])
    known = {f.name for f in dataclasses.fields(VbResume)}
    return VbResume(**{k: v for k, v in d.items() if k in known}, streams=streams)


def vb_states(record: dict | None) -> dict:
    """vbucket -> VbResume after the segments the record's ring deleted."""
    if not record:
        return {}
    return {int(vb): vb_from_json(d) for vb, d in (record.get("vbuckets") or {}).items()}


def stream_tokens(record: dict | None) -> dict[tuple[str, str], int]:
    """(stream, instance) -> the last committed token of the segments the ring deleted."""
    if not record:
        return {}
    return {(e["stream"], e["instance"]): int(e["token"]) for e in record.get("streams") or ()}


def describe(records: list[dict]) -> str | None:
    """One line on what the rings of a directory dropped (None: nothing)."""
    segs = sum(int(r.get("segments_dropped") or 0) for r in records)
    if not segs:
        return None
    rows = sum(int(r.get("rows_dropped") or 0) for r in records)
    vbs = sum(len(r.get("vbuckets") or {}) for r in records)
    streams = sum(len(r.get("streams") or ()) for r in records)
    what = f"{vbs} vbucket(s)" if vbs else f"{streams} stream(s)"
    return (f"a retention ring dropped the oldest {segs} segment(s) ({rows:,} rows; {what} lost their "
            f"older changes): the results are those of the retained window")


def records_near(paths) -> list[dict]:
    """The records of the directories given and of the directories of the files given."""
    dirs: list[str] = []
    for p in paths:
        d = p if os.path.isdir(p) else os.path.dirname(os.path.abspath(p))
        real = os.path.realpath(d)
        if real not in dirs:
            dirs.append(real)
    return [rec for d in dirs for rec in load_all(d)]


def note(paths) -> str | None:
    """What `replay` of `paths` says when a ring deleted the oldest segments (None: none did)."""
    text = describe(records_near(paths))
    return None if text is None else f'{text} (REPLAY.md "Retention ring")'
