"""Issue 39, finding 9: `replay --content-checksum` sums each table's content, provenance
columns (REPLAY.md "Content checksums") left out and rows in any order, so a capture exported
to pcap and imported back (a new capture id) replays to the same sums as the original, table
for table; `--checksum` still tells the two apart."""

from __future__ import annotations

import json

import pyarrow as pa
import pytest

from dcptool.replay.rules import tables as T
from dcptool.replay.rules.table_types import TABLE_NAMES
from tests.support.cli_util import run
from tests.support.pcap_session import Server


def _sums(path, option) -> dict[str, tuple[str, int]]:
    res = run("replay", str(path), "--table", "all", option, "--format", "jsonl")
    assert res.returncode == 0, res.stderr
    return {r["table"]: (r["sha256"], r["rows"]) for r in map(json.loads, res.stdout.splitlines())}


def _round_trip(cap, tmp_path, port):
    """`port`: the DCP server's, not 11210 (a Synapse server's port is found by content)."""
    res = run("export", str(cap), "-o", str(tmp_path / "x.pcapng"))
    assert res.returncode == 0, res.stderr
    res = run("import", str(tmp_path / "x.pcapng"), "-o", str(tmp_path / "back"),
              *(("--port", str(port)) if port else ()))
    assert res.returncode == 0, res.stderr
    return tmp_path / "back"


def _capture(kind, url_of, tmp_path, *serve_args):
    srv = Server(kind, *serve_args)
    try:
        res = run("capture", url_of(srv.address), "-o", str(tmp_path / "cap"), "--quiet", "--to", "forever",
                  "--duration", "2s")
    finally:
        srv.stop()
    assert res.returncode == 0, res.stderr
    return tmp_path / "cap", srv.port


@pytest.mark.parametrize("kind", ["dcp", "synapse"])
def test_export_import_replays_to_the_same_content_checksums(tmp_path, kind):
    if kind == "dcp":
        cap, port = _capture("dcp", lambda a: f"couchbase://{a}/default", tmp_path, "--items", "400",
                             "--vbuckets", "8", "--rate", "300", "--seed", "3")
    else:
        cap, port = _capture("synapse", lambda a: f"synapse://{a}", tmp_path, "--items", "200", "--rate", "200")
    back = _round_trip(cap, tmp_path, port if kind == "dcp" else None)
    before, after = _sums(cap, "--content-checksum"), _sums(back, "--content-checksum")
    assert list(before) == list(TABLE_NAMES[kind]) and before == after, (before, after)
    main = "documents" if kind == "dcp" else "rows"
    assert before[main][1] > 100
    # the full checksum counts the capture's id: it differs for the same content
    full_before, full_after = _sums(cap, "--checksum"), _sums(back, "--checksum")
    assert full_before[main][1] == full_after[main][1] and full_before[main][0] != full_after[main][0]


def _docs(capture_id: str, order: list[int]) -> pa.Table:
    schema, _ = T.DCP_TABLES["documents"]
    rows = [dict(dict.fromkeys(schema.names), vbucket=i, collection_id=0, key=b"k%d" % i, by_seqno=i + 1,
                 rev_seqno=2, capture_id=capture_id, frame_no=100 + i, ts=1_700_000_000_000_000_000 + i)
            for i in order]
    return pa.Table.from_pylist(rows, schema=schema)


def test_content_checksum_leaves_out_provenance_and_row_order():
    one = T.content_checksum("documents", _docs("a", [0, 1, 2]))
    assert one == T.content_checksum("documents", _docs("b", [2, 0, 1]))
    assert T.checksum("documents", _docs("a", [0, 1, 2])) != T.checksum("documents", _docs("b", [0, 1, 2]))
    changed = _docs("a", [0, 1, 2]).set_column(4, "rev_seqno", pa.array([2, 3, 2], pa.int64()))
    assert T.content_checksum("documents", changed) != one
    assert T.content_checksum("documents", _docs("a", [0, 1])) != one          # a row fewer
    digest = T.ContentChecksum("documents", _docs("a", []).schema)             # batch by batch
    digest.update(_docs("x", [2]))
    digest.update(_docs("y", [0, 1]))
    assert digest.hexdigest() == one


def test_the_provenance_columns():
    assert T.content_columns("frames", T.frames_schema("dcp").names)[:2] == ["direction", "raw"]
    for protocol in ("dcp", "synapse"):
        for name, (schema, _key) in T.table_specs(protocol).items():
            kept = T.content_columns(name, schema.names)
            assert not {"capture_id", "frame_no", "ts"} & set(kept) and kept, name


def test_the_last_of_checksum_and_content_checksum_counts(tmp_path):
    from tests.support import capgen
    capgen.write_captures(capgen.generate("dcp", 4, 200, max_captures=1), str(tmp_path / "cap"), seed=4)
    full, content = _sums(tmp_path / "cap", "--checksum"), _sums(tmp_path / "cap", "--content-checksum")
    assert full["documents"] != content["documents"]
    res = run("replay", str(tmp_path / "cap"), "--table", "all", "--checksum", "--content-checksum",
              "--format", "jsonl")
    assert {r["table"]: (r["sha256"], r["rows"]) for r in map(json.loads, res.stdout.splitlines())} == content
