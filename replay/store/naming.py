"""Names of capture files: `{protocol}-{run start}-{capture_id[:8]}-{segment:06d}.parquet`,
its in-progress twin `.arrows` and the temporary `.parquet.tmp` (CAPTURE_FORMAT.md "Files")."""

from __future__ import annotations

import datetime as _dt
import re

IN_PROGRESS_SUFFIX = ".arrows"
TMP_SUFFIX = ".tmp"


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


# a segment's file name as the writer makes it (readers accept up to 8 hex digits of the id)
SEGMENT_NAME_RE = re.compile(r"^(dcp|synapse)-(\d{8}T\d{6}\.\d{6}Z)-([0-9a-fA-F]{1,8})-(\d{6})\.(parquet|arrows)$")


def is_segment_name(name: str) -> bool:
    """True for a name made like a capture segment's (`.parquet` or in-progress `.arrows`)."""
    return SEGMENT_NAME_RE.match(name) is not None
