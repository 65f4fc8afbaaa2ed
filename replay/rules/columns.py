"""Column helpers the replay engines share: Arrow columns as numpy (nulls filled), strings
out of dictionaries, timestamps as int64 nanoseconds and back, masks by string value through
the dictionary codes (one comparison per distinct value, not per row), and growable numpy
arrays for per-key state; and `ordered_frames`, the capture read in replay order with the
`_seq` and `_conn` columns every rule orders and groups by."""

from __future__ import annotations

from typing import Iterator

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from dcptool.replay.rules import tables as T
from dcptool.replay.store import reader

NONE_TS = np.iinfo(np.int64).max
# rows per chunk of a pass: small enough to stay in cache and bound memory
# (measured 1M frames: 1M-row chunks 2.2 s / 886 MB, 256k-row chunks 1.5 s / 697 MB)
CHUNK_ROWS = 1 << 18


def as_numpy(col, fill=None, dtype=None) -> np.ndarray:
    """A column as numpy (nulls replaced by `fill`)."""
    if isinstance(col, pa.ChunkedArray):
        col = col.combine_chunks()
    if fill is not None and col.null_count:
        col = pc.fill_null(col, fill)
    arr = col.to_numpy(zero_copy_only=False)
    return arr.astype(dtype, copy=False) if dtype is not None else arr


def as_strings(col) -> pa.Array:
    if isinstance(col, pa.ChunkedArray):
        col = col.combine_chunks()
    return col.cast(pa.string()) if pa.types.is_dictionary(col.type) else col




def ts_ns(col) -> np.ndarray:
    return as_numpy(col.cast(pa.int64()) if not isinstance(col, pa.ChunkedArray) else col.cast(pa.int64()),
               fill=NONE_TS, dtype=np.int64)


def ts_array(values: np.ndarray, valid: np.ndarray | None = None) -> pa.Array:
    mask = None if valid is None else ~valid
    return pa.array(values.astype(np.int64), pa.int64(), mask=mask).cast(T.TS)


def dict_codes(col) -> tuple[np.ndarray, list]:
    """A string column as (dictionary codes, -1 for null; the dictionary as a list)."""
    if isinstance(col, pa.ChunkedArray):
        col = col.combine_chunks() if col.num_chunks != 1 else col.chunk(0)
    if not pa.types.is_dictionary(col.type):
        col = pc.dictionary_encode(col)
    return as_numpy(col.indices, fill=-1, dtype=np.int64), col.dictionary.to_pylist()


def lookup_codes(col, *sets) -> list[np.ndarray]:
    """One mask per set of strings: rows whose value is in the set (null is in none)."""
    codes, words = dict_codes(col)
    masks = []
    for values in sets:
        lut = np.zeros(len(words) + 1, bool)   # the extra last slot is code -1 (null)
        lut[:len(words)] = [w in values for w in words]
        masks.append(lut[codes])
    return masks


def equals(col, value) -> np.ndarray:
    return lookup_codes(col, {value})[0]


def is_in(col, values) -> np.ndarray:
    return lookup_codes(col, set(values))[0]


class Grow:
    """numpy arrays that grow at the end (amortised). Attributes are the whole arrays, to
    read and write in place by index; `view(name)` is the filled part."""

    def __init__(self, **fills):
        self.n = 0
        self._fills = fills
        self._a = {k: np.full(16, fill, dtype) for k, (dtype, fill) in fills.items()}

    def extend(self, count: int, **values) -> None:
        need = self.n + count
        cap = len(next(iter(self._a.values())))
        if need > cap:
            for k, (dtype, fill) in self._fills.items():
                a = np.full(max(need, 2 * cap), fill, dtype)
                a[:self.n] = self._a[k][:self.n]
                self._a[k] = a
        for k, v in values.items():
            self._a[k][self.n:need] = v
        self.n = need

    def __getattr__(self, name):
        try:
            return self.__dict__["_a"][name]
        except KeyError:
            raise AttributeError(name) from None

    def view(self, name) -> np.ndarray:
        return self._a[name][:self.n]


def ordered_frames(files, columns: list[str], ranks: dict[str, int],
                   batch_rows: int = CHUNK_ROWS) -> Iterator[pa.Table]:
    """Tables of `columns` in frame order, with `_seq` (position in the replay) and
    `_conn` (capture rank << 32 | conn) when `conn` is asked for."""
    pos = 0
    # one thread per Parquet file: the engine's own threads already use the cores
    for t in reader.iter_capture_tables(files, columns, batch_rows=batch_rows, threads=False):
        n = t.num_rows
        t = t.append_column("_seq", pa.array(np.arange(pos, pos + n, dtype=np.int64)))
        pos += n
        if "conn" in columns:
            cid = as_strings(t.column("capture_id"))
            rank = as_numpy(pc.index_in(cid, value_set=pa.array(list(ranks), pa.string())), fill=0,
                       dtype=np.int64)
            t = t.append_column("_conn", pa.array((rank << 32) | as_numpy(t.column("conn"), fill=0, dtype=np.int64)))
        yield t
