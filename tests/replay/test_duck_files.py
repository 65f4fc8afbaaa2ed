"""`replay -o DIR` where DuckDB writes the plan tables itself (replay/local/duck.py
DuckFrames.write, replay/results.py write_files): the files read back by pyarrow equal the ones
pyarrow writes (schema, nullability, rows, order) for every plan table, with and without
`--as-of`, empty or not, over captures with rollbacks, durable writes and a collection drop,
several segments and captures; a failed query leaves no file. And the small footer reader of
replay/store/footers.py against pyarrow's, on real segments and on hostile bytes."""

from __future__ import annotations

import os
import random

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from dcptool.replay import results
from dcptool.replay.local import duck
from dcptool.replay.local import engine as local
from dcptool.replay.rules import tables as T
from dcptool.replay.rules.as_of import AsOf
from dcptool.replay.rules.table_types import PLAN_COLUMNS, PLAN_KEYS, TABLE_NAMES
from dcptool.replay.store import discovery, footers, reader
from tests.support import capgen

DUCK_TYPES = {pa.uint8(): "UTINYINT", pa.uint16(): "USMALLINT", pa.uint32(): "UINTEGER", pa.uint64(): "UBIGINT",
              pa.int32(): "INTEGER", pa.int64(): "BIGINT", pa.binary(): "BLOB", pa.string(): "VARCHAR",
              pa.bool_(): "BOOLEAN", pa.timestamp("ns", tz="UTC"): "TIMESTAMPTZ_NS"}


@pytest.fixture(scope="module")
def caps(tmp_path_factory):
    """Two capture directories: seeded runs with rollbacks, several captures and segments,
    durable writes and a collection drop; the second ends in a segment in progress."""
    out = []
    for seed, in_progress in ((29, False), (31, True)):
        d = tmp_path_factory.mktemp("duckfiles") / f"caps-{seed}"
        captures = capgen.with_sync_and_drop(capgen.generate("dcp", seed, n_events=300, max_captures=3), seed)
        capgen.write_captures(captures, str(d), seed=seed, in_progress_last=in_progress)
        out.append(str(d))
    return out


def test_the_duckdb_types_are_the_canonical_schemas():
    assert set(PLAN_COLUMNS) == set(local.PLAN_TABLES) == set(PLAN_KEYS)
    for name, columns in PLAN_COLUMNS.items():
        schema, keys = T.table_specs("dcp")[name]
        assert [(f.name, DUCK_TYPES[f.type]) for f in schema] == list(columns), name
        assert tuple(keys) == PLAN_KEYS[name], name
    for protocol, names in TABLE_NAMES.items():
        assert T.table_names(protocol) == list(names)


def _old_files(files, names, out, as_of):
    """The files as pyarrow writes them (the streamed path of `--checksum -o`)."""
    rep = local.replay_local(files, tables=names, as_of=as_of, stream=True)
    try:
        return dict(results.write_tables(str(out), {n: rep.stream(n) for n in names}))
    finally:
        rep.close()


@pytest.mark.parametrize("cut", ["none", "ts", "seqno", "before_all"])
def test_duckdb_files_equal_pyarrow_files(caps, tmp_path, cut):
    seen_rows = {}
    for i, cap in enumerate(caps):
        files = reader.find_captures([cap])
        ts = sorted(int(t) for t in reader.read_capture_table(files, ["ts"]).column("ts").cast(pa.int64()).to_pylist())
        as_of = {"none": None, "ts": AsOf(ts[len(ts) * 2 // 3]), "seqno": AsOf(None, ((63, 20), (0, 10), (5, 7))),
                 "before_all": AsOf(ts[0] - 1)}[cut]
        names = list(local.PLAN_TABLES)
        old = _old_files(files, names, tmp_path / f"old{i}", as_of)
        new = dict(results.write_files(files, names, str(tmp_path / f"new{i}"), as_of))
        assert [os.path.basename(p) for p in new] == [f"{n}.parquet" for n in names]
        for name in names:
            a = pq.read_table(str(tmp_path / f"new{i}" / f"{name}.parquet"))
            b = pq.read_table(str(tmp_path / f"old{i}" / f"{name}.parquet"))
            assert a.schema == b.schema and a.equals(b), (cap, cut, name)
            assert [f.nullable for f in a.schema] == [True] * len(a.schema), name
            assert new[str(tmp_path / f"new{i}" / f"{name}.parquet")] == old[str(tmp_path / f"old{i}" / f"{name}.parquet")]
            seen_rows[name] = seen_rows.get(name, 0) + a.num_rows
    if cut == "before_all":
        assert set(seen_rows.values()) == {0}        # empty tables keep their schema
    if cut == "none":
        assert all(seen_rows[n] for n in names), seen_rows     # every table has rows somewhere


def test_a_mix_writes_the_other_tables_through_pyarrow_in_the_order_asked(caps, tmp_path):
    files = reader.find_captures([caps[0]])
    names = ["failover", "vbuckets", "documents", "snapshots"]
    assert results.duckdb_writes(files, names, str(tmp_path)) == ["failover"]   # documents: vbuckets counts it
    written = list(results.write_files(files, names, str(tmp_path), None))
    assert [os.path.basename(p) for p, _ in written] == [f"{n}.parquet" for n in names]
    want = local.replay_local(files, tables=names)
    for (path, rows), name in zip(written, names):
        assert pq.read_table(path).equals(want.table(name)) and rows == want.table(name).num_rows, name


def test_a_failed_query_leaves_no_file(caps, tmp_path, monkeypatch):
    files = reader.find_captures([caps[0]])
    out = str(tmp_path / "documents.parquet")
    frames = duck.DuckFrames(files, outputs=(out,))
    # a cast that fails while the rows are written (state is text such as 'live')
    monkeypatch.setitem(duck.PLAN_COLUMNS, "documents",
                        tuple((c, "INTEGER" if c == "state" else t) for c, t in duck.PLAN_COLUMNS["documents"]))
    try:
        with pytest.raises(reader.CaptureError, match="^replay: "):
            frames.write("documents", out)
    finally:
        frames.close()
    assert not os.path.exists(out)


# --------------------------------------------------------------------------- the footer reader

def _pyarrow_facts(path):
    md = pq.read_metadata(path)
    groups = []
    for r in range(md.num_row_groups):
        rg = md.row_group(r)
        counts = {}
        for c in range(rg.num_columns):
            st = rg.column(c).statistics
            counts[rg.column(c).path_in_schema] = st.null_count if st is not None and st.has_null_count else None
        groups.append((rg.num_rows, counts))
    return md.num_rows, md.metadata, groups


def test_the_footer_reader_reads_what_pyarrow_reads(caps, tmp_path):
    paths = [f.path for cap in caps for f in reader.find_captures([cap]) if not f.in_progress]
    # and files of other writers: DuckDB's, every column dictionary-encoded, no statistics
    new = list(results.write_files(reader.find_captures([caps[0]]), ["documents", "failover"], str(tmp_path), None))
    t = reader.read_capture_table(reader.find_captures([caps[0]]))
    pq.write_table(t, str(tmp_path / "dict.parquet"), use_dictionary=True, row_group_size=50)
    pq.write_table(t, str(tmp_path / "nostats.parquet"), write_statistics=False)
    paths += [p for p, _ in new] + [str(tmp_path / "dict.parquet"), str(tmp_path / "nostats.parquet")]
    for path in paths:
        ft = footers.read_footer(path)
        rows, meta, groups = _pyarrow_facts(path)
        assert (ft.num_rows, ft.metadata or None) == (rows, meta), path
        assert [(g.num_rows, g.null_counts) for g in ft.row_groups] == groups, path


def test_discovery_and_facts_are_the_same_with_either_reader(caps, monkeypatch):
    for cap in caps:
        files = {}
        for light in (True, False):
            monkeypatch.setattr(footers, "LIGHT", light)
            footers.forget()
            found = discovery.find_captures([cap])
            files[light] = ([(f.path, f.capture_id, f.segment, f.metadata) for f in found],
                            discovery.null_by_statistics(found, "rollback_seqno"),
                            discovery.null_by_statistics(found, "stream_end_reason"),
                            [footers.num_rows(f.path) for f in found if not f.in_progress],
                            [footers.null_state(f.path, c) for f in found if not f.in_progress
                             for c in ("rollback_seqno", "key", "no_such_column")])
        assert files[True] == files[False]
    footers.forget()


def test_hostile_footers_are_refused_cleanly_and_pyarrow_reports_them(caps, tmp_path, monkeypatch):
    good = next(f.path for f in reader.find_captures([caps[0]]) if not f.in_progress)
    data = open(good, "rb").read()
    length = int.from_bytes(data[-8:-4], "little")
    footer = data[-8 - length:-8]
    rng = random.Random(7)
    cases = [footer[:n] for n in (0, 1, 7, len(footer) // 2, len(footer) - 1)]
    cases += [bytes(rng.getrandbits(8) for _ in range(n)) for n in (1, 16, 300, 4000)]
    for _ in range(200):            # single bytes changed: the parse ends or fails cleanly
        b = bytearray(footer)
        b[rng.randrange(len(b))] = rng.getrandbits(8)
        cases.append(bytes(b))
    cases += [b"\x19\xfc" + b"\xff" * 12, b"\x1c" * 40, b"\x15\xff\xff\xff\xff\x0f"]   # huge list sizes, deep nesting
    for case in cases:
        try:
            footers.parse_footer(case)
        except footers.FooterError:
            pass
    # whole files: a wrong length, a cut tail, no magic; the small reader refuses them and the
    # error users see is pyarrow's, as before (NotACapture: not a readable capture file)
    monkeypatch.setattr(footers, "LIGHT", True)
    name = os.path.basename(good)
    variants = {"length": data[:-8] + (len(data) * 2).to_bytes(4, "little") + b"PAR1",
                "cut": data[:-3], "magic": data[:-4] + b"XXXX", "tiny": b"PAR1"}
    for what, blob in variants.items():
        d = tmp_path / what
        d.mkdir()
        (d / name).write_bytes(blob)
        with pytest.raises(footers.FooterError):
            footers.read_footer(str(d / name))
        footers.forget()
        with pytest.raises(reader.NotACapture, match="not a readable capture file"):
            discovery.describe(str(d / name))
    footers.forget()


def test_a_damaged_segment_is_the_same_one_line_error_and_leaves_no_file(caps, tmp_path):
    # data pages overwritten, footer intact: found and planned, then DuckDB fails to read it
    import shutil

    from tests.support.cli_util import error_line, run
    d = tmp_path / "damaged"
    shutil.copytree(caps[0], d)
    seg = sorted(p for p in os.listdir(d) if p.endswith(".parquet"))[0]
    data = bytearray((d / seg).read_bytes())
    for i in range(200, min(1200, len(data) - 2000)):
        data[i] ^= 0x5A
    (d / seg).write_bytes(bytes(data))
    res = run("replay", str(d), "--table", "documents", "-o", str(tmp_path / "o"))
    assert res.returncode == 1
    assert error_line(res).startswith(f"dcptool: {d / seg}: unreadable (")
    assert not (tmp_path / "o" / "documents.parquet").exists()
