"""The consumer's side of collections, sans-IO: the collections manifest a server returns
for GET_COLLECTIONS_MANIFEST (0xba), `--scope` / `--collection` names resolved to the ids
of a STREAM_REQ filter value (kv_engine stream-request-value.md), and the decoding of
collection system events (system_event.md, versions 0 and 1).

Ids are hex strings without 0x on the wire (manifest and filter alike)."""

from __future__ import annotations

import dataclasses
import json
import struct
from typing import Any

from dcptool.protocol.errors import DcptoolError, ErrorCode, RemoteError

MAX_MANIFEST = 4 * 1024 * 1024       # bytes of manifest JSON we accept
EVENT_NAMES = {0: "collection_create", 1: "collection_drop", 3: "scope_create", 4: "scope_drop",
               5: "collection_modify"}


@dataclasses.dataclass(frozen=True)
class Manifest:
    uid: int
    scopes: dict[str, tuple[int, dict[str, int]]]          # scope name -> (scope id, {collection name: collection id})

    def names(self) -> list[str]:
        """Every scope and SCOPE.COLLECTION, for error messages."""
        out = []
        for sname, (_sid, cols) in self.scopes.items():
            out.append(sname)
            out.extend(f"{sname}.{c}" for c in cols)
        return out

    def name_of(self, cid: int) -> str | None:
        for sname, (_sid, cols) in self.scopes.items():
            for cname, c in cols.items():
                if c == cid:
                    return f"{sname}.{cname}"
        return None


def _hex(text: Any, what: str) -> int:
    if not isinstance(text, str) or not text or len(text) > 16:
        raise ValueError(f"{what} is not a hex string")
    return int(text, 16)


def parse_manifest(body: bytes) -> Manifest:
    """The manifest JSON; RemoteError(BAD_COLLECTIONS_MANIFEST-like STATUS) when malformed."""
    if len(body) > MAX_MANIFEST:
        raise RemoteError(ErrorCode.STATUS, f"collections manifest of {len(body)} bytes (limit {MAX_MANIFEST})")
    try:
        doc = json.loads(body)
        uid = _hex(doc["uid"], "uid")
        scopes = {}
        for s in doc["scopes"]:
            cols = {}
            for c in s.get("collections", []):
                cols[str(c["name"])] = _hex(c["uid"], "collection uid")
            scopes[str(s["name"])] = (_hex(s["uid"], "scope uid"), cols)
    except (ValueError, KeyError, TypeError, AttributeError) as exc:
        raise RemoteError(ErrorCode.STATUS, f"the collections manifest does not parse: {exc}") from None
    return Manifest(uid, scopes)


class UnknownNames(DcptoolError, ValueError):
    """--scope / --collection naming what the manifest does not have."""

    def __init__(self, missing: list[str], manifest: Manifest):
        self.missing = missing
        self.manifest = manifest
        super().__init__(f"unknown {'name' if len(missing) == 1 else 'names'} {', '.join(missing)}: "
                         f"the bucket has {', '.join(manifest.names())} (manifest uid {manifest.uid:x})")


def resolve(manifest: Manifest, scopes: tuple[str, ...] = (), collections: tuple[str, ...] = ()) -> dict[str, Any]:
    """The STREAM_REQ filter for --scope and --collection names: {"scope": "8"} or
    {"collections": [...]}, plus "uid". A scope with collections given too: the scope's
    collections join the list (a stream takes one kind of filter). Raises UnknownNames."""
    missing, ids = [], []
    for name in collections:
        sname, dot, cname = name.partition(".")
        sc = manifest.scopes.get(sname)
        if not dot or sc is None or cname not in sc[1]:
            missing.append(name)
        else:
            ids.append(sc[1][cname])
    for sname in scopes:
        if sname not in manifest.scopes:
            missing.append(sname)
    if missing:
        raise UnknownNames(missing, manifest)
    uid = f"{manifest.uid:x}"
    if len(scopes) == 1 and not collections:
        return {"scope": f"{manifest.scopes[scopes[0]][0]:x}", "uid": uid}
    for sname in scopes:
        ids.extend(manifest.scopes[sname][1].values())
    return {"collections": [f"{c:x}" for c in sorted(set(ids))], "uid": uid}


def filter_value(flt: dict[str, Any] | None) -> bytes:
    return b"" if not flt else json.dumps(flt, separators=(",", ":")).encode()


_V0 = struct.Struct(">QII")
_SCOPE = struct.Struct(">QI")


def decode_system_event(event_id: int, version: int, key: bytes, value: bytes) -> dict[str, Any]:
    """The fields of a collection or scope system event (version 0 or 1 values); an
    unknown event or a short value gives what could be read and `error`."""
    out = {"event": EVENT_NAMES.get(event_id, f"unknown_{event_id}"), "name": None, "manifest_uid": None,
           "scope_id": None, "collection_id": None}
    if key:
        out["name"] = key.decode("utf-8", "replace")
    if version > 1:
        out["error"] = f"version {version} (FlatBuffers) not decoded"
        return out
    if event_id in (0, 1, 5) and len(value) >= _V0.size:
        out["manifest_uid"], out["scope_id"], out["collection_id"] = _V0.unpack_from(value)
    elif event_id in (3, 4) and len(value) >= _SCOPE.size:
        out["manifest_uid"], out["scope_id"] = _SCOPE.unpack_from(value)
    else:
        out["error"] = f"value of {len(value)} bytes"
    return out


class EventNotes:
    """One line per distinct collection system event a run received (a drop reaches every
    vbucket: it is told once), naming the collection from the manifest when it is known."""

    def __init__(self) -> None:
        self.manifest: Manifest | None = None
        self._seen: set[tuple[Any, ...]] = set()

    def lines(self, buf: Any, offsets: Any, lengths: Any) -> list[str]:
        """Lines for the new events among the whole frames at offsets/lengths of buf."""
        import numpy as np

        from dcptool.protocol.dcp.wire import messages as m
        u8 = np.frombuffer(buf, np.uint8)
        hit = np.flatnonzero((u8[offsets] == 0x80) & (u8[offsets + 1] == 0x5F))
        out = []
        for i in hit.tolist():
            off, n = int(offsets[i]), int(lengths[i])
            msg: Any = m.decode_bytes(bytes(u8[off:off + n]), False)
            if getattr(msg, "decode_error", None) is not None or not hasattr(msg, "event_id"):
                continue
            ev = decode_system_event(msg.event_id, msg.version, msg.key, msg.value)
            ident = (ev["event"], ev["scope_id"], ev["collection_id"], ev["manifest_uid"])
            if ident in self._seen:
                continue
            self._seen.add(ident)
            out.append(self.describe(ev))
        return out

    def describe(self, ev: dict[str, Any]) -> str:
        name = ev["name"]
        cid = ev["collection_id"]
        if self.manifest is not None and cid is not None:
            known = self.manifest.name_of(cid)
            scope = next((s for s, (sid, _c) in self.manifest.scopes.items() if sid == ev["scope_id"]), None)
            name = known or (f"{scope}.{name}" if scope and name else name)
        parts = [ev["event"].replace("_", " ")]
        if name:
            parts.append(name)
        if cid is not None:
            parts.append(f"(collection 0x{cid:x})")
        elif ev["scope_id"] is not None:
            parts.append(f"(scope 0x{ev['scope_id']:x})")
        if ev["manifest_uid"] is not None:
            parts.append(f"manifest uid 0x{ev['manifest_uid']:x}")
        if ev.get("error"):
            parts.append(f"[{ev['error']}]")
        return " ".join(parts)
