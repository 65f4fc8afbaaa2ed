"""The findings of `dcptool verify`: every check id with its severity and meaning, the
Finding row, where a chunk of rows comes from, and the bounded collector (replay/check/verify.py
runs the pass; verify_dcp.py and verify_synapse.py report into it)."""

from __future__ import annotations

import dataclasses

from dcptool.protocol.errors import DcptoolError
from dcptool.replay.store.files import shown

SEVERITIES = ("error", "warn", "info")
FINDING_COLUMNS = ["check", "severity", "message", "file", "segment", "capture_id", "frame_no",
                   "vbucket", "stream_id", "stream", "instance", "seqno", "token"]
# the order findings are printed in: damage first, then the other file checks, then rows
DAMAGE, FILES, ROWS = 0, 1, 2
DAMAGE_CHECKS = ("file.unreadable", "file.damaged", "file.unsupported_format")

# every check verify can report: id -> (severity, what it means); CLI.md lists them
CHECKS: dict[str, tuple[str, str]] = {
    "file.unreadable": ("error", "a file that is not a readable capture file (nothing of it verified)"),
    "file.damaged": ("error", "a part of a segment that cannot be read (the rest is verified)"),
    "file.unsupported_format": ("error", "a segment of a newer capture format than this dcptool reads (not read)"),
    "file.mixed_sources": ("error", "captures of different sources in one directory"),
    "file.torn_tail": ("info", "the last batch of an in-progress segment cut short by a crash or a full disk (the end of the log, not damage)"),
    "file.in_progress": ("warn", "an unfinished `.arrows` segment (verified as far as it is whole)"),
    "file.leftover": ("warn", "an `.arrows` or `.parquet.tmp` next to the finished segment it was turned into"),
    "file.duplicate_segment": ("error", "two files hold the same segment of a capture"),
    "file.name_mismatch": ("error", "file name and dcptool.* metadata disagree (protocol, capture id, segment, start)"),
    "file.metadata_mismatch": ("error", "segments of one capture disagree on protocol or started_at"),
    "file.capture_id_mismatch": ("error", "capture_id column differs from the file's dcptool.capture_id"),
    "file.segment_missing": ("error", "a segment number missing from a capture's chain 0..n"),
    "file.frames_missing": ("error", "frame_no skips a range: rows dropped"),
    "file.retained_away": ("info", "the oldest segments a retention ring deleted (`capture --retain-*`), as its record says"),
    "dcp.shard_missing": ("error", "the `capture --shard` processes present do not cover the bucket: vbuckets named"),
    "dcp.shards_mixed": ("error", "shards of different counts (K/N with different N) in one directory"),
    "file.frame_order": ("error", "frame_no does not increase"),
    "dcp.decode_error": ("warn", "a frame that did not decode (kept in raw)"),
    "dcp.raw_missing": ("warn", "no `raw` column (the recorded frames): `serve dcp --from` cannot play it back"),
    "dcp.raw_short": ("error", "a frame whose raw bytes are shorter than a header or than the length its header says"),
    "dcp.seqno_not_increasing": ("error", "a seqno not above the previous one of its vbucket/stream"),
    "dcp.item_outside_snapshot": ("error", "an item outside its snapshot marker's [snap_start, snap_end], or before any marker"),
    "dcp.marker_bad_range": ("error", "a snapshot marker with snap_start above snap_end"),
    "dcp.marker_overlap": ("error", "a snapshot marker that overlaps or goes back behind the previous one"),
    "dcp.snapshot_incomplete": ("warn", "a snapshot closed by the next marker before its snap_end arrived"),
    "dcp.frame_without_stream": ("error", "an item, marker or stream end for a stream not open on that connection"),
    "dcp.resume_gap": ("error", "a stream request starting above the last seqno received: seqnos never received"),
    "dcp.resume_rewind": ("warn", "a stream request starting below the last seqno received: seqnos come twice"),
    "dcp.resume_bad_snapshot": ("error", "a stream request whose start is outside its snapshot range"),
    "dcp.unknown_vbucket_uuid": ("warn", "a stream request with a vbucket uuid not in the failover log received"),
    "dcp.forged_rollback": ("error", "a ROLLBACK to a seqno the failover log and the request do not allow"),
    "dcp.stream_end_unknown_reason": ("error", "a stream end with a reason that is not a known one"),
    "dcp.oso_not_closed": ("error", "an OSO snapshot start without its end"),
    "synapse.decode_error": ("warn", "a line that did not decode (kept in raw)"),
    "synapse.token_out_of_order": ("error", "an RDATA token lower than the committed one"),
    "synapse.position_gap": ("error", "a POSITION whose prev token is above the committed one: rows never seen"),
    "synapse.position_backwards": ("error", "a POSITION whose new token is below its prev token"),
    "synapse.batch_dropped": ("warn", "`batch` rows left without their token by a reconnect"),
}


class VerifyError(DcptoolError):
    """Inputs that cannot be verified at all (no such path, no capture file)."""


class MixedProtocols(VerifyError):
    """DCP and Synapse captures given together (a usage error)."""


@dataclasses.dataclass(frozen=True, slots=True)
class Finding:
    check: str
    message: str
    file: str | None = None
    segment: int | None = None
    capture_id: str | None = None
    frame_no: int | None = None
    vbucket: int | None = None
    stream_id: int | None = None
    stream: str | None = None
    instance: str | None = None
    seqno: int | None = None
    token: int | None = None

    @property
    def severity(self) -> str:
        return CHECKS[self.check][0]

    def to_row(self) -> dict:
        row = {k: getattr(self, k) for k in FINDING_COLUMNS if k != "severity"}
        row["severity"] = self.severity
        for k in ("file", "message"):       # a path that is not UTF-8 prints as \xff escapes
            if row[k] is not None:
                row[k] = shown(row[k])
        return {k: row[k] for k in FINDING_COLUMNS}


@dataclasses.dataclass(frozen=True, slots=True)
class Where:
    """The segment a chunk of rows comes from, for the findings about them."""
    file: str
    segment: int
    capture_id: str
    rank: int           # the capture's position in replay order


class Findings:
    """Findings as they are found, up to `limit` kept per check (all are counted)."""

    def __init__(self, limit: int = 1000):
        self.limit = limit
        self.counts: dict[str, int] = {}
        self._kept: list[tuple[tuple, int, Finding]] = []

    def add(self, finding: Finding, order: tuple = (), priority: int | None = None) -> None:
        n = self.counts.get(finding.check, 0)
        self.counts[finding.check] = n + 1
        if n >= self.limit:
            return
        if priority is None:
            priority = DAMAGE if finding.check in DAMAGE_CHECKS else (
                FILES if finding.check.startswith("file.") else ROWS)
        self._kept.append(((priority, *order), len(self._kept), finding))

    def at(self, where: Where | None, check: str, message: str, frame_no: int | None = None,
           **loc) -> None:
        """A finding about a row (or file) of `where`, ordered by its place in the replay."""
        if where is None:
            self.add(Finding(check, message, frame_no=frame_no, **loc), (1 << 62, frame_no or 0))
            return
        self.add(Finding(check, message, file=where.file, segment=where.segment,
                         capture_id=where.capture_id, frame_no=frame_no, **loc),
                 (where.rank, -1 if frame_no is None else frame_no))

    @property
    def total(self) -> int:
        return sum(self.counts.values())

    def ordered(self) -> list[Finding]:
        return [f for _, _, f in sorted(self._kept, key=lambda x: (x[0], x[1]))]


@dataclasses.dataclass
class Report:
    protocol: str | None
    findings: list[Finding]
    counts: dict[str, int]
    files: int = 0
    unreadable_files: int = 0
    captures: int = 0
    rows: int = 0
    seconds: float = 0.0

    @property
    def readable(self) -> bool:
        """False when nothing at all could be read."""
        return self.files > self.unreadable_files

    def summary(self) -> dict:
        by_sev = {s: 0 for s in SEVERITIES}
        for check, n in self.counts.items():
            by_sev[CHECKS[check][0]] += n
        return {"protocol": self.protocol, "files": self.files,
                "unreadable_files": self.unreadable_files, "captures": self.captures,
                "rows": self.rows, "seconds": round(self.seconds, 3),
                "findings": sum(self.counts.values()), "by_severity": by_sev,
                "by_check": dict(sorted(self.counts.items())),
                "shown": len(self.findings)}
