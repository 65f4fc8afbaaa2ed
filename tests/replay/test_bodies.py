"""Document bodies in `documents` and `history` (REPLAY.md "Bodies", issue 37.1) on the
in-process engine: the value as the application stored it (Snappy undone, xattrs cut off),
the xattrs as JSON object text, the value as text when JSON; tombstones keep their xattrs,
commits take their prepare's body, `--as-of` and rollbacks give the body of the change they
leave; `--format jsonl` prints a JSON body as JSON; `--sql` reads a field with DuckDB's JSON
functions; `-o` (DuckDB writes the file) gives the same rows. Spark: test_bodies_spark.py."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pyarrow.parquet as pq
import pytest

from dcptool.replay.local import engine as local
from dcptool.replay.rules import bodies
from dcptool.replay.rules import tables as T
from dcptool.replay.rules.as_of import AsOf
from dcptool.replay.store import reader
from tests.support import body_caps, oracle

DCPTOOL = [os.path.join(os.path.dirname(sys.executable), "dcptool")]


def _files(tmp_path, built, cuts=(40,)):
    d = tmp_path / "caps"
    body_caps.write(built, str(d), cuts=cuts)
    return reader.find_captures([str(d)])


def _body(r):
    return r["value"], r["xattrs"], r["value_json"]


@pytest.mark.parametrize("snappy", [False, True])
@pytest.mark.parametrize("seed", [1, 2, 3])
def test_documents_and_history_bodies_are_what_was_stored(tmp_path, seed, snappy):
    built = body_caps.generate(seed, snappy)
    files = _files(tmp_path, built)
    rep = local.replay_local(files)
    docs = rep.table("documents")
    assert docs.num_rows > 20
    kinds = set()
    for r in docs.to_pylist():
        want = built.stored[(r["vbucket"], r["collection_id"], r["key"])][-1]
        assert _body(r) == (want["value"], want["xattrs"], want["value_json"]), r
        kinds.add((r["state"], r["xattrs"] is not None, r["value_json"] is not None, (r["datatype"] or 0) & 2))
    # JSON and binary values, tombstones with and without xattrs, Snappy when negotiated
    assert ("live", True, True, 0) in kinds and ("live", False, False, 0) in kinds
    assert any(k[0] != "live" and k[1] for k in kinds) and any(k[0] != "live" and not k[1] for k in kinds)
    assert any(k[3] for k in kinds) == snappy
    # the row-by-row interpreter agrees, body columns included
    assert docs.equals(oracle.dcp(files)["documents"])
    history = rep.table("history").to_pylist()
    assert len(history) == sum(len(v) for v in built.stored.values())
    for r in history:
        want = {w["seqno"]: w for w in built.stored[(r["vbucket"], r["collection_id"], r["key"])]}[r["by_seqno"]]
        assert _body(r) == (want["value"], want["xattrs"], want["value_json"]), r


def test_a_json_value_that_is_not_utf8_has_no_text_and_a_bad_xattr_section_no_xattrs(tmp_path):
    b = body_caps.Built()
    body_caps.stream(b, 0)
    body_caps.change(b, "mutation", 0, b"a", 1, cid=None, value=b'{"x":"\xff"}', json_value=True)
    body_caps.change(b, "mutation", 0, b"b", 2, cid=None, value=b"\x00\x01", xattrs=[(b"k", b"not json")])
    # an xattr section that announces more bytes than the value holds: no value, no xattrs
    row = dict(b.rows[-1])
    row.update(key=b"c", by_seqno=3, raw=row["raw"][:24 + 31 + 1] + b"\x00\x00\x01\x00" + b"xyz", value_len=7)
    b.rows.append(row)
    # a Snappy value that does not decompress: all null
    row = dict(b.rows[-1])
    row.update(key=b"d", by_seqno=4, datatype=0x03, raw=row["raw"][:-7] + b"\xff\xff\xff\xff\x0f\x01\x02", value_len=7)
    b.rows.append(row)
    docs = {r["key"]: r for r in local.replay_local(_files(tmp_path, b, cuts=())).table("documents").to_pylist()}
    assert _body(docs[b"a"]) == (b'{"x":"\xff"}', None, None)
    assert _body(docs[b"b"]) == (b"\x00\x01", '{"k":"not json"}', None)     # a value that is not JSON: a string
    assert _body(docs[b"c"]) == (None, None, None)
    assert _body(docs[b"d"]) == (None, None, None)


def test_bodies_split_rule():
    sec = body_caps.xattr_section([(b"_sync", b'{"a":1}'), (b"k\xff", b"plain")])
    assert bodies.split(sec + b"{}", 0x05) == (b"{}", '{"_sync":{"a":1},"k\ufffd":"plain"}')
    assert bodies.split(b"", 0x04) == (None, None)
    assert bodies.split(b"\x00\x00\x00\x02\x00\x00", 0x04) == (b"", None)      # pairs that do not parse
    assert bodies.split(b"abc", 0x00) == (b"abc", None)


def test_commits_tombstones_and_rollbacks(tmp_path):
    files = _files(tmp_path, body_caps.sync_capture(), cuts=())
    rep = local.replay_local(files)
    docs = {r["key"]: r for r in rep.table("documents").to_pylist()}
    assert _body(docs[b"p"]) == (b'{"v":"prepared"}', '{"_sync":{"s":1}}', '{"v":"prepared"}')
    assert docs[b"p"]["state"] == "live" and docs[b"p"]["by_seqno"] == 2
    assert _body(docs[b"orphan"]) == (None, None, None)
    assert docs[b"t"]["state"] == "deleted"
    assert _body(docs[b"t"]) == (b"", '{"_sync":{"rev":"2","deleted":true}}', None)
    assert _body(docs[b"r"])[2] == '{"v":"first"}'          # seqno 7 was rolled back
    hist = {(r["key"], r["by_seqno"]): r for r in rep.table("history").to_pylist()}
    assert hist[(b"p", 2)]["op"] == "commit" and _body(hist[(b"p", 2)]) == _body(docs[b"p"])
    assert _body(hist[(b"t", 4)]) == (b'{"v":1}', '{"_sync":{"rev":"1"}}', '{"v":1}')
    assert (b"r", 7) not in hist


def test_as_of_gives_the_bodies_of_then(tmp_path):
    b = body_caps.Built()
    body_caps.stream(b, 0)
    body_caps.change(b, "mutation", 0, b"k", 1, cid=None, value=b'{"at":1}', json_value=True)
    then = b.ts
    body_caps.change(b, "mutation", 0, b"k", 2, cid=None, value=b'{"at":2}', json_value=True, snappy=True)
    files = _files(tmp_path, b, cuts=())
    assert local.replay_local(files).table("documents").column("value_json").to_pylist() == ['{"at":2}']
    past = local.replay_local(files, as_of=AsOf(ts_ns=then)).table("documents")
    assert past.column("value_json").to_pylist() == ['{"at":1}']


def _cli(*args, check=True):
    out = subprocess.run([*DCPTOOL, *args], capture_output=True, text=True, timeout=120)
    if check:
        assert out.returncode == 0, out.stderr
    return out


@pytest.fixture(scope="module")
def coded_caps(tmp_path_factory):
    d = tmp_path_factory.mktemp("coded") / "caps"
    built = body_caps.generate(5, True)
    body_caps.write(built, str(d), cuts=(50,))
    return built, str(d)


def test_jsonl_prints_a_json_body_as_json(coded_caps):
    built, d = coded_caps
    lines = [json.loads(x) for x in _cli("replay", d, "--table", "documents", "--format", "jsonl").stdout.splitlines()]
    assert lines and all("value_json" not in r for r in lines)
    seen = set()
    for r in lines:
        want = built.stored[(r["vbucket"], r["collection_id"], r["key"].encode())][-1]
        if want["value_json"] is not None:
            assert r["value"] == json.loads(want["value_json"]) and r["value_base64"] is None
            seen.add("json")
        elif want["value"]:
            assert r["value"] is None and r["value_base64"] is not None
            seen.add("binary")
        if want["xattrs"] is not None:
            assert r["xattrs"] == json.loads(want["xattrs"])
            seen.add("xattrs")
    assert seen == {"json", "binary", "xattrs"}


def test_sql_reads_a_json_field_with_duckdb_functions(coded_caps):
    built, d = coded_caps
    sql = ("SELECT decode(key) AS k, value_json->>'$.type' AS t, CAST(json_extract(value_json, '$.n') AS BIGINT) AS n, "
           "xattrs->>'$._sync.rev' AS rev FROM documents WHERE value_json IS NOT NULL ORDER BY vbucket, collection_id, key")
    rows = [json.loads(x) for x in _cli("replay", d, "--sql", sql, "--format", "jsonl").stdout.splitlines()]
    assert rows
    got = {}
    for r in rows:
        got.setdefault(r["k"], []).append((r["t"], r["n"], r["rev"]))
    for key, versions in built.stored.items():
        last = versions[-1]
        if last["value_json"] is None:
            continue
        doc = json.loads(last["value_json"])
        rev = json.loads(last["xattrs"])["_sync"]["rev"] if last["xattrs"] else None
        assert (doc.get("type"), doc.get("n"), rev) in got[key[2].decode()]


def test_o_and_checksum_paths_give_the_same_bodies(coded_caps, tmp_path):
    _, d = coded_caps
    want = local.replay_local(reader.find_captures([d])).table("documents")
    out = tmp_path / "o"
    code = ("import sys; from dcptool.cli import main\n"
            f"try:\n    main(['replay', {d!r}, '--table', 'documents', '--table', 'history', '-o', {str(out)!r}])\n"
            "except SystemExit as e:\n    assert not e.code, e.code\n"
            "sys.stderr.write('LOADED:' + ','.join(m for m in ('pyarrow', 'pandas') if m in sys.modules))")
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr
    # DuckDB wrote the files (its Python function for the Snappy rows loads numpy, not pyarrow)
    assert run.stderr.strip().endswith("LOADED:"), run.stderr
    assert pq.read_table(str(out / "documents.parquet")).equals(want)
    sums = dict(reversed(x.split()) for x in _cli("replay", d, "--table", "documents", "--checksum").stdout.splitlines())
    assert sums["documents"] == T.checksum("documents", want)


def test_no_python_function_without_snappy_or_xattrs(tmp_path):
    b = body_caps.Built()
    body_caps.stream(b, 0)
    body_caps.change(b, "mutation", 0, b"k", 1, cid=None, value=b'{"a":1}', json_value=True)
    body_caps.change(b, "mutation", 0, b"x", 2, cid=None, value=b"\x01\x02")
    from dcptool.replay.local.duck import DuckFrames
    frames = DuckFrames(_files(tmp_path, b, cuts=()))
    try:
        assert frames.table("documents").column("value").to_pylist() == [b'{"a":1}', b"\x01\x02"]
        assert not frames.facts.coded
        assert bodies.FUNCTION not in frames.con.sql("SELECT 1 AS x").columns   # the connection still answers
        names = {r[0] for r in frames.con.sql("SELECT function_name FROM duckdb_functions()").fetchall()}
        assert bodies.FUNCTION not in names
    finally:
        frames.close()
