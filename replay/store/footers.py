"""Parquet footers of finished segments, parsed once per process and file version: as
dataset fragments, so that a scan of many small segments (reader.read_segments) reuses the
parsed footer instead of parsing it again (most of what a small segment costs); read on a
few threads when there are many."""

from __future__ import annotations

import os

import pyarrow as pa
import pyarrow.parquet as pq

from dcptool.replay.store.files import arrow_path, arrow_source


_FOOTERS: dict[tuple, tuple] = {}     # (path, size, mtime_ns) -> (footer, dataset fragment or None)


def footer_entry(path: str) -> tuple:
    """(footer, dataset fragment or None for a name pyarrow cannot encode) of a segment."""
    st = os.stat(path)
    key = (path, st.st_size, st.st_mtime_ns)
    entry = _FOOTERS.get(key)
    if entry is None:
        if isinstance(arrow_path(path), str):
            # a dataset fragment keeps the footer it parsed: scans of it (read_segments) reuse
            # it instead of parsing it again, which is most of the cost of a small segment
            import pyarrow.dataset as ds
            import pyarrow.fs as pafs
            frag = ds.ParquetFileFormat().make_fragment(path, filesystem=pafs.LocalFileSystem())
            frag.ensure_complete_metadata()
            entry = (frag.metadata, frag)
        else:
            entry = (pq.read_metadata(arrow_source(path)), None)
        _FOOTERS[key] = entry
    return entry


def footer(path: str) -> "pq.FileMetaData":
    """The Parquet footer of a finished segment, read once per version of the file (every
    later look at it, row counts, row groups, statistics, scans, reuses it)."""
    return footer_entry(path)[0]


def prefetch_footers(paths: list[str]) -> None:
    """Read the footers of many finished segments on a few threads (pyarrow parses them
    without the GIL); errors are left for describe() to report."""
    todo = list(paths)
    if len(todo) < 64:
        return
    import concurrent.futures

    def one(path: str) -> None:
        try:
            footer_entry(path)
        except (OSError, pa.ArrowException, ValueError):
            pass
    with concurrent.futures.ThreadPoolExecutor(max_workers=min(8, (os.cpu_count() or 2) * 2)) as pool:
        list(pool.map(one, todo, chunksize=64))


_LEAVES: dict[tuple, dict[str, int]] = {}


def leaf_index(md: "pq.FileMetaData", name: str) -> int | None:
    """The Parquet column index of top-level leaf `name` in a footer, or None. Segments of one
    capture share their layout: the names are listed once per layout, not once per file."""
    n = md.num_columns
    if not n:
        return None
    key = (n, md.schema.column(0).path, md.schema.column(n - 1).path)
    names = _LEAVES.get(key)
    if names is None:
        names = _LEAVES[key] = {md.schema.column(i).path: i for i in range(n)}
    i = names.get(name)
    if i is not None and md.schema.column(i).path != name:    # another layout with that key
        i = next((j for j in range(n) if md.schema.column(j).path == name), None)
    return i
