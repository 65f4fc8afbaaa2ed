"""The documents a restore writes: each key's last change in the captures (as of a point in
time), chosen by the in-process replay engine's `documents` plan (replay/rules/plans.py, run
by DuckDB over the capture: replay/local/duck.py), with the value, datatype and xattrs cut
from the recorded frame of that change by the wire codec. A commit's value is its prepare's.
Snappy is undone here; the XATTR bit and its section are kept as stored."""

from __future__ import annotations

import contextlib
import dataclasses
import fnmatch
import re
from typing import Any, Callable, Iterator

from dcptool.protocol.dcp.client.kv_writer import Doc
from dcptool.protocol.dcp.wire import snappy
from dcptool.protocol.dcp.wire.constants import DEFAULT_MAX_BODY, DatatypeBit, Opcode
from dcptool.protocol.errors import DcptoolError
from dcptool.replay.local import duck
from dcptool.replay.rules import plans

BATCH_ROWS = 4096
_SNAPPY, _XATTR = int(DatatypeBit.SNAPPY), int(DatatypeBit.XATTR)
_CHANGE_OPS = frozenset({Opcode.DCP_MUTATION, Opcode.DCP_DELETION, Opcode.DCP_EXPIRATION, Opcode.DCP_PREPARE})
_FLEX_MAGICS = frozenset({0x08, 0x18})


class BadFrame(DcptoolError):
    """A recorded frame of a document that does not give its value."""


@dataclasses.dataclass(frozen=True, slots=True)
class Captured:
    """A document to restore and where the capture saw it."""
    doc: Doc
    vbucket: int


def key_matcher(pattern: str | None) -> Callable[[str], bool] | None:
    """`--keys`: a glob (fnmatch), or a regular expression written /LIKE THIS/; None: all."""
    if not pattern:
        return None
    if len(pattern) >= 2 and pattern.startswith("/") and pattern.endswith("/"):
        rx = re.compile(pattern[1:-1])
        return lambda key: rx.search(key) is not None
    return lambda key: fnmatch.fnmatchcase(key, pattern)


def _sql(frames: duck.DuckFrames, files: list[Any]) -> str:
    # the values are cut from `raw` below as stored (Snappy and xattrs kept): no body columns
    docs = plans.table_sql(duck.D, "documents", frames.source, plans.PlanFacts.of(files, None), bodies=False)
    prepare = ("(SELECT max_by(p.raw, p._seq) FROM vb_frames p WHERE p.op = 'prepare' AND p.vbucket = d.vbucket "
               "AND p.key = d.key AND p.collection_id IS NOT DISTINCT FROM d.collection_id AND p._seq < f._seq)")
    return ("SELECT d.vbucket, d.collection_id, d.key, d.rev_seqno, d.cas, d.state, d.item_flags, d.expiration, "
            f"f.raw, CASE WHEN f.op = 'commit' THEN {prepare} END AS p_raw "
            f"FROM ({docs}) d JOIN frames f ON f.frame_no = d.frame_no "
            "AND (d.capture_id IS NULL OR f.capture_id = d.capture_id) AND f.direction = 'in'")


def value_of(raw: bytes) -> tuple[bytes, int]:
    """(value as stored, datatype without the Snappy bit) of a recorded change frame: only
    its header is read (the replay chose the frame, its fields are in the row; the capture
    checked its framing when it recorded it)."""
    if len(raw) < 24 or raw[1] not in _CHANGE_OPS:
        raise BadFrame(f"a recorded change is no document change ({len(raw)} bytes)")
    flex = raw[0] in _FLEX_MAGICS
    fe, kl = (raw[2], raw[3]) if flex else (0, (raw[2] << 8) | raw[3])
    start = 24 + fe + raw[4] + kl
    if start > len(raw):
        raise BadFrame("a recorded change is shorter than its header says")
    value, dt = raw[start:], raw[5]
    if dt & _SNAPPY:
        try:
            value = snappy.decompress(value, DEFAULT_MAX_BODY)
        except ValueError as exc:
            raise BadFrame(f"a recorded value does not decompress: {exc}") from None
        dt &= ~_SNAPPY
    return value, dt


class CaptureDocuments:
    """The captures in DuckDB once (replay/local/duck.py), for the two questions a restore
    asks: which collections, then which documents. `close()` ends it."""

    def __init__(self, files: list[Any], as_of: Any = None, memory: int | None = None):
        self.files = files
        self.frames = duck.DuckFrames(files, as_of, memory)

    def collection_ids(self) -> set[int]:
        """The collections the captured changes are in (a scan of one column, no plan)."""
        rows = self.frames.con.sql(
            f"SELECT DISTINCT coalesce(collection_id, 0) FROM {self.frames.source} "
            "WHERE op IN ('mutation', 'deletion', 'expiration', 'prepare', 'commit')").fetchall()
        return {int(r[0]) for r in rows}

    def select(self, keys: str | None = None) -> Iterator[Captured]:
        """Each document's last change (as of `as_of`), in no particular order (a restore's
        writes commute: each key is written once), filtered by `keys` (key_matcher)."""
        for batch in self.batches(keys):
            yield from batch

    def batches(self, keys: str | None = None) -> Iterator[list[Captured]]:
        """select() a batch at a time (BATCH_ROWS rows of the plan): what a caller runs in a
        worker thread, DuckDB's work off its event loop."""
        match = key_matcher(keys)
        rel = self.frames.con.sql(_sql(self.frames, self.files))
        reader = getattr(rel, "to_arrow_reader", None) or rel.fetch_record_batch
        for batch in reader(BATCH_ROWS):
            yield list(_docs(batch, match))

    def close(self) -> None:
        """Ends a query still running in another thread (a stopped restore), then DuckDB."""
        with contextlib.suppress(Exception):
            self.frames.con.interrupt()
        self.frames.close()


def select(files: list[Any], as_of: Any = None, keys: str | None = None,
           memory: int | None = None) -> Iterator[Captured]:
    """CaptureDocuments(files, as_of).select(keys), closed at the end."""
    docs = CaptureDocuments(files, as_of, memory)
    try:
        yield from docs.select(keys)
    finally:
        docs.close()


def _docs(batch: Any, match: Callable[[str], bool] | None) -> Iterator[Captured]:
    """The documents of one record batch of the plan, column by column."""
    cols = {name: batch.column(name).to_pylist() for name in batch.schema.names}
    for i, key in enumerate(cols["key"]):
        if match is not None and not match(key.decode("utf-8", "replace")):
            continue
        state = cols["state"][i]
        value, dt = value_of(cols["p_raw"][i] or cols["raw"][i])
        deleted = state != "live"
        if deleted and not dt & _XATTR:
            value, dt = b"", 0
        doc = Doc(key=key, collection_id=cols["collection_id"][i] or 0, rev_seqno=cols["rev_seqno"][i] or 0,
                  cas=cols["cas"][i] or 0, flags=cols["item_flags"][i] or 0,
                  expiry=0 if deleted else (cols["expiration"][i] or 0), datatype=dt, deleted=deleted, value=value,
                  expired=state == "expired")
        yield Captured(doc, cols["vbucket"][i])
