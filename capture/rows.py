"""DCP rows for output, without the CLI (the output contract of docs/CLI.md): keys as text
(`key_base64` for the keys that are not UTF-8), values as JSON (value_fields), snapshot flags
by name, rows as JSON lines (jsonl_bytes, json_default). frame_columns / rows_of / jsonl_of
turn a batch of whole frames into rows for `stream` and `decode` alike: the columnar decoder
(protocol/dcp/wire/columnar.py, the one DCP decoder of the project) turns the frames into
columns with the capture format's names; this adds the value bytes when asked for, masks SASL
credentials in `raw` with the store's one masker and makes one dict per frame with every
column of the row set (absent fields None). All of it column by column: a row is built once,
by one dict(zip(...)), which keeps `stream --format jsonl` near the speed of writing the JSON
itself. cli/view/output.py writes these rows to stdout."""

from __future__ import annotations

import base64
import contextlib
import gc

import orjson

from dcptool.protocol.dcp.wire import columnar
from dcptool.replay.store.redact import mask_sasl_credentials

# ------------------------------------------------------------------ keys and values

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


@contextlib.contextmanager
def bulk_rows():
    """The cyclic garbage collector off while rows are made in bulk: rows hold no cycles,
    and with tens of thousands alive per batch its passes cost more than the rows."""
    was = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was:
            gc.enable()


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


_SASL_OPS = ("sasl_auth", "sasl_step")


def _key_columns(keys: list, n: int) -> tuple[list, list]:
    """`key` as text and `key_base64` for the keys that are not UTF-8 (output contract)."""
    text, b64 = [None] * n, [None] * n
    for i, k in enumerate(keys):
        if k is not None:
            try:
                text[i] = str(k, "utf-8")
            except UnicodeDecodeError:
                b64[i] = base64.b64encode(bytes(k)).decode("ascii")
    return text, b64


def frame_columns(buf, offsets, lengths, *, template: dict, collections: bool = False,
                  opaque_vbuckets: dict | None = None, values: bool = False, raw: bool = False,
                  extra: dict | None = None, first_frame_no: int | None = None) -> tuple[dict, int]:
    """The display columns of the whole frames at offsets/lengths of buf: {name: list} for
    the columns some frame carries, and the number of frames. `extra` is set on every row
    (conn, ts, direction ...); `first_frame_no` numbers the rows; `opaque_vbuckets` gives
    responses the vbucket of their request and learns from the requests in this batch."""
    batch = columnar.decode_batch(buf, offsets, lengths, collections=collections,
                                  opaque_vbuckets=opaque_vbuckets)
    n = batch.n
    if n == 0:
        return {}, 0
    cols = columnar.to_columns(batch, raw=raw)
    ops = cols["op"]
    sasl = [i for i, op in enumerate(ops) if op in _SASL_OPS]
    if "key" in cols:
        cols["key"], cols["key_base64"] = _key_columns(cols["key"], n)
    if raw:
        for i in sasl:
            cols["raw"][i] = mask_sasl_credentials(bytes(cols["raw"][i]))
    if values and "value_len" in cols:
        vals, b64s, errs = [None] * n, [None] * n, [None] * n
        dts = cols.get("datatype") or [None] * n
        masked = set(sasl)
        for i, (vl, off, ln) in enumerate(zip(cols["value_len"], offsets.tolist(), lengths.tolist())):
            if vl is not None:   # a SASL payload shows as '*' bytes
                v = b"*" * vl if i in masked else bytes(buf[off + ln - vl:off + ln])
                vals[i], b64s[i], errs[i] = value_fields(v, dts[i])
        cols["value"], cols["value_base64"], cols["value_error"] = vals, b64s, errs
    if "snap_flags" in cols and "snap_flag_names" in template:
        cols["snap_flag_names"] = [OSO_FLAG_NAMES.get(f) if op == "oso_snapshot" else snap_flag_names(f)
                                   for f, op in zip(cols["snap_flags"], ops)]
    for name, v in (extra or {}).items():
        cols[name] = [v] * n
    if first_frame_no is not None:
        cols["frame_no"] = list(range(first_frame_no, first_frame_no + n))
    return {k: v for k, v in cols.items() if k in template}, n


def rows_of(cols: dict, n: int, template: dict) -> list[dict]:
    """One dict per frame from frame_columns' result, with every key of `template` in order."""
    rows = []
    append = rows.append
    present = [name for name in template if name in cols]
    for values in zip(*(cols[name] for name in present)):
        d = template.copy()
        d.update(zip(present, values))
        append(d)
    return rows


def jsonl_of(cols: dict, n: int, template: dict) -> bytes:
    """The same rows as rows_of, as JSON lines, without making a dict of every column: a
    column that is null or one value over the whole batch (absent fields, conn, ts ...) is
    encoded once and joined to each row's varying part. Every line carries every key of
    `template` (the order of keys within a line is not part of the contract)."""
    if n == 0:
        return b""
    fixed, varying = {}, []
    for name in template:
        col = cols.get(name)
        if col is None:
            fixed[name] = None
        elif type(col[0]) is type(col[-1]) and col.count(col[0]) == n:
            fixed[name] = col[0]
        else:
            varying.append(name)
    tail = orjson.dumps(fixed, default=json_default)[1:]          # b'"k":null,...}'
    if not varying:
        return (b"{" + tail + b"\n") * n
    sep = b"," if len(tail) > 1 else b""
    out = bytearray()
    dumps = orjson.dumps
    for values in zip(*(cols[name] for name in varying)):
        out += dumps(dict(zip(varying, values)), default=json_default)[:-1]
        out += sep
        out += tail
        out += b"\n"
    return bytes(out)
