"""The in-process replay hands DuckDB's sorted plan tables on as record batches (Replay.stream,
replay/results.py write_tables): the files of `-o` and the checksums are those of the whole
tables, a stream that fails leaves no file, and `replay --table documents -o DIR` loads only
what that path needs (REPLAY.md "Running a replay", In-process)."""

from __future__ import annotations

import os
import subprocess
import sys

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from dcptool.replay import results
from dcptool.replay.local import duck
from dcptool.replay.local import engine as local
from dcptool.replay.rules import tables as T
from dcptool.replay.store import reader
from tests.support import capgen


@pytest.fixture(scope="module")
def capture(tmp_path_factory):
    d = tmp_path_factory.mktemp("stream") / "caps"
    capgen.write_captures(capgen.generate("dcp", 29, n_events=400, max_captures=3), str(d), seed=29,
                          in_progress_last=True)
    return str(d)


def test_streamed_tables_are_the_tables(capture, tmp_path, monkeypatch):
    # batches of 7 rows: every table of more than 7 rows streams in several batches and row groups
    monkeypatch.setattr(duck, "BATCH_ROWS", 7)
    files = reader.find_captures([capture])
    want = local.replay_local(files)
    rep = local.replay_local(files, tables=local.PLAN_TABLES, stream=True)
    try:
        chosen = {n: rep.stream(n) for n in local.PLAN_TABLES}
        assert all(isinstance(t, T.Batches) for t in chosen.values())
        sums = {}
        written = dict(results.write_tables(str(tmp_path), chosen, sums))
    finally:
        rep.close()
    assert rep.streaming is None
    assert want.table("documents").num_rows > 7
    for name in local.PLAN_TABLES:
        path = str(tmp_path / f"{name}.parquet")
        table = want.table(name)
        assert written[path] == table.num_rows
        assert pq.read_table(path).equals(table), name
        assert sums[name] == (T.checksum(name, table), table.num_rows), name
    assert pq.read_metadata(str(tmp_path / "documents.parquet")).num_row_groups > 1


def test_documents_stays_built_when_vbuckets_counts_it(capture):
    files = reader.find_captures([capture])
    rep = local.replay_local(files, tables=["documents", "vbuckets", "history"], stream=True)
    assert "documents" in rep.results and "history" not in rep.results
    assert isinstance(rep.stream("documents"), pa.Table)
    assert rep.streaming is None
    rep.close()


def test_a_failed_stream_leaves_no_file(tmp_path):
    schema = T.schema_of("dcp", "failover")

    def batches():
        yield pa.RecordBatch.from_pylist([{"vbucket": 1, "position": 0, "vbucket_uuid": 7, "seqno": 3}],
                                         schema=schema)
        raise reader.CaptureError("replay: damaged")

    with pytest.raises(reader.CaptureError):
        list(results.write_tables(str(tmp_path), {"failover": T.Batches(schema, batches())}, {}))
    assert not (tmp_path / "failover.parquet").exists()


def test_replay_to_files_loads_only_its_path(capture, tmp_path):
    # DuckDB writes the file itself (replay/local/duck.py DuckFrames.write): neither pyarrow nor
    # numpy is loaded; the segment in progress is set aside first (converting it loads pyarrow),
    # and the machine's zone is not UTC (the times written are the same instants all the same)
    # A capture whose changes carry neither Snappy nor xattrs (datatype bits 0x06): bodies are
    # then cut in SQL alone (with them, DuckDB's Python function loads numpy: REPLAY.md "Bodies")
    finished = tmp_path / "finished"
    finished.mkdir()
    for name in os.listdir(capture):
        if name.endswith(".parquet"):
            t = pq.read_table(os.path.join(capture, name))
            i = t.column_names.index("datatype")
            t = t.set_column(i, "datatype", pa.compute.bit_wise_and(t.column(i), pa.scalar(1, pa.uint8())))
            pq.write_table(t, finished / name)
    code = ("import sys; from dcptool.cli import main\n"
            f"try:\n    main(['replay', {str(finished)!r}, '--table', 'documents', '-o', {str(tmp_path / 'o')!r}])\n"
            "except SystemExit as e:\n    assert not e.code, e.code\n"
            "bad = [m for m in ('rich', 'pandas', 'pyspark', 'pyarrow', 'numpy', 'dcptool.replay.apply',"
            " 'dcptool.replay.spark.arrow', 'dcptool.cli.live', 'dcptool.cli.view.output') if m in sys.modules]\n"
            "sys.stderr.write('LOADED:' + ','.join(bad))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                         env=dict(os.environ, TZ="America/New_York"))
    assert out.returncode == 0, out.stderr
    assert out.stderr.strip().endswith("LOADED:"), out.stderr
    written = pq.read_table(str(tmp_path / "o" / "documents.parquet"))
    want = local.replay_local(reader.find_captures([str(finished)]), tables=["documents"]).table("documents")
    assert "wrote " in out.stderr and written.num_rows and written.equals(want)
