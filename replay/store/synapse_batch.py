"""Synapse lines -> one Arrow RecordBatch with the Synapse capture columns
(replay/store/schema.py), built column-wise for the capture hot path (300k lines/s).

Each call takes the lines that arrived together (one read from the socket, or one Redis
message): they share ``conn``, ``ts``, ``mono_ns``, ``direction`` and ``channel``. RDATA
lines take a fast path (one ``bytes.split`` per line, columns built with comprehensions
and from joined buffers); every other line is parsed with protocol/synapse/commands.py.
The row JSON is kept as text, not parsed. USER_IP access tokens are masked with `*`
before anything is stored.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from dcptool.protocol.errors import RemoteError
from dcptool.protocol.synapse import commands as C
from dcptool.protocol.synapse.bulk import SplitLines, split_lines
from dcptool.replay.store.schema import capture_schema

SCHEMA = capture_schema("synapse")
_TYPES = {f.name: f.type for f in SCHEMA}
BATCH_SCHEMA = SCHEMA.remove(SCHEMA.get_field_index("capture_id"))


def _binary(values: list[bytes], typ=pa.binary()) -> pa.Array:
    """A binary/string array from bytes values without per-item conversion."""
    n = len(values)
    offsets = np.zeros(n + 1, dtype=np.int64)
    np.cumsum(np.fromiter(map(len, values), dtype=np.int64, count=n), out=offsets[1:])
    data = b"".join(values)
    if offsets[-1] < 2**31:
        arr = pa.Array.from_buffers(pa.binary(), n, [None, pa.py_buffer(offsets.astype(np.int32)),
                                                    pa.py_buffer(data)])
    else:
        arr = pa.Array.from_buffers(pa.large_binary(), n, [None, pa.py_buffer(offsets),
                                                          pa.py_buffer(data)]).cast(pa.binary())
    return arr if typ == pa.binary() else arr.cast(typ)


def _with_nulls(arr: pa.Array, null_idx: list[int]) -> pa.Array:
    if not null_idx:
        return arr
    mask = np.zeros(len(arr), dtype=bool)
    mask[null_idx] = True
    return pc.if_else(pa.array(mask), pa.scalar(None, arr.type), arr)


def _dict(values: list, n: int) -> pa.Array:
    """Dictionary<int32, string> from bytes/str/None values (few distinct ones)."""
    uniq = [v for v in set(values) if v is not None]
    d: dict = {v: i for i, v in enumerate(uniq)}
    d[None] = -1
    idx = np.array(list(map(d.__getitem__, values)), dtype=np.int32)
    words = pa.array([k.decode("utf-8", "replace") if isinstance(k, bytes) else k for k in uniq],
                     pa.string())
    mask = idx < 0
    indices = pa.array(idx, mask=mask) if mask.any() else pa.array(idx)
    return pa.DictionaryArray.from_arrays(indices, words)


def _const_dict(value: str | None, n: int) -> pa.Array:
    if value is None:
        return pa.nulls(n, _TYPES["direction"])
    return pa.DictionaryArray.from_arrays(pa.array(np.zeros(n, dtype=np.int32)),
                                          pa.array([value], pa.string()))


def _position_columns(n: int, frame_no: int, conn: int, ts_ns: int, mono_ns: int, direction: str,
                      node: str | None = None):
    """frame_no, conn, node, ts, mono_ns and direction of n lines read (or sent) at one instant."""
    return [pa.array(np.arange(frame_no, frame_no + n, dtype=np.int64)),
            pa.array(np.full(n, conn, dtype=np.int32)),
            _const_dict(node, n),
            pa.array(np.full(n, ts_ns, dtype=np.int64)).cast(_TYPES["ts"]),
            pa.array(np.full(n, mono_ns, dtype=np.int64)),
            _const_dict(direction, n)]


def _parse_other(line: bytes) -> dict:
    """Columns of one non-fast-path line."""
    try:
        text = line.decode("utf-8")
    except UnicodeDecodeError as exc:
        first = line.split(b" ", 1)[0]
        return {"command": first.decode("ascii") if first.isascii() and first else None,
                "decode_error": f"invalid UTF-8 at byte {exc.start}"}
    word, rest = C.split_word(text)
    out: dict = {"command": word if text else None}
    try:
        cmd = C.parse_line(text)
    except RemoteError as exc:
        out["args"] = rest
        out["decode_error"] = exc.message
        return out
    if isinstance(cmd, C.Rdata):
        out.update(stream=cmd.stream, instance=cmd.instance, token=cmd.token,
                   batch=cmd.token is None, row=cmd.row_json)
    elif isinstance(cmd, C.Position):
        out.update(stream=cmd.stream, instance=cmd.instance, prev_token=cmd.prev_token,
                   new_token=cmd.new_token)
    else:
        out["args"] = rest
    return out


def build_batch(lines: list[bytes], *, frame_no: int, conn: int, ts_ns: int, mono_ns: int,
                direction: str = "in", channel: str | None = None,
                split: SplitLines | None = None, node: str | None = None,
                errors: dict[int, str] | None = None) -> pa.RecordBatch:
    """``lines`` (without newlines) -> RecordBatch; frame_no counts up from ``frame_no``.
    ``split`` is ``split_lines(lines)`` when the caller already has it; ``errors`` gives a
    decode_error for some lines (framing problems the caller saw: an over-long line, a
    last line without newline)."""
    n = len(lines)
    if n == 0:
        return _empty()
    if split is None:
        split = split_lines(lines)
    slow = set(split.slow)
    if errors:
        slow.update(errors)
    raw = _binary(lines)
    try:
        raw.cast(pa.string())  # validates UTF-8 for the whole batch in one pass
    except pa.ArrowInvalid:
        slow.update(i for i, line in enumerate(lines) if not _is_utf8(line))
    tokens = split.tokens if not slow else list(split.tokens)
    rows = split.rows()
    # bytes from the fast path; a slow line's own (text or None) replace them below
    streams: list[Any] = split.streams()
    instances: list[Any] = split.instances()

    extras: dict[int, dict] = {}
    if slow:
        raw_values = list(lines)
        for i in sorted(slow):
            line = lines[i]
            if line[:8] == b"USER_IP ":
                line = raw_values[i] = C.redact_user_ip(line)
            e = extras[i] = _parse_other(line)
            streams[i] = e.get("stream")
            instances[i] = e.get("instance")
            tokens[i] = e.get("token")
            row = e.get("row")
            rows[i] = row.encode("utf-8") if row is not None else b""
            if errors and i in errors:
                e["decode_error"] = errors[i]
        if raw_values != lines:
            raw = _binary(raw_values)
    rows_arr = _binary(rows, pa.string())

    if not extras:
        command = _const_dict("RDATA", n)
        batch = pa.array([t is None for t in tokens], pa.bool_())
        prev_token = new_token = pa.nulls(n, pa.int64())
        args = decode_error = pa.nulls(n, pa.string())
    else:
        rows_arr = _with_nulls(rows_arr, [i for i, e in extras.items() if e.get("row") is None])
        words: list = ["RDATA"] * n
        is_batch: list = [t is None for t in tokens]
        prev: list = [None] * n
        new: list = [None] * n
        args_v: list = [None] * n
        err: list = [None] * n
        for i, e in extras.items():
            words[i] = e.get("command")
            is_batch[i] = e.get("batch")
            prev[i] = e.get("prev_token")
            new[i] = e.get("new_token")
            args_v[i] = e.get("args")
            err[i] = e.get("decode_error")
        command = _dict(words, n)
        batch = pa.array(is_batch, pa.bool_())
        prev_token = pa.array(prev, pa.int64())
        new_token = pa.array(new, pa.int64())
        args = pa.array(args_v, pa.string())
        decode_error = pa.array(err, pa.string())

    cols = [
        *_position_columns(n, frame_no, conn, ts_ns, mono_ns, direction, node),
        raw,
        decode_error,
        _const_dict(channel, n),
        command,
        _dict(streams, n),
        _dict(instances, n),
        pa.array(tokens, pa.int64()),
        batch,
        prev_token,
        new_token,
        rows_arr,
        args,
    ]
    return pa.RecordBatch.from_arrays(cols, schema=BATCH_SCHEMA)


def _empty() -> pa.RecordBatch:
    return pa.RecordBatch.from_arrays([pa.array([], f.type) for f in BATCH_SCHEMA],
                                      schema=BATCH_SCHEMA)


def _is_utf8(b: bytes) -> bool:
    try:
        b.decode("utf-8")
        return True
    except UnicodeDecodeError:
        return False


def _views(arr: np.ndarray, buf_obj, starts: np.ndarray, lens: np.ndarray, typ) -> pa.Array:
    """A binary_view/string_view array of (start, length) slices of one buffer, built with
    numpy: no Python object per slice."""
    n = len(starts)
    v = np.zeros((n, 16), np.uint8)
    v32 = v.view(np.int32).reshape(n, 4)
    v32[:, 0] = lens
    last = max(len(arr) - 1, 0)
    short = lens <= 12
    if short.any():
        j = np.arange(12)
        ss, sl = starts[short], lens[short]
        v[short, 4:16] = np.where(j[None, :] < sl[:, None],
                                  arr[np.minimum(ss[:, None] + j[None, :], last)], 0)
    long_ = ~short
    ls = starts[long_]
    j4 = np.arange(4)
    v[long_, 4:8] = arr[np.minimum(ls[:, None] + j4[None, :], last)]
    v32[long_, 3] = ls
    return pa.Array.from_buffers(typ, n, [None, pa.py_buffer(v), buf_obj])


def build_batch_scan(scan, *, frame_no: int, conn: int, ts_ns: int, mono_ns: int,
                     direction: str = "in", channel: str | None = None,
                     node: str | None = None) -> pa.RecordBatch:
    """Like ``build_batch`` for a bulk.Scan block. A block of only well-formed RDATA lines
    is built from numpy offsets into the receive buffer (views, then one C++ copy per
    column); anything else goes through ``build_batch``."""
    n = scan.n
    if n == 0:
        return _empty()
    if not scan.all_fast:
        return build_batch(scan.lines(), frame_no=frame_no, conn=conn, ts_ns=ts_ns,
                           mono_ns=mono_ns, direction=direction, channel=channel, node=node)
    buf_obj = pa.py_buffer(scan.buf)
    lens = scan.ends - scan.starts
    raw_v = _views(scan.arr, buf_obj, scan.starts, lens, pa.binary_view())
    try:
        raw_v.cast(pa.string_view())  # UTF-8 validation of the whole block
        row_start = scan.s4 + 1
        rows = _views(scan.arr, buf_obj, row_start, scan.ends - row_start, pa.string_view())
        rows = rows.cast(pa.string())
    except pa.ArrowInvalid:
        return build_batch(scan.lines(), frame_no=frame_no, conn=conn, ts_ns=ts_ns,
                           mono_ns=mono_ns, direction=direction, channel=channel, node=node)
    raw = raw_v.cast(pa.binary())
    # stream / instance dictionaries from the scan's key dictionary
    streams: dict[bytes, int] = {}
    insts: dict[bytes, int] = {}
    k_stream = np.array([streams.setdefault(s, len(streams)) for s, _ in scan.keys], np.int32)
    k_inst = np.array([insts.setdefault(i, len(insts)) for _, i in scan.keys], np.int32)
    stream = pa.DictionaryArray.from_arrays(
        pa.array(k_stream[scan.inv]), pa.array([s.decode() for s in streams], pa.string()))
    instance = pa.DictionaryArray.from_arrays(
        pa.array(k_inst[scan.inv]), pa.array([s.decode() for s in insts], pa.string()))
    is_batch = scan.is_batch
    cols = [
        *_position_columns(n, frame_no, conn, ts_ns, mono_ns, direction, node),
        raw,
        pa.nulls(n, pa.string()),
        _const_dict(channel, n),
        _const_dict("RDATA", n),
        stream,
        instance,
        pa.array(scan.tokens, mask=is_batch),
        pa.array(is_batch),
        pa.nulls(n, pa.int64()),
        pa.nulls(n, pa.int64()),
        rows,
        pa.nulls(n, pa.string()),
    ]
    return pa.RecordBatch.from_arrays(cols, schema=BATCH_SCHEMA)
