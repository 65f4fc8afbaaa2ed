"""The producer's collections, sans-IO: the bucket's manifest (scopes and collections with
Couchbase's ids), which collection each generated document lives in, the scripted
create/drop events and the system-event items they put into every vbucket's history, and
the stream filter of a STREAM_REQ value (kv_engine docs/dcp/documentation/commands/
stream-request-value.md, system_event.md). Used by producer.py and producer_streams.py.

Model: the manifest given at start is the bucket's state at seqno 0 (no system events for
it; a client learns it from GET_COLLECTIONS_MANIFEST). Every document belongs to one of the
start collections by its number (doc-N -> N modulo their count, `_default` first). A
scripted create or drop moves the manifest uid on by one and appends one system event to
every vbucket; a dropped collection's items are never sent again, as in Couchbase where
they are logically deleted at once.
"""

from __future__ import annotations

import dataclasses
import json
import struct
from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING, Any, Protocol, TypeVar

from dcptool.protocol.dcp.wire.constants import Status

if TYPE_CHECKING:
    import numpy as np
    import numpy.typing as npt


# What this module uses of the bucket, its items and the server (bucket.py and shared.py
# import this module: they are described here, not imported)
class SystemItem(Protocol):
    """An item of a vbucket's history (bucket.Item)."""
    @property
    def seqno(self) -> int: ...
    @property
    def kind(self) -> str: ...
    @property
    def cid(self) -> int: ...
    @property
    def value(self) -> bytes: ...


class _Appended(Protocol):
    datatype: int


class _VBucket(Protocol):
    def append(self, key: bytes, value: bytes, kind: str, cas: int, cid: int = ...) -> _Appended: ...


class _Bucket(Protocol):
    generation: int

    @property
    def vbuckets(self) -> Sequence[_VBucket]: ...

    def next_cas(self) -> int: ...


class _Server(Protocol):
    topology_changes: int

    @property
    def stream_frames(self) -> int: ...


_I = TypeVar("_I", bound=SystemItem)

DEFAULT_ID = 0                  # _default scope and _default collection
FIRST_USER_ID = 8               # kv_engine: ids 1-7 are reserved
MAX_START_ID = 0x7F             # start collections keep a one-byte LEB128 key prefix
EVENT_CREATE_COLLECTION = 0     # system_event.md: "a collection begins"
EVENT_DROP_COLLECTION = 1       # "a collection ends"
SCOPE_NAMES = ("inventory", "tenants", "sales", "archive", "staging", "audit")
COLLECTION_NAMES = ("airline", "route", "hotel", "landmark", "airport")
_CREATE = struct.Struct(">QII")   # manifest uid, scope id, collection id (version 0)
_DROP = struct.Struct(">QII")


@dataclasses.dataclass
class Collection:
    cid: int
    name: str
    sid: int
    dropped: bool = False
    history: bool = False       # keeps every version of a key (producer_history.py)


@dataclasses.dataclass(frozen=True)
class Event:
    """A scripted manifest change: after `at` stream frames (server-wide)."""
    at: int
    kind: str        # "create" or "drop"
    scope: str
    name: str


class Manifest:
    """Scopes, collections and the manifest uid; the scripted events still to come."""

    def __init__(self, scopes: int = 0, per_scope: int = 0, events: tuple[Event, ...] = ()):
        if scopes * per_scope > MAX_START_ID - FIRST_USER_ID + 1:
            raise ValueError(f"at most {MAX_START_ID - FIRST_USER_ID + 1} collections at start")
        self.scopes: dict[int, str] = {DEFAULT_ID: "_default"}
        self.collections: dict[int, Collection] = {DEFAULT_ID: Collection(DEFAULT_ID, "_default", DEFAULT_ID)}
        next_id = FIRST_USER_ID
        for i in range(scopes):
            sid = FIRST_USER_ID + i
            self.scopes[sid] = SCOPE_NAMES[i] if i < len(SCOPE_NAMES) else f"scope{i}"
            for j in range(per_scope):
                name = COLLECTION_NAMES[j] if j < len(COLLECTION_NAMES) else f"col{j}"
                self.collections[next_id] = Collection(next_id, name, sid)
                next_id += 1
        self.next_id = next_id
        self.history_default = False    # collections created later keep history too (history.py)
        self.uid = 1 if scopes else 0
        self.start_ids = tuple(self.collections)          # documents are spread over these
        self.events = sorted(events, key=lambda e: e.at)
        for e in self.events:
            if e.scope not in self.scopes.values():
                raise ValueError(f"scope {e.scope!r} does not exist (scopes: {', '.join(self.scopes.values())})")

    # ---- names and ids
    def scope_id(self, name: str) -> int | None:
        return next((sid for sid, n in self.scopes.items() if n == name), None)

    def find(self, scope: str, name: str) -> Collection | None:
        sid = self.scope_id(scope)
        return next((c for c in self.collections.values()
                     if c.sid == sid and c.name == name and not c.dropped), None)

    def live_ids(self) -> set[int]:
        return {c.cid for c in self.collections.values() if not c.dropped}

    def cid_of_doc(self, number: int) -> int:
        return self.start_ids[number % len(self.start_ids)]

    def cid_of_key(self, key: bytes) -> int:
        """The collection of a generated key doc-NNNNNNNN (anything else: _default)."""
        if len(self.start_ids) == 1 or not key.startswith(b"doc-"):
            return DEFAULT_ID
        try:
            return self.cid_of_doc(int(key[4:]))
        except ValueError:
            return DEFAULT_ID

    def to_json(self) -> bytes:
        """The GET_COLLECTIONS_MANIFEST body, as Couchbase writes it (ids as hex strings)."""
        scopes = []
        for sid, sname in self.scopes.items():
            cols = [{"name": c.name, "uid": f"{c.cid:x}", **({"history": True} if c.history else {})}
                    for c in self.collections.values() if c.sid == sid and not c.dropped]
            scopes.append({"name": sname, "uid": f"{sid:x}", "collections": cols})
        return json.dumps({"uid": f"{self.uid:x}", "scopes": scopes}, separators=(",", ":")).encode()

    def error_body(self) -> bytes:
        """The body of UNKNOWN_COLLECTION / UNKNOWN_SCOPE: the manifest uid the server has."""
        return json.dumps({"manifest_uid": f"{self.uid:x}"}, separators=(",", ":")).encode()

    # ---- scripted events
    def next_event_at(self) -> int | None:
        return self.events[0].at if self.events else None

    def fire_due(self, frames: int, bucket: _Bucket) -> int:
        """Apply every event due at `frames` stream frames: one system event per vbucket
        each. Returns how many fired."""
        fired = 0
        while self.events and self.events[0].at <= frames:
            ev = self.events.pop(0)
            if self._apply(ev, bucket):
                fired += 1
        if fired:
            bucket.generation += 1
        return fired

    def _apply(self, ev: Event, bucket: _Bucket) -> bool:
        sid = self.scope_id(ev.scope)
        if sid is None:     # never: __init__ refused events in a scope that does not exist
            return False
        col: Collection | None
        if ev.kind == "create":
            if self.find(ev.scope, ev.name) is not None:
                return False
            col = Collection(self.next_id, ev.name, sid, history=self.history_default)
            self.next_id += 1
            self.collections[col.cid] = col
            self.uid += 1
            value = _CREATE.pack(self.uid, sid, col.cid) + ev.name.encode()
            kind = "sc"
        else:
            col = self.find(ev.scope, ev.name)
            if col is None:
                return False
            col.dropped = True
            self.uid += 1
            value = _DROP.pack(self.uid, sid, col.cid)
            kind = "sd"
        # the item key is internal (never sent): unique per event, so that de-duplication
        # within a snapshot never merges two events
        key = b"\x00%s:%d" % (kind.encode(), col.cid)
        for vb in bucket.vbuckets:
            it = vb.append(key, value, kind, bucket.next_cas(), col.cid)
            it.datatype = 0
        return True


def system_event_frame(vbid: int, opaque: int, it: SystemItem) -> bytes:
    """The DCP_SYSTEM_EVENT of a collection create (key: the name; value version 0:
    manifest uid, scope id, collection id) or drop (no key, the same value)."""
    from dcptool.protocol.dcp.wire import messages as m
    if it.kind == "sc":
        value, key, event = it.value[:_CREATE.size], it.value[_CREATE.size:], EVENT_CREATE_COLLECTION
    else:
        value, key, event = it.value, b"", EVENT_DROP_COLLECTION
    return m.encode(m.SystemEvent(vbucket=vbid, opaque=opaque, by_seqno=it.seqno, event_id=event, version=0,
                                  key=key, value=value))


def parse_events(create_at: Iterable[str], drop_at: Iterable[str]) -> tuple[Event, ...]:
    """--create-collection-at / --drop-collection-at N:SCOPE.NAME; ValueError with the
    reason for a bad one."""
    out = []
    for kind, texts in (("create", create_at), ("drop", drop_at)):
        for text in texts:
            at, sep, rest = text.partition(":")
            scope, dot, name = rest.partition(".")
            if not at.isdigit() or int(at) < 1 or not sep or not dot or not scope or not name:
                raise ValueError(f"{text!r} is not N:SCOPE.NAME (e.g. 5000:inventory.airline)")
            out.append(Event(int(at), kind, scope, name))
    return tuple(out)


# --------------------------------------------------------------------------- filters

@dataclasses.dataclass
class Filter:
    """What one stream sends: `cids` None for every collection, else the filtered ids;
    `scope` the scope id of a scope filter (collections created in it join)."""
    cids: set[int] | None = None
    scope: int | None = None
    legacy: bool = False        # a connection without collections: _default only, no events
    remaining: set[int] | None = None  # filtered collections whose drop the stream has not sent

    def __post_init__(self) -> None:
        if self.cids is not None and self.remaining is None:
            self.remaining = set(self.cids)

    def allows(self, cid: int, manifest: Manifest) -> bool:
        if self.legacy:
            return cid == DEFAULT_ID
        if self.scope is not None:
            col = manifest.collections.get(cid)
            return col is not None and col.sid == self.scope
        return self.cids is None or cid in self.cids

    def allowed_ids(self, manifest: Manifest) -> set[int]:
        """Live collections whose items this stream sends."""
        return {cid for cid in manifest.live_ids() if self.allows(cid, manifest)}

    def event_allowed(self, cid: int, manifest: Manifest) -> bool:
        if self.legacy:
            return False        # kv_engine sends no system events without collections
        col = manifest.collections.get(cid)
        if self.scope is not None:
            return col is not None and col.sid == self.scope
        return self.cids is None or cid in self.cids

    def disk_mask(self, cids: npt.NDArray[np.integer[Any]], manifest: Manifest) -> npt.NDArray[np.bool_] | None:
        """A boolean mask over disk items' collection ids; None when every item passes."""
        import numpy as np
        allowed = self.allowed_ids(manifest)
        if self.cids is None and self.scope is None and not self.legacy and allowed >= set(manifest.start_ids):
            return None
        mask = np.isin(cids, np.array(sorted(allowed), dtype=cids.dtype))
        return None if mask.all() else mask

    def memory_items(self, items: list[_I], manifest: Manifest) -> tuple[list[_I], bool]:
        """(the items of a memory snapshot this stream gets, in order; whether the stream
        ends "filter empty" after the last of them: its last filtered collection dropped)."""
        allowed = self.allowed_ids(manifest)
        out: list[_I] = []
        for it in items:
            if it.kind in ("sc", "sd"):
                if not self.event_allowed(it.cid, manifest):
                    continue
                out.append(it)
                if it.kind == "sd" and self.remaining is not None and it.cid in self.remaining:
                    self.remaining.discard(it.cid)
                    if not self.remaining:
                        return out, True
            elif it.cid in allowed:
                out.append(it)
        return out, False


def next_event_at(bucket: object) -> int | None:
    manifest = getattr(bucket, "manifest", None)
    return None if manifest is None else manifest.next_event_at()


def fire_due(server: _Server, bucket: object) -> None:
    """Scripted manifest events due at the server's stream frame count; wakes every
    connection when one fired (the transports watch `topology_changes`)."""
    manifest = getattr(bucket, "manifest", None)
    if manifest is not None and manifest.events and manifest.fire_due(server.stream_frames, bucket):
        server.topology_changes += 1


def manifest_reply(bucket: object) -> tuple[int, bytes]:
    """GET_COLLECTIONS_MANIFEST (0xba): status and body."""
    manifest = getattr(bucket, "manifest", None)
    if manifest is None:
        return Status.NO_BUCKET if bucket is None else Status.UNKNOWN_COMMAND, b""
    return Status.SUCCESS, manifest.to_json()


def parse_filter(value: bytes, manifest: Manifest | None, collections: bool) -> tuple[int, Filter | None, bytes]:
    """(status, filter, error body) for a STREAM_REQ value. An empty value: every
    collection (or, without collections, the default one); the filter is None when it
    would pass everything (a bucket of `_default` alone, nothing scripted)."""
    if manifest is None:
        return (Status.SUCCESS if not value else Status.EINVAL), None, b""
    if not value:
        trivial = len(manifest.collections) == 1 and not manifest.events
        return Status.SUCCESS, None if trivial else Filter(legacy=not collections), b""
    if not collections:
        return Status.EINVAL, None, b""
    try:
        doc = json.loads(value)
    except (ValueError, UnicodeDecodeError):
        return Status.EINVAL, None, b""
    if not isinstance(doc, dict) or ("collections" in doc and "scope" in doc):
        return Status.EINVAL, None, b""
    if "uid" in doc and not isinstance(doc["uid"], str):
        return Status.EINVAL, None, b""
    if "sid" in doc:        # stream ids are not offered here
        return Status.EINVAL, None, b""
    if "collections" in doc:
        ids = doc["collections"]
        if not isinstance(ids, list) or not ids or not all(isinstance(x, str) for x in ids):
            return Status.EINVAL, None, b""
        try:
            cids = {int(x, 16) for x in ids}
        except ValueError:
            return Status.EINVAL, None, b""
        if not cids <= manifest.live_ids():
            return Status.UNKNOWN_COLLECTION, None, manifest.error_body()
        return Status.SUCCESS, Filter(cids=cids), b""
    if "scope" in doc:
        if not isinstance(doc["scope"], str):
            return Status.EINVAL, None, b""
        try:
            sid = int(doc["scope"], 16)
        except ValueError:
            return Status.EINVAL, None, b""
        if sid not in manifest.scopes:
            return Status.UNKNOWN_SCOPE, None, manifest.error_body()
        return Status.SUCCESS, Filter(scope=sid), b""
    return Status.SUCCESS, Filter(), b""
