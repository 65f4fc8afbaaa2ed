"""The output contract of DCP rows (docs/CLI.md), without the CLI: keys as text
(`key_base64` for the keys that are not UTF-8), values as JSON (value_fields, Snappy
decompressed), snapshot flags by name, the printed column order, rows as JSON lines
(jsonl_bytes, json_default). `stream`, `decode` (replay/rows.py), `replay`
(replay/results.py) and `diff` show rows through it."""

from __future__ import annotations

import base64
from typing import Any

import orjson

DATATYPE_JSON, DATATYPE_SNAPPY, DATATYPE_XATTR = 0x01, 0x02, 0x04
MAX_SNAPPY_OUT = 20 * 1024 * 1024  # the largest Couchbase item: a bigger claim is hostile


def _b64(b) -> str:
    return base64.b64encode(b).decode("ascii")


def key_fields(key) -> tuple[str | None, str | None]:
    """(key, key_base64): the UTF-8 text and None, or None and the bytes as base64."""
    if key is None:
        return None, None
    if type(key) is str:
        return key, None
    b = bytes(key)
    try:
        return b.decode("utf-8"), None
    except UnicodeDecodeError:
        return None, _b64(b)


def snappy_decompress(b: bytes) -> bytes:
    """Raw (unframed) Snappy, as Couchbase sends it; ValueError when it is not."""
    from dcptool.protocol.dcp.wire import snappy
    return snappy.decompress(b, MAX_SNAPPY_OUT)


def value_fields(value, datatype: int | None) -> tuple[object, str | None, str | None]:
    """(value, value_base64, value_error) for display. A value of JSON datatype (after
    Snappy decompression when the Snappy bit is set) that parses is the JSON value itself;
    anything else is base64 (decompressed when it could be). A value that does not
    decompress keeps its bytes as sent, with value_error saying why."""
    if value is None:
        return None, None, None
    b = bytes(value)
    dt = datatype or 0
    if dt & DATATYPE_SNAPPY:
        try:
            b = snappy_decompress(b)
        except ValueError as exc:
            return None, _b64(b), f"snappy: {exc}"
    if dt & DATATYPE_JSON and not dt & DATATYPE_XATTR:
        try:
            return orjson.loads(b), None, None
        except orjson.JSONDecodeError as exc:
            return None, _b64(b), f"not valid JSON: {str(exc).splitlines()[0]}"
    return None, _b64(b), None


# snapshot marker flags by name (DCP_DIGEST §5.3), lowest bit first
SNAP_FLAG_NAMES = ((0x01, "memory"), (0x02, "disk"), (0x04, "checkpoint"), (0x08, "ack"), (0x10, "history"),
                   (0x20, "may_duplicates"))
_FLAG_NAME_CACHE: dict = {}
OSO_FLAG_NAMES = {0x01: "oso_start", 0x02: "oso_end"}   # an oso_snapshot row's snap_flags


def snap_flag_names(flags: int | None) -> str | None:
    """Snapshot marker flags as `disk|checkpoint|history|may_duplicates` (unknown bits as hex)."""
    if flags is None:
        return None
    name = _FLAG_NAME_CACHE.get(flags)
    if name is None:
        parts = [n for bit, n in SNAP_FLAG_NAMES if flags & bit]
        rest = flags & ~0x3F
        if rest:
            parts.append(f"0x{rest:x}")
        name = _FLAG_NAME_CACHE.setdefault(flags, "|".join(parts))
    return name


def dcp_display(row: dict) -> dict:
    """A DCP row (from messages.to_row or the codecs) made ready for output, in place: `key`
    as text with `key_base64` for a key that is not UTF-8; with a `value` column,
    `value` / `value_base64` / `value_error` as value_fields says; an empty `snap_flag_names`
    column gets the marker flags by name (as frame_columns does)."""
    if "key" in row:
        k = row["key"]
        if k is None or type(k) is str:
            row.setdefault("key_base64", None)
        else:
            row["key"], row["key_base64"] = key_fields(k)
    if "value" in row:
        v = row["value"]
        if isinstance(v, (bytes, bytearray, memoryview)):
            row["value"], row["value_base64"], row["value_error"] = value_fields(v, row.get("datatype"))
        else:  # no value, or made ready already
            row.setdefault("value_base64", None)
            row.setdefault("value_error", None)
    if "snap_flag_names" in row and row["snap_flag_names"] is None and row.get("snap_flags") is not None:
        f = row["snap_flags"]
        row["snap_flag_names"] = OSO_FLAG_NAMES.get(f) if row.get("op") == "oso_snapshot" else snap_flag_names(f)
    return row


VALUE_COLUMNS = ["value", "value_base64", "value_error"]


def body_display(row: dict[str, Any]) -> dict[str, Any]:
    """A row of `documents` or `history` (REPLAY.md "Bodies": `value` already decompressed,
    without its xattrs) made ready for output, in place: a JSON body (`value_json` set) as
    the JSON value itself in `value`; any other value as base64 in `value_base64`; a
    `value_json` that does not parse as JSON as base64 too, with `value_error`; `xattrs` as
    a JSON object; `value_json` itself left out (it is `value`)."""
    v, text = row.get("value"), row.pop("value_json", None)
    row["value"] = row["value_base64"] = row["value_error"] = None
    if text is not None:
        try:
            row["value"] = orjson.loads(text)
        except orjson.JSONDecodeError as exc:
            row["value_base64"], row["value_error"] = _b64(v), f"not valid JSON: {str(exc).splitlines()[0]}"
    elif v is not None:
        row["value_base64"] = _b64(v)
    x = row.pop("xattrs", None)
    row["xattrs"] = None if x is None else orjson.loads(x)
    return row


def display_columns(columns: list[str], values: bool = False) -> list[str]:
    """A DCP table's columns with key_base64 after key and, with --values, the value
    columns after value_len (or at the end)."""
    cols = with_key_base64(columns)
    if values:
        at = cols.index("value_len") + 1 if "value_len" in cols else len(cols)
        cols[at:at] = [c for c in VALUE_COLUMNS if c not in cols]
    return cols


def with_key_base64(columns: list[str]) -> list[str]:
    """`columns` with key_base64 right after key (table column lists)."""
    out = []
    for c in columns:
        out.append(c)
        if c == "key" and "key_base64" not in columns:
            out.append("key_base64")
    return out


def json_default(obj):
    if isinstance(obj, (bytes, bytearray, memoryview)):
        return base64.b64encode(bytes(obj)).decode("ascii")
    if hasattr(obj, "isoformat"):
        return obj.isoformat()
    if isinstance(obj, (set, frozenset)):
        return sorted(obj)
    raise TypeError(f"cannot encode {type(obj).__name__} as JSON")


JSONL_OPTS = orjson.OPT_APPEND_NEWLINE | orjson.OPT_NON_STR_KEYS


def jsonl_bytes(row: dict) -> bytes:
    return orjson.dumps(row, default=json_default, option=JSONL_OPTS)
