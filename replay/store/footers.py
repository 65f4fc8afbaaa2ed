"""Parquet footers of finished segments, parsed once per process and file version, so that
every later look at a segment (its metadata, row counts, statistics, the read of its rows)
reuses the parsed footer; parsed on a few threads when there are many (in_threads)."""

from __future__ import annotations

import os

import pyarrow as pa
import pyarrow.parquet as pq

from dcptool.replay.store.files import arrow_source


_FOOTERS: dict[tuple, "pq.FileMetaData"] = {}     # (path, size, mtime_ns) -> footer
PARSED: list[int] = [0]      # footers parsed by this process (tests count them)


def footer(path: str) -> "pq.FileMetaData":
    """The Parquet footer of a finished segment, read once per version of the file (every
    later look at it, row counts, row groups, statistics, reads, reuses it)."""
    st = os.stat(path)
    key = (path, st.st_size, st.st_mtime_ns)
    md = _FOOTERS.get(key)
    if md is None:
        md = _FOOTERS[key] = pq.read_metadata(arrow_source(path))
        PARSED[0] += 1
    return md


def forget() -> None:
    """Drop the parsed footers (tests: the next look at each file parses it again)."""
    _FOOTERS.clear()


def prefetch_footers(paths: list[str]) -> None:
    """Read the footers of many finished segments on a few threads (pyarrow parses them
    without the GIL); errors are left for describe() to report."""
    todo = list(paths)
    if len(todo) < 64:
        return

    def one(path: str) -> None:
        try:
            footer(path)
        except (OSError, pa.ArrowException, ValueError):
            pass
    in_threads(one, todo)


THREADS = min(4, (os.cpu_count() or 2) * 2)


def in_threads(fn, items: list) -> list:
    """[fn(x) for x in items], on THREADS threads for a long list: each thread takes one slice
    of the list (a future per item would cost more Python than pyarrow's work on a small
    file). The first error raised is raised here."""
    if len(items) < 64:
        return [fn(x) for x in items]
    import concurrent.futures
    step = -(-len(items) // THREADS)
    with concurrent.futures.ThreadPoolExecutor(max_workers=THREADS) as pool:
        parts = pool.map(lambda i: [fn(x) for x in items[i:i + step]], range(0, len(items), step))
        return [y for part in parts for y in part]


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


_TOP: dict[tuple, frozenset] = {}


def top_names(md: "pq.FileMetaData") -> frozenset:
    """The top-level column names of a footer's schema (what `schema_arrow.names` lists),
    worked out once per layout: segments of one capture share theirs."""
    key = tuple(md.schema.names)          # the leaves, in order: ~0.02 ms a footer
    names = _TOP.get(key)
    if names is None:
        names = _TOP[key] = frozenset(md.schema.to_arrow_schema().names)
    return names
