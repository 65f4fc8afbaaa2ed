"""`dcptool decode`: stdout carries one JSON object per frame, stderr one error line, exit
codes per CLI.md."""

from __future__ import annotations

import base64
import json

from click.testing import CliRunner

from dcptool.cli import cli
from dcptool.protocol.dcp.wire import messages as M
from tests.support.dcp_vectors import VECTORS


def _run(args, data: bytes):
    return CliRunner().invoke(cli, ["decode", *args], input=data)


def test_decode_prints_one_object_per_frame_with_capture_columns():
    data = b"".join(v[1] for v in VECTORS if not v[2])
    res = _run(["--format", "jsonl", "-"], data)
    assert res.exit_code == 0, res.output
    rows = [json.loads(line) for line in res.stdout.splitlines()]
    assert len(rows) == len([v for v in VECTORS if not v[2]])
    mut = next(r for r in rows if r["op"] == "mutation")
    assert mut["by_seqno"] == 24 or mut["by_seqno"] == 4
    assert all("raw" not in r for r in rows)


def test_decode_raw_and_collections_flags():
    data = VECTORS[1][1]
    res = _run(["--format", "jsonl", "--raw", "--collections", "-"], data)
    row = json.loads(res.stdout)
    assert base64.b64decode(row["raw"]) == data
    assert row["collection_id"] == 8 and row["key"] == "xdcrProvCollections_C29854" and row["key_base64"] is None


def test_response_takes_vbucket_from_request_opaque():
    data = M.encode(M.StreamRequest(vbucket=99, opaque=5)) + M.encode(
        M.StreamRequestResponse(opaque=5, status=0, failover_log=((123, 0),)))
    rows = [json.loads(x) for x in _run(["--format", "jsonl", "-"], data).stdout.splitlines()]
    assert rows[1]["vbucket"] == 99 and rows[1]["failover_log"] == [{"vbucket_uuid": 123, "seqno": 0}]


def test_truncated_final_frame_exit_5_after_complete_frames():
    good = VECTORS[3][1] * 3
    res = _run(["--format", "jsonl", "-"], good + VECTORS[3][1][:30])
    assert res.exit_code == 5
    assert len(res.stdout.splitlines()) == 3
    assert "truncated frame at byte %d" % len(good) in res.stderr
    assert "Traceback" not in res.stderr and len(res.stderr.strip().splitlines()) == 1


def test_hostile_length_exit_5_after_complete_frames():
    hostile = bytearray(VECTORS[3][1])
    hostile[8:12] = (0xFFFFFFF0).to_bytes(4, "big")
    res = _run(["--format", "jsonl", "-"], VECTORS[3][1] + bytes(hostile))
    assert res.exit_code == 5 and len(res.stdout.splitlines()) == 1
    assert "above the cap" in res.stderr


def test_table_format_for_people():
    res = _run(["--format", "table", "-"], VECTORS[3][1])
    assert res.exit_code == 0 and "mutation" in res.stdout and "hello" in res.stdout
