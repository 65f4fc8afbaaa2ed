"""`dcptool replay` through click's CliRunner (local engine): stdout carries only data,
errors are one line with the right exit code."""

from __future__ import annotations

import base64
import datetime
import json

import pyarrow.parquet as pq
from click.testing import CliRunner

from dcptool.cli import cli
from dcptool.replay.local import engine as local
from dcptool.replay.rules import tables as T
from dcptool.replay.store import reader
from tests.support import capgen
from tests.support.paths import ROOT


def _capture(tmp_path, protocol="dcp", s=3):
    d = tmp_path / protocol
    paths = capgen.write_captures(capgen.generate(protocol, s, n_events=150), str(d), seed=s)
    return str(d), paths


def _run(*args, input=None):
    return CliRunner().invoke(cli, ["replay", *args], input=input, catch_exceptions=False)


def test_checksum_lines_match_library(tmp_path):
    d, _ = _capture(tmp_path)
    r = _run(d, "--checksum")
    assert r.exit_code == 0, r.output
    rep = local.replay_local(reader.find_captures([d]))
    want = [f"{T.checksum(n, rep.table(n))}  {n}" for n in rep.names() if n != "frames"]
    assert r.stdout.splitlines() == want
    r2 = _run(d, "--checksum", "--table", "frames", "--format", "jsonl")
    row = json.loads(r2.stdout)
    assert row["table"] == "frames" and row["rows"] == rep.table("frames").num_rows


def test_jsonl_table_and_stdin_paths(tmp_path):
    d, paths = _capture(tmp_path)
    r = _run("-", "--table", "documents", "--format", "jsonl", input="\n".join(reversed(paths)) + "\n")
    assert r.exit_code == 0
    rows = [json.loads(x) for x in r.stdout.splitlines()]
    docs = local.replay_local(reader.find_captures([d])).table("documents")
    assert len(rows) == docs.num_rows > 0
    k = docs.column("key")[0].as_py()
    if rows[0]["key"] is not None:  # keys are text; key_base64 carries one that is not UTF-8
        assert rows[0]["key"].encode() == k and rows[0]["key_base64"] is None
    else:
        assert base64.b64decode(rows[0]["key_base64"]) == k
    assert "table" not in rows[0]


def test_out_writes_parquet_per_table(tmp_path):
    d, _ = _capture(tmp_path, "synapse")
    out = tmp_path / "out"
    r = _run(d, "--out", str(out))
    assert r.exit_code == 0 and r.stdout == ""
    rep = local.replay_local(reader.find_captures([d]))
    for name in ("positions", "rows", "gaps", "commands"):
        t = pq.read_table(out / f"{name}.parquet")
        assert t.equals(rep.table(name)), name
    assert not (out / "frames.parquet").exists()


def test_apply_prints_user_results(tmp_path):
    d, _ = _capture(tmp_path)
    r = _run(d, "--apply", "tests.replay.test_replay_spark:_apply_fn", "--format", "jsonl")
    assert r.exit_code == 0, r.output
    keys = [json.loads(json.loads(x)["key"]) for x in r.stdout.splitlines()]
    assert keys == sorted(keys) and keys


def test_usage_and_runtime_errors(tmp_path):
    d, _ = _capture(tmp_path)
    r = _run(d, "--sql", "SELEC 1")     # --sql runs in-process (DuckDB) since issue 29
    assert r.exit_code == 2 and r.stderr.startswith("dcptool: SQL error [Parser Error]"), r.output
    r = _run(d, "--table", "nope")
    assert r.exit_code == 2 and "unknown table" in r.output
    r = _run(d, "--apply", "no_such_module_xyz:f")
    assert r.exit_code == 2
    bad = tmp_path / "bad.parquet"
    bad.write_bytes(b"junk")
    r = _run(str(bad))
    assert r.exit_code == 1 and r.stdout == ""
    assert len(r.stderr.strip().splitlines()) == 1 and "bad.parquet" in r.stderr


def test_damaged_data_pages_are_one_line_and_exit_1(tmp_path):
    """A segment whose footer is whole but whose data is damaged (read on a worker thread)."""
    d, paths = _capture(tmp_path, s=5)
    path = max(paths, key=lambda p: len(open(p, "rb").read()))
    data = bytearray(open(path, "rb").read())
    footer = pq.ParquetFile(path).metadata.serialized_size + 8
    for i in range(len(data) // 4, len(data) - footer - 16):
        data[i] ^= 0x5A
    open(path, "wb").write(bytes(data))
    r = _run(d, "--checksum")
    assert r.exit_code == 1 and r.stdout == ""
    assert len(r.stderr.strip().splitlines()) == 1 and path.rsplit("/", 1)[1] in r.stderr


def test_timestamps_print_without_pandas(tmp_path):
    """The replay process keeps pandas out; timestamps still print, as ISO 8601 with their
    nanoseconds (checked in a fresh process, where pandas is really absent)."""
    import os
    import subprocess
    import sys
    d, _ = _capture(tmp_path)
    want = local.replay_local(reader.find_captures([d])).table("vbuckets")
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    for fmt in ("jsonl", "table"):
        r = subprocess.run([sys.executable, "-m", "dcptool.cli", "replay", d, "--table", "vbuckets",
                            "--format", fmt], capture_output=True, text=True, env=env, timeout=120)
        assert r.returncode == 0, r.stderr
        if fmt == "jsonl":
            rows = [json.loads(line) for line in r.stdout.splitlines()]
            for row, ns in zip(rows, want.column("first_ts").cast("int64").to_pylist()):
                secs, frac = divmod(ns, 10**9)
                assert row["first_ts"].startswith(
                    datetime.datetime.fromtimestamp(secs, datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%S"))
                assert row["first_ts"].endswith(f".{frac:09d}Z")
        else:
            assert "vbuckets" in r.stdout and str(want.column("vbucket")[0].as_py()) in r.stdout
