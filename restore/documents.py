"""The documents a restore writes: each key's last change in the captures (as of a point in
time), chosen by the in-process replay engine's `documents` plan (replay/rules/plans.py, run
by DuckDB over the capture: replay/local/duck.py), with its value cut by DuckDB from the
recorded frame the plan names (`_bseq`: a commit's value is its prepare's) as the bodies of
replay's `documents` are: the frame's last `value_len` bytes. The rows come as Arrow record
batches and are made documents a slice at a time (docs_of), column by column; Snappy is
undone there, the XATTR bit and its section are kept as stored."""

from __future__ import annotations

import contextlib
import dataclasses
import fnmatch
import itertools
import re
from typing import Any, Callable, Iterator

from dcptool.protocol.dcp.client.kv_writer import DOC_FIELDS, Doc
from dcptool.protocol.dcp.wire import snappy
from dcptool.protocol.dcp.wire.constants import DEFAULT_MAX_BODY, DatatypeBit
from dcptool.protocol.errors import DcptoolError
from dcptool.replay.local import duck
from dcptool.replay.rules import plans

SLICE_ROWS = 512         # rows of the plan read and made documents at a time (docs_of)
_TUPLE = tuple.__new__      # a Doc made of a row's values as they come (docs_of)
_SNAPPY, _XATTR = int(DatatypeBit.SNAPPY), int(DatatypeBit.XATTR)


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


def _sql(frames: duck.DuckFrames, files: list[Any], extra: tuple[str, ...] = ()) -> str:
    """The plan's documents with the value of each cut by DuckDB from the `raw` of the frame
    whose value it is (`_bseq`: a commit's prepare; its last `value_len` bytes, as stored:
    Snappy and the xattr section kept), as `projection` columns."""
    docs = plans.table_sql(duck.D, "documents", frames.source, plans.PlanFacts.of(files, None), bodies=False)
    return projection(f"SELECT *, {plans.value_as_sent(duck.D, '_raw', 'value_len')} AS value "
                      f"FROM ({plans.with_raw(docs, frames.source)}) d", extra)

def projection(rows: str, extra: tuple[str, ...] = ()) -> str:
    """Over `rows` (the plan's `documents` columns and `value`, the value as stored), a
    document's fields in Doc's order (then the `extra` columns of `rows`): a tombstone keeps
    only its xattrs (none: no value, datatype 0) and no expiry; an expiration's tombstone is
    `expired`. The datatype keeps the Snappy bit of a value still compressed (docs_of)."""
    dt = "coalesce(CAST(datatype AS INT), 0)"
    gone = "coalesce(state <> 'live', false)"
    bare = f"({gone} AND ({dt} & {_XATTR}) = 0)"
    fields = {"key": "key", "collection_id": "coalesce(collection_id, 0)", "rev_seqno": "coalesce(rev_seqno, 0)",
              "cas": "coalesce(cas, 0)", "flags": "coalesce(item_flags, 0)",
              "expiry": f"CASE WHEN {gone} THEN 0 ELSE coalesce(expiration, 0) END",
              "datatype": f"CASE WHEN {bare} THEN 0 ELSE {dt} END", "deleted": gone,
              "value": f"CASE WHEN {bare} THEN ''::BLOB ELSE value END", "expired": "coalesce(state = 'expired', false)"}
    return ("SELECT " + ", ".join([f"{fields[f]} AS {f}" for f in DOC_FIELDS] + list(extra)) + f" FROM ({rows}) _rows")


class CaptureDocuments:
    """The captures in DuckDB once (replay/local/duck.py), for the two questions a restore
    asks: which collections, then which documents. `close()` ends it."""

    def __init__(self, files: list[Any], as_of: Any = None, memory: int | None = None):
        self.files = files
        self.frames = duck.DuckFrames(files, as_of, memory, one_query=True)

    def collection_ids(self) -> set[int]:
        """The collections the captured changes are in (a scan of one column, no plan)."""
        rows = self.frames.con.sql(
            f"SELECT DISTINCT coalesce(collection_id, 0) FROM {self.frames.source} "
            "WHERE op IN ('mutation', 'deletion', 'expiration', 'prepare', 'commit')").fetchall()
        return {int(r[0]) for r in rows}

    def select(self, keys: str | None = None) -> Iterator[Captured]:
        """Each document's last change (as of `as_of`), in no particular order (a restore's
        writes commute: each key is written once), filtered by `keys` (key_matcher)."""
        match = key_matcher(keys)
        rows = self.frames.con.execute(_sql(self.frames, self.files, ("vbucket",)))
        while part := rows.fetchmany(SLICE_ROWS):
            for doc, row in zip(*_docs_and_rows([r[:-1] for r in part], match)):
                yield Captured(doc, part[row][-1])

    def rows(self) -> Rows:
        """The plan's rows (`_sql`), read as the caller asks (Rows)."""
        return Rows(self.frames.con.execute(_sql(self.frames, self.files)))

    def close(self) -> None:
        """Ends a query still running in another thread (a stopped restore), then DuckDB."""
        with contextlib.suppress(Exception):
            self.frames.con.interrupt()
        self.frames.close()


class Rows:
    """The plan's rows as DuckDB hands them over (tuples, no pyarrow): `first()` runs the plan
    to its first rows (its aggregate done: what a worker thread does), then `slices(match)`
    gives them SLICE_ROWS at a time as documents, each read where it is written (a short
    call on the event loop: no other thread holds the GIL for long)."""

    def __init__(self, cursor: Any):
        self.cursor = cursor
        self.head: list[tuple[Any, ...]] = []

    def first(self) -> "Rows":
        self.head = self.cursor.fetchmany(SLICE_ROWS)
        return self

    def slices(self, match: Callable[[str], bool] | None = None) -> Iterator[list[Doc]]:
        part, self.head = self.head, []
        while part:
            yield docs_of(part, match)
            part = self.cursor.fetchmany(SLICE_ROWS)


class Opening:
    """The captures opened in a worker thread (`run`) while the target is bootstrapped:
    DuckDB, the collections the changes are in, and the plan run to its first rows (its
    aggregate done, before the first write can be). `close()` ends it from the event loop
    whatever it has reached (a query running is interrupted)."""

    def __init__(self, files: list[Any], as_of: Any = None):
        self.files, self.as_of = files, as_of
        self.docs: CaptureDocuments | None = None
        self.closed = False

    def run(self) -> tuple[set[int], Rows]:
        """(the collection ids, the plan's rows); in a worker thread."""
        self.docs = CaptureDocuments(self.files, self.as_of)
        if self.closed:                 # closed while DuckDB opened: nobody will read it
            self.docs.close()
            raise BadFrame("the restore stopped")
        return self.docs.collection_ids(), self.docs.rows().first()

    def close(self) -> None:
        self.closed = True
        if self.docs is not None:
            self.docs.close()


def select(files: list[Any], as_of: Any = None, keys: str | None = None,
           memory: int | None = None) -> Iterator[Captured]:
    """CaptureDocuments(files, as_of).select(keys), closed at the end."""
    docs = CaptureDocuments(files, as_of, memory)
    try:
        yield from docs.select(keys)
    finally:
        docs.close()


def docs_of(rows: list[tuple[Any, ...]], match: Callable[[str], bool] | None = None) -> list[Doc]:
    """The documents of rows of `projection` (each row a Doc's fields in order: a Doc is made
    of it with no Python code per row), filtered by --keys, Snappy undone."""
    return _docs_and_rows(rows, match)[0]


def _docs_and_rows(rows: list[tuple[Any, ...]], match: Callable[[str], bool] | None) -> tuple[list[Doc], list[int]]:
    """(docs_of, the index of each one's row)."""
    docs: list[Doc] = list(map(_TUPLE, itertools.repeat(Doc), rows))
    kept = range(len(docs))
    if match is not None:
        kept = [i for i, d in enumerate(docs) if match(d.key.decode("utf-8", "replace"))]   # type: ignore[assignment]
        docs = [docs[i] for i in kept]
    for i, d in enumerate(docs):
        if d.value is None:
            raise BadFrame(f"the capture holds no value for document {d.key.decode('utf-8', 'replace')!r}")
        if d.datatype & _SNAPPY:
            docs[i] = d._replace(value=_unsnappy(d.value), datatype=d.datatype & ~_SNAPPY)
    return docs, list(kept)


def _unsnappy(value: bytes) -> bytes:
    try:
        return snappy.decompress(value, DEFAULT_MAX_BODY)
    except ValueError as exc:
        raise BadFrame(f"a recorded value does not decompress: {exc}") from None
