"""DCP frames as rows for `stream` and `decode` alike, without the CLI: the columnar decoder
(protocol/dcp/wire/columnar.py, the one DCP decoder of the project) turns a batch of whole
frames into columns with the capture format's names; this adds the value bytes when asked
for, masks SASL credentials in `raw` with the store's one masker, applies the output
contract (replay/display.py: keys as text, values as JSON) and makes one dict per frame with
every column of the row set (absent fields None). All of it column by column: a row is
built once, by one dict(zip(...)), which keeps `stream --format jsonl` near the speed of
writing the JSON itself. cli/view/output.py writes these rows to stdout."""

from __future__ import annotations

import base64
import contextlib
import gc
from typing import Any

import orjson

from dcptool.protocol.dcp.wire import columnar
from dcptool.replay.display import (
    OSO_FLAG_NAMES,
    VALUE_COLUMNS,
    json_default,
    snap_flag_names,
    value_fields,
    with_key_base64,
)
from dcptool.replay.store.redact import mask_sasl_credentials


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


# The columns of a `stream` row: the capture format's (replay/store/schema.py; a test checks they
# agree) plus `key_base64` and `snap_flag_names` (the marker flags by name); `value`/`value_base64`/
# `value_error` with --values, `raw` with --raw.
STREAM_COMMON_COLUMNS = ("frame_no", "conn", "node", "ts", "mono_ns", "direction")
STREAM_DCP_COLUMNS = ("magic", "opcode", "op", "status", "vbucket", "opaque", "cas", "datatype", "stream_id",
                      "collection_id", "key", "key_base64", "value_len", "by_seqno", "rev_seqno", "item_flags",
                      "expiration", "lock_time", "delete_time", "snap_version", "snap_start", "snap_end",
                      "snap_flags", "snap_flag_names", "max_visible_seqno", "high_completed_seqno", "purge_seqno",
                      "high_prepared_seqno", "stream_end_reason", "rollback_seqno", "failover_log", "req_flags",
                      "req_start_seqno", "req_end_seqno", "req_vbucket_uuid", "req_snap_start", "req_snap_end",
                      "system_event_id", "decode_error")


def row_columns(values: bool = False, raw: bool = False) -> list[str]:
    """Every column of a `stream` DCP row, in order (JSON lines carry all of them)."""
    return [*STREAM_COMMON_COLUMNS, *STREAM_DCP_COLUMNS, *(("value", "value_base64", "value_error") if values else ()),
            *(("raw",) if raw else ())]


CHUNK = 4 * 1024 * 1024   # bytes decode_stream reads at a time
_SASL_OPS = ("sasl_auth", "sasl_step")


def _key_columns(keys: list, n: int) -> tuple[list, list]:
    """`key` as text and `key_base64` for the keys that are not UTF-8 (output contract)."""
    text: list[str | None] = [None] * n
    b64: list[str | None] = [None] * n
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
        vals: list[Any] = [None] * n
        b64s: list[Any] = [None] * n
        errs: list[Any] = [None] * n
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
    rows: list[dict[str, Any]] = []
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
    fixed: dict[str, Any] = {}
    varying: list[str] = []
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


def column_set(raw: bool, values: bool) -> list[str]:
    """Every column of a decode row, in order (JSON lines carry all of them)."""
    from dcptool.protocol.dcp.wire.columnar import ROW_ORDER
    cols = with_key_base64(list(ROW_ORDER))
    if values:
        at = cols.index("value_len") + 1
        cols[at:at] = VALUE_COLUMNS
    return cols + (["raw"] if raw else [])


def decode_stream(file, sink, cap: int, *, collections: bool = False, raw: bool = False, values: bool = False) -> None:
    """`decode`: the DCP frames read from binary `file` (CHUNK bytes at a time) as rows into
    `sink` (cli/view/output.py Sink: write_jsonl or write_many), every whole frame before a
    truncated last one or a hostile length (RemoteError, at its byte offset in the stream)."""
    from dcptool.protocol.dcp.wire import columnar
    from dcptool.protocol.dcp.wire.frames import header_lengths
    from dcptool.protocol.errors import ErrorCode, RemoteError

    blank = dict.fromkeys(column_set(raw, values))

    opaque_vb: dict[int, int] = {}
    buf = b""
    base = 0  # stream offset of buf[0]
    while True:
        chunk = file.read(CHUNK)
        buf = buf + chunk if buf else chunk
        offsets, lengths, consumed, err = columnar.scan(buf, cap)
        cols, n = frame_columns(buf, offsets, lengths, template=blank, collections=collections,
                                opaque_vbuckets=opaque_vb, values=values, raw=raw)
        if sink.fmt == "jsonl":
            sink.write_jsonl(jsonl_of(cols, n, blank), n)
        else:
            sink.write_many(rows_of(cols, n, blank))
        if err is not None:
            err.args = (err.message.replace(f"at byte {consumed}", f"at byte {base + consumed}"),)
            raise err
        buf = buf[consumed:]
        base += consumed
        if not chunk:
            break
    if buf:
        need = ""
        if len(buf) >= 24:
            need = f" of {24 + header_lengths(buf[:24])[3]}"
        raise RemoteError(ErrorCode.TRUNCATED,
                          f"truncated frame at byte {base}: input ends after {len(buf)}{need} bytes")
