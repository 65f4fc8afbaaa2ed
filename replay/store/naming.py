"""Names of capture files: `{protocol}-{run start}-{capture_id[:8]}-{segment:06d}.parquet`,
its in-progress twin `.arrows`, the temporary `.parquet.tmp`, and a merged segment of
`dcptool compact`, `...-{first:06d}-{last:06d}.parquet` (CAPTURE_FORMAT.md "Files"); the
names of the key-value metadata every file carries and the format versions (schema.py
re-exports them: here they need no pyarrow)."""

from __future__ import annotations

import datetime as _dt
import re

IN_PROGRESS_SUFFIX = ".arrows"
DAMAGED_SUFFIX = ".damaged"     # appended to the `.arrows` name of a file kept aside
# metadata of a merged segment: the last segment number it covers (dcptool.segment: the first)
META_SEGMENT_LAST = "dcptool.segment_last"
TMP_SUFFIX = ".tmp"

FORMAT_VERSION = "2"
# versions readers accept; a version 1 file has no `node` column (it reads as null)
READABLE_VERSIONS = ("1", "2")
PROTOCOLS = ("dcp", "synapse")

# key-value metadata keys on every file
META_FORMAT = "dcptool.format"
META_PROTOCOL = "dcptool.protocol"
META_CAPTURE_ID = "dcptool.capture_id"
META_SEGMENT = "dcptool.segment"
META_STARTED_AT = "dcptool.started_at"
META_VERSION = "dcptool.version"
META_SOURCE = "dcptool.source"
META_OPTIONS = "dcptool.options"
# the source's identity where the source gave one (CAPTURE_FORMAT.md "One source per
# directory"): `bucket-uuid:<uuid>` (DCP), `server-name:<name>` (Synapse); older files lack it
META_SOURCE_ID = "dcptool.source_id"
META_KEYS = (META_FORMAT, META_PROTOCOL, META_CAPTURE_ID, META_SEGMENT, META_STARTED_AT,
             META_VERSION, META_SOURCE, META_OPTIONS)


def tool_version() -> str:
    from dcptool import __version__
    return __version__


def utcnow() -> _dt.datetime:
    return _dt.datetime.now(_dt.timezone.utc)


def segment_name(protocol: str, started: _dt.datetime, capture_id: str, segment: int) -> str:
    """`{protocol}-{started %Y%m%dT%H%M%S.%fZ}-{capture_id[:8]}-{segment:06d}.parquet`."""
    stamp = started.astimezone(_dt.timezone.utc).strftime("%Y%m%dT%H%M%S.%fZ")
    return f"{protocol}-{stamp}-{capture_id.replace('-', '')[:8]}-{segment:06d}.parquet"


def in_progress_path(parquet_path: str) -> str:
    """The in-progress (`.arrows`) name of a segment's final `.parquet` name."""
    base = parquet_path[:-len(".parquet")] if parquet_path.endswith(".parquet") else parquet_path
    return base + IN_PROGRESS_SUFFIX


def final_path(arrows_path: str) -> str:
    """The final `.parquet` name of an in-progress `.arrows` segment."""
    base = arrows_path[:-len(IN_PROGRESS_SUFFIX)] if arrows_path.endswith(IN_PROGRESS_SUFFIX) \
        else arrows_path
    return base + ".parquet"


def merged_name(protocol: str, started: _dt.datetime, capture_id: str, first: int, last: int) -> str:
    """The name of the segment that merges segments `first`..`last`: `...-{first:06d}-{last:06d}.parquet`."""
    return segment_name(protocol, started, capture_id, first)[:-len(".parquet")] + f"-{last:06d}.parquet"


# a segment's file name as the writer or compaction makes it (readers accept up to 8 hex
# digits of the id); group 4 is the (first) segment number, group 5 the suffix
SEGMENT_NAME_RE = re.compile(r"^(dcp|synapse)-(\d{8}T\d{6}\.\d{6}Z)-([0-9a-fA-F]{1,8})-(\d{6})(?:-\d{6})?"
                             r"\.(parquet|arrows)$")
_LAST_RE = re.compile(r"-(\d{6})-(\d{6})\.parquet$")


def named_range(name: str) -> tuple[int, int] | None:
    """(first, last) segment numbers a segment's name covers; None for a name not made so."""
    m = SEGMENT_NAME_RE.match(name)
    if m is None:
        return None
    r = _LAST_RE.search(name)
    return (int(r.group(1)), int(r.group(2))) if r else (int(m.group(4)), int(m.group(4)))


def is_segment_name(name: str) -> bool:
    """True for a name made like a capture segment's (`.parquet` or in-progress `.arrows`)."""
    return SEGMENT_NAME_RE.match(name) is not None
