"""Document bodies in `documents` and `history` (REPLAY.md "Bodies"): the part of the rule
that SQL cannot spell, run by both engines as a function of the value as sent and its datatype
(DuckDB: a Python scalar function, replay/local/duck.py; Spark: a Python UDF,
replay/spark/bodies.py), only for the rows whose datatype says Snappy or xattrs.

The SQL part (replay/rules/plans.py `with_bodies`) cuts the value as sent from `raw` (its last
`value_len` bytes: a DCP frame's body ends with its value), late, for the rows that survive a
plan; `split` then undoes Snappy and cuts the xattr section off:
- Snappy (datatype 0x02): the value is raw Snappy; one that does not decompress (or announces
  more than 20 MiB, the largest Couchbase item) gives no value and no xattrs (both null).
- Xattrs (0x04): the value starts with the section: a u32 (big-endian) length N, then N bytes
  of pairs, each a u32 length and that many bytes: `KEY \\0 VALUE \\0`. The value is what
  follows the section. A length past the end of the value gives null value and xattrs; pairs
  that do not parse give null xattrs and the value still cut.
- The xattrs as JSON object text, pairs in the order stored: `{"KEY":VALUE,...}`, each key a
  JSON string (only `"`, `\\` and control characters escaped, the rest UTF-8 as is; bytes that
  are not UTF-8 as U+FFFD), each value the stored text itself when it is JSON (xattr values are
  JSON in Couchbase), else a JSON string of it. No spaces between the parts.

Nothing here imports numpy or pyarrow (the DuckDB-written `-o` path loads neither)."""

from __future__ import annotations

from typing import Any

import orjson

SNAPPY, XATTR = 0x02, 0x04
CODED = SNAPPY | XATTR           # datatype bits that need `split`
MAX_VALUE = 20 * 1024 * 1024     # the largest Couchbase item: a bigger Snappy claim is hostile
FUNCTION = "dcp_body"            # the name both engines register `split` under


def split(value: bytes | None, datatype: int | None) -> tuple[bytes | None, str | None]:
    """(value as the application stored it, xattrs as JSON object text) of a value as sent."""
    if value is None:
        return None, None
    dt = datatype or 0
    b = bytes(value)
    if dt & SNAPPY:
        from dcptool.protocol.dcp.wire import snappy
        try:
            b = snappy.decompress(b, MAX_VALUE)
        except ValueError:
            return None, None
    if not dt & XATTR:
        return b, None
    if len(b) < 4:
        return None, None
    n = int.from_bytes(b[:4], "big")
    if 4 + n > len(b):
        return None, None
    return b[4 + n:], xattrs_json(b[4:4 + n])


def xattrs_json(section: bytes) -> str | None:
    """The pairs of an xattr section (without its length) as JSON object text; None when they
    do not parse."""
    parts = []
    pos = 0
    while pos < len(section):
        if pos + 4 > len(section):
            return None
        n = int.from_bytes(section[pos:pos + 4], "big")
        pair = section[pos + 4:pos + 4 + n]
        pos += 4 + n
        if len(pair) != n or n < 2 or pair[-1] != 0:
            return None
        key, sep, val = pair[:-1].partition(b"\0")
        if not sep:
            return None
        parts.append(orjson.dumps(key.decode("utf-8", "replace")) + b":" + _json_text(val))
    return (b"{" + b",".join(parts) + b"}").decode("utf-8")


def _json_text(val: bytes) -> bytes:
    try:
        val.decode("utf-8")
        orjson.loads(val)
        return val
    except (UnicodeDecodeError, orjson.JSONDecodeError):
        return orjson.dumps(val.decode("utf-8", "replace"))


def split_struct(value: bytes | None, datatype: int | None) -> dict[str, object]:
    """`split` as the struct both engines' function returns ({value, xattrs})."""
    v, x = split(value, datatype)
    return {"value": v, "xattrs": x}


def may_be_coded(files: list[Any]) -> bool:
    """Whether a change of the captures may carry Snappy or xattrs, by the Parquet statistics
    of `datatype` (its max below 2: neither bit anywhere); True when they cannot tell. For
    the Spark engine (pyarrow loaded), which then leaves the Python UDF out of its plans."""
    from dcptool.replay.store import footers
    for f in files:
        if f.in_progress:
            return True
        try:
            md = footers.footer(f.path)
            i = footers.leaf_index(md, "datatype")
            if i is None:
                continue
            for r in range(md.num_row_groups):
                st = md.row_group(r).column(i).statistics
                if st is None or not st.has_min_max:
                    if st is not None and st.null_count == md.row_group(r).num_rows:
                        continue
                    return True
                if st.max >= SNAPPY:
                    return True
        except (OSError, ValueError, KeyError):
            return True
    return False
