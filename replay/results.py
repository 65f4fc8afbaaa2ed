"""Replay's result tables as a command shows them, without the CLI: which tables a request
names (table_choice), rows as dicts in chunks with timestamps and DCP keys/values as the
output contract says (table_rows, display_columns), the checksum lines (checksum_lines), the
Parquet files of `-o DIR` (write_tables; write_files, where DuckDB writes the plan tables
itself) and whether a directory may take them
(is_capture_dir), and why a path cannot be an output directory at all
(output_dir_problem). `dcptool replay` (cli/replay.py) parses options, calls these and prints."""

from __future__ import annotations

import contextlib
import os
import stat

_TS_FACTOR = {"s": 1_000_000_000, "ms": 1_000_000, "us": 1_000, "ns": 1}


def table_choice(protocol: str, requested: tuple[str, ...], default_all: bool) -> list[str]:
    """The tables `--table` names (repeatable, comma lists, `all`); none named: every table
    but frames (default_all) or the first. ValueError for a name the protocol has not."""
    from dcptool.replay.rules.table_types import TABLE_NAMES
    if protocol not in TABLE_NAMES:
        raise ValueError(f"unknown protocol {protocol!r}")
    names = list(TABLE_NAMES[protocol])
    wanted = [n.strip() for r in requested for n in r.split(",") if n.strip()]
    if not wanted:
        return [n for n in names if n != "frames"] if default_all else [names[0]]
    if wanted == ["all"]:
        return names
    bad = [w for w in wanted if w not in names]
    if bad:
        raise ValueError(f"unknown table {bad[0]!r} for {protocol} captures; "
                         f"choose from {', '.join(names)} or all")
    return wanted


def _binary_columns(table) -> set:
    import pyarrow as pa
    return {f.name for f in table.schema if pa.types.is_binary(f.type) or pa.types.is_large_binary(f.type)}


def table_rows(table, chunk: int = 4096):
    """Rows as dicts, one list per chunk of rows: timestamps as RFC 3339 UTC with 9 fraction
    digits (replay/timestamps.py iso_ns); a binary `key` as text (`key_base64` when not UTF-8)
    and a binary `value` as the output contract says (replay/display.py dcp_display; the bodies
    of `documents` and `history`: display.body_display, a JSON body as JSON)."""
    import pyarrow as pa

    from dcptool.replay.display import body_display, dcp_display
    from dcptool.replay.timestamps import iso_ns
    schema = table.schema
    ts = {f.name: _TS_FACTOR[f.type.unit] for f in schema if pa.types.is_timestamp(f.type)}
    binary = _binary_columns(table)
    display = "key" in binary or "value" in binary
    names = table.column_names
    bodies = "value_json" in names      # documents, history: bodies cut already
    for batch in table.to_batches(max_chunksize=chunk):
        cols = []
        for i, name in enumerate(names):
            col = batch.column(i)
            if name in ts:
                f = ts[name]
                cols.append([None if v is None else iso_ns(v * f) for v in col.cast(pa.int64()).to_pylist()])
            else:
                cols.append(col.to_pylist())
        rows = [dict(zip(names, vals)) for vals in zip(*cols)]
        if bodies:
            rows = [body_display(r) for r in rows]
        if display:
            rows = [dcp_display(r) for r in rows]
        yield rows


def display_columns(table) -> list[str]:
    """Table columns as printed: key_base64 after key, value_base64 / value_error after value."""
    from dcptool.replay.display import VALUE_COLUMNS, with_key_base64
    cols = list(table.column_names)
    binary = _binary_columns(table)
    if "key" in binary:
        cols = with_key_base64(cols)
    if "value" in binary:
        at = cols.index("value")
        cols[at:at + 1] = VALUE_COLUMNS
    if "value_json" in cols:     # shown as `value` (display.body_display)
        cols.remove("value_json")
    return cols


def checksum_lines(sums: dict, fmt: str | None):
    """`--checksum`: one line per table, `SHA256  NAME` or (jsonl) {table, sha256, rows};
    `sums`: name -> (checksum, rows), as write_tables fills it."""
    import orjson
    for name, (digest, rows) in sums.items():
        if fmt == "jsonl":
            yield orjson.dumps({"table": name, "sha256": digest, "rows": rows}).decode() + "\n"
        else:
            yield f"{digest}  {name}\n"


def write_tables(out_dir: str | None, chosen: dict, sums: dict | None = None, content: bool = False):
    """Each table to out_dir/NAME.parquet (zstd; out_dir made; None: no files); yields (path,
    rows) per file. `sums`: filled in the same pass with name -> (checksum, rows), the content
    checksum (tables.ContentChecksum: provenance columns left out) when `content`. A table
    given as record batches (tables.Batches: DuckDB's sorted result as it streams) is written
    one row group per batch and checksummed batch by batch, never whole in memory; a partial
    file is removed when the stream fails."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    from dcptool.replay.rules import tables as T
    if out_dir:
        os.makedirs(out_dir, exist_ok=True)
    for name, table in chosen.items():
        path = os.path.join(out_dir, f"{name}.parquet") if out_dir else None
        if isinstance(table, pa.Table):
            if path:
                pq.write_table(table, path, compression="zstd")
            if sums is not None:
                sums[name] = (T.content_checksum(name, table) if content else T.checksum(name, table),
                              table.num_rows)
            rows = table.num_rows
        else:
            kind = T.ContentChecksum if content else T.Checksum
            digest = kind(name, table.schema) if sums is not None else None
            rows = 0
            try:
                with pq.ParquetWriter(path, table.schema, compression="zstd") if path else contextlib.nullcontext() as w:
                    for batch in table.batches:
                        if w is not None:
                            w.write_batch(batch)
                        if digest is not None:
                            digest.update(batch)
                        rows += batch.num_rows
            except BaseException:
                if path and os.path.exists(path):
                    os.remove(path)
                raise
            if digest is not None and sums is not None:      # (digest is None without sums)
                sums[name] = (digest.hexdigest(), rows)
        if path:
            yield path, rows


def duckdb_writes(files: list, names: list[str], out_dir: str | None) -> list[str]:
    """The tables of `names` that DuckDB writes to `-o DIR` itself (write_files; REPLAY.md
    "Running a replay"), for an in-process replay that writes files only (no --sql,
    --checksum, --format: the caller checks those): the DCP plan tables
    (replay/rules/plans.py), but `documents` when `vbuckets` is asked too (its counts come
    from that table, built in memory), and none when DIR is no UTF-8 path (DuckDB's kind)."""
    if not out_dir or not files or files[0].protocol != "dcp":
        return []
    try:
        os.fsencode(os.path.abspath(out_dir)).decode("utf-8")
    except UnicodeError:
        return []
    from dcptool.replay.rules.plans import PLAN_TABLES
    return [n for n in names if n in PLAN_TABLES and not (n == "documents" and "vbuckets" in names)]


def write_files(files: list, names: list[str], out_dir: str, as_of=None):
    """`-o DIR` of an in-process DCP replay: each table of `names` to DIR/NAME.parquet, in that
    order, yielding (path, rows) per file. The tables of duckdb_writes are written by DuckDB
    itself (replay/local/duck.py DuckFrames.write: neither pyarrow nor numpy is loaded for
    them), the others as write_tables writes them; the files read back the same either way."""
    from dcptool.replay.local import duck
    direct = duckdb_writes(files, names, out_dir)
    paths = {n: os.path.join(out_dir, f"{n}.parquet") for n in direct}
    rep = frames = None
    try:
        frames = duck.DuckFrames(files, as_of, duck.doc_budget(),
                                 outputs=tuple(os.path.abspath(p) for p in paths.values()))
        os.makedirs(out_dir, exist_ok=True)     # once the capture is found readable, as write_tables
        for name in names:
            if name in paths:
                yield paths[name], frames.write(name, os.path.abspath(paths[name]))
                continue
            if rep is None:
                from dcptool.replay.local import engine as local
                rep = local.replay_local(files, tables=[n for n in names if n not in paths], as_of=as_of,
                                         stream=True)
            yield from write_tables(out_dir, {name: rep.stream(name)})
    finally:
        for done in (frames, rep):
            if done is not None:
                done.close()


def is_capture_dir(out_dir: str, captures) -> bool:
    """Whether out_dir is the directory of a CAPTURE given or holds capture segments: results
    never go there (they would be read as a foreign file of the capture). A directory below a
    capture directory is fine (captures are not recursive)."""
    from dcptool.replay.store.discovery import holds_segments
    real = os.path.realpath(out_dir)
    inputs = [c for c in captures if c != "-"]
    dirs = {os.path.realpath(c if os.path.isdir(c) else os.path.dirname(c) or ".") for c in inputs}
    return real in dirs or holds_segments(real)


def output_dir_problem(path: str) -> str | None:
    """Why `path` cannot be an output directory, or None."""
    probe = os.path.abspath(path)
    while True:
        try:
            st = os.stat(probe)
        except (FileNotFoundError, NotADirectoryError):
            parent = os.path.dirname(probe)
            if parent == probe:
                return None
            probe = parent
            continue
        except OSError as exc:   # a symlink loop, no permission ...
            import errno
            why = "a symlink loop" if exc.errno == errno.ELOOP else exc.strerror
            return f"{path}: not a directory ({why})"
        if stat.S_ISDIR(st.st_mode):
            return None
        if probe == os.path.abspath(path):
            return f"{path}: not a directory"
        return f"{path}: not a directory ({probe} is not one)"
