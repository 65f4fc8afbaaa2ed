"""The key index of a finished segment: a Parquet Bloom filter (the format's split-block
filter, XXH64 of the key bytes) on the `key` column of every row group, sized for about 1%
false positives at the row group's row count. The capture writer asks for it when it opens a
segment's Parquet file (segment.parquet_writer); pyarrow writes the filters when the file is
finished, next to the column chunks, and the footer holds where each one is. Readers that
look for a few keys (`dcptool trace`; Spark's own Parquet reader pushes `key = ...` down
onto the same filters) read the footer, then one small filter per row group, and only the
row groups whose filter may hold a key. A segment written before the index (or by another
writer) has no filter: `row_groups_for` says so with None and the caller reads everything.
CAPTURE_FORMAT.md ("Key index") is the contract."""

from __future__ import annotations

import struct

import pyarrow as pa

KEY_COLUMN = "key"
KEY_FPP = 0.01
# a filter per row group costs ~1.2 bytes per distinct key at 1%: bounded by the row count a
# row group of this segment can reach (ROW_GROUP_ROWS, or fewer for large frames)
MIN_NDV = 1024
MAX_FILTER_BYTES = 4 << 20     # never trust a footer past this (a damaged file reads whole)

_P1, _P2, _P3, _P4, _P5 = (0x9E3779B185EBCA87, 0xC2B2AE3D27D4EB4F, 0x165667B19E3779F9,
                           0x85EBCA77C2B2AE63, 0x27D4EB2F165667C5)
_M64 = (1 << 64) - 1
_SALT = (0x47B6137B, 0x44974D91, 0x8824AD5B, 0xA2B7289D, 0x705495C7, 0x2DF1424B, 0x9EFC4947, 0x5C6BFB31)


def bloom_options(schema: pa.Schema, first: pa.Table, row_group_bytes: int, row_group_rows: int) -> dict | None:
    """The `bloom_filter_options` of a segment whose first row group is `first`: the key
    column's filter sized for the rows a row group of frames this size can hold."""
    if KEY_COLUMN not in schema.names:
        return None
    per_row = max(1, first.nbytes // max(1, first.num_rows))
    ndv = max(MIN_NDV, min(row_group_rows, row_group_bytes // per_row))
    return {KEY_COLUMN: {"ndv": int(ndv), "fpp": KEY_FPP}}


def _rotl(x: int, r: int) -> int:
    return ((x << r) | (x >> (64 - r))) & _M64


def _round(acc: int, lane: int) -> int:
    return (_rotl((acc + lane * _P2) & _M64, 31) * _P1) & _M64


def xxh64(data: bytes, seed: int = 0) -> int:
    """XXH64 of `data`: the hash of Parquet's Bloom filters (one key at a time, so plain Python)."""
    n, i = len(data), 0
    if n >= 32:
        v = [(seed + _P1 + _P2) & _M64, (seed + _P2) & _M64, seed, (seed - _P1) & _M64]
        while i + 32 <= n:
            lanes = struct.unpack_from("<4Q", data, i)
            v = [_round(a, b) for a, b in zip(v, lanes)]
            i += 32
        h = (_rotl(v[0], 1) + _rotl(v[1], 7) + _rotl(v[2], 12) + _rotl(v[3], 18)) & _M64
        for a in v:
            h = (((h ^ _round(0, a)) * _P1) + _P4) & _M64
    else:
        h = (seed + _P5) & _M64
    h = (h + n) & _M64
    while i + 8 <= n:
        h = ((_rotl(h ^ _round(0, struct.unpack_from("<Q", data, i)[0]), 27) * _P1) + _P4) & _M64
        i += 8
    if i + 4 <= n:
        h = ((_rotl(h ^ ((struct.unpack_from("<I", data, i)[0] * _P1) & _M64), 23) * _P2) + _P3) & _M64
        i += 4
    while i < n:
        h = (_rotl(h ^ ((data[i] * _P5) & _M64), 11) * _P1) & _M64
        i += 1
    h ^= h >> 33
    h = (h * _P2) & _M64
    h ^= h >> 29
    h = (h * _P3) & _M64
    return h ^ (h >> 32)


def _num_bytes(header: bytes) -> int | None:
    """numBytes, field 1 of the Thrift (compact) BloomFilterHeader, or None."""
    if not header or header[0] != 0x15:     # field 1, type i32
        return None
    value, shift = 0, 0
    for b in header[1:6]:
        value |= (b & 0x7F) << shift
        shift += 7
        if not b & 0x80:
            return (value >> 1) ^ -(value & 1)
    return None


def filter_holds(bitset: bytes, h: int) -> bool:
    """The split-block Bloom filter check of hash `h` (parquet-format BloomFilter.md)."""
    blocks = len(bitset) // 32
    block = ((h >> 32) * blocks) >> 32
    words = struct.unpack_from("<8I", bitset, block * 32)
    key = h & 0xFFFFFFFF
    return all(w >> (((key * s) & 0xFFFFFFFF) >> 27) & 1 for w, s in zip(words, _SALT))


def read_filter(fh, offset: int | None, length: int | None) -> bytes | None:
    """The bitset of one column chunk's filter, or None (no filter, or one not understood)."""
    if offset is None or length is None or not 0 < length <= MAX_FILTER_BYTES:
        return None
    fh.seek(offset)
    data = fh.read(length)
    size = _num_bytes(data[:8])
    if size is None or size <= 0 or size % 32 or size > len(data):
        return None
    return data[len(data) - size:]


def row_groups_for(path, md, keys: list[bytes], vbuckets: set[int] | None = None) -> list[int] | None:
    """The row groups of a finished segment (footer `md`) that may hold one of `keys`: those
    whose key filter may hold one, and (with `vbuckets`) whose vbucket statistics take one
    in. None when the segment has no key index (the caller reads every row group)."""
    from dcptool.replay.store.footers import leaf_index
    ki, vi = leaf_index(md, KEY_COLUMN), leaf_index(md, "vbucket")
    if ki is None or md.num_row_groups == 0:
        return None
    hashes = [xxh64(k) for k in keys]
    out: list[int] = []
    with open(path, "rb", buffering=0) as fh:
        for rg in range(md.num_row_groups):
            group = md.row_group(rg)
            if group.num_rows == 0:
                continue
            if vbuckets and vi is not None and not _vbucket_may(group.column(vi), vbuckets):
                continue
            chunk = group.column(ki)
            if chunk.statistics is not None and chunk.statistics.null_count == group.num_rows:
                continue            # control frames only: no key at all
            bits = read_filter(fh, chunk.bloom_filter_offset, chunk.bloom_filter_length)
            if bits is None:
                return None         # a row group without a filter: this segment has no index
            if any(filter_holds(bits, h) for h in hashes):
                out.append(rg)
    return out


def _vbucket_may(chunk, vbuckets: set[int]) -> bool:
    st = chunk.statistics
    if st is None or not st.has_min_max:
        return True
    return any(st.min <= v <= st.max for v in vbuckets)


def has_index(md) -> bool:
    """Whether every row group of a finished segment carries a key filter."""
    from dcptool.replay.store.footers import leaf_index
    ki = leaf_index(md, KEY_COLUMN)
    return ki is not None and md.num_row_groups > 0 and all(
        md.row_group(rg).column(ki).bloom_filter_offset is not None for rg in range(md.num_row_groups))
