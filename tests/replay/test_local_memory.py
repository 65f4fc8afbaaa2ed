"""The local engine's memory model (REPLAY.md "Memory of the local engine"): the relational
tables run in DuckDB under DCPTOOL_REPLAY_MEMORY, spilling to a temporary directory that goes
away; the per-vbucket pass tracks no document (one pass whatever the budget), and `vbuckets`'
document counts come from DuckDB's `documents`. Behaviour only."""

from __future__ import annotations

import os
import tempfile

import pytest

from dcptool.replay.local import duck
from dcptool.replay.local import engine as local
from dcptool.replay.rules import tables as T
from dcptool.replay.store import reader
from tests.support import capgen, oracle


def _files(tmp_path, seed: int, n_events: int, in_progress: bool = False):
    d = tmp_path / f"dcp-{seed}-{n_events}-{in_progress}"
    caps = capgen.generate("dcp", seed, n_events=n_events, max_captures=3)
    capgen.write_captures(caps, str(d), seed=seed, in_progress_last=in_progress)
    return reader.find_captures([str(d)])


def _checksums(rep) -> dict[str, str]:
    return {name: T.checksum(name, rep.table(name)) for name in rep.names() if name not in ("frames", "topology")}


def test_budget_from_the_environment(monkeypatch):
    monkeypatch.setenv("DCPTOOL_REPLAY_MEMORY", "512M")
    assert local.doc_budget() == 512 << 20
    monkeypatch.setenv("DCPTOOL_REPLAY_MEMORY", "0")
    assert local.doc_budget() is None
    monkeypatch.setenv("DCPTOOL_REPLAY_MEMORY", "lots")
    with pytest.raises(ValueError, match="DCPTOOL_REPLAY_MEMORY"):
        local.doc_budget()
    monkeypatch.delenv("DCPTOOL_REPLAY_MEMORY")
    assert local.doc_budget() is None or local.doc_budget() > 0


def test_a_bad_budget_is_a_usage_error_before_any_work(tmp_path, monkeypatch):
    from click.testing import CliRunner

    from dcptool.cli import cli
    files = [f.path for f in _files(tmp_path, 17, 60)]
    monkeypatch.setenv("DCPTOOL_REPLAY_MEMORY", "lots")
    res = CliRunner().invoke(cli, ["replay", *files, "--table", "vbuckets", "--checksum"])
    assert res.exit_code == 2, res.output
    assert "DCPTOOL_REPLAY_MEMORY='lots'" in res.output and "Traceback" not in res.output
    monkeypatch.setenv("DCPTOOL_REPLAY_MEMORY", "64M")
    res = CliRunner().invoke(cli, ["replay", *files, "--table", "vbuckets", "--checksum"])
    assert res.exit_code == 0 and res.output.strip().endswith("vbuckets"), res.output


def test_only_the_tables_asked_for_then_any(tmp_path):
    files = _files(tmp_path, 16, 300)
    full = _checksums(local.replay_local(files))
    rep = local.replay_local(files, tables=["documents"])
    assert "snapshots" not in rep.results and "vbuckets" not in rep.results
    assert T.checksum("documents", rep.table("documents")) == full["documents"]
    # a table it was told would not be asked for is still right when asked for
    assert T.checksum("vbuckets", rep.table("vbuckets")) == full["vbuckets"]
    assert T.checksum("snapshots", rep.table("snapshots")) == full["snapshots"]


@pytest.fixture
def passes(monkeypatch):
    """The passes of the per-vbucket rules each replay ran."""
    seen: list[int] = []
    real = local._dcp_pass

    def counting(*args):
        seen.append(1)
        return real(*args)
    monkeypatch.setattr(local, "_dcp_pass", counting)
    return seen


def test_vbuckets_track_no_document_and_count_from_documents(tmp_path, passes):
    """One pass whatever the budget, with no document store; the live / deleted / expired
    counts equal a GROUP BY over `documents`, from DuckDB or from the table already built."""
    files = _files(tmp_path, 8, 600)
    want = oracle.dcp(files)
    alone = local.replay_local(files, tables=["vbuckets"], memory=1)
    assert passes == [1] and alone.table("vbuckets").equals(want["vbuckets"])
    both = local.replay_local(files, tables=["documents", "vbuckets"])
    assert both.table("vbuckets").equals(want["vbuckets"])
    assert sum(want["vbuckets"].column("live").to_pylist()) > 0


def test_duckdb_takes_the_budget_and_a_temporary_directory_it_removes(tmp_path, monkeypatch):
    files = _files(tmp_path, 5, 80)
    monkeypatch.setenv("DCPTOOL_REPLAY_MEMORY", "300M")
    made = []
    real = duck.DuckFrames.__init__

    def spy(self, *a, **kw):
        real(self, *a, **kw)
        made.append((self.tmp, self.con.sql("SELECT current_setting('memory_limit')").fetchall()[0][0]))
    monkeypatch.setattr(duck.DuckFrames, "__init__", spy)
    local.replay_local(files, tables=["documents"])
    (spill, limit), = made
    assert limit == "300.0 MiB"
    assert os.path.dirname(spill) == tempfile.gettempdir() and not os.path.exists(spill)
    monkeypatch.setenv("DCPTOOL_REPLAY_MEMORY", "1K")      # too little for DuckDB: its floor
    local.replay_local(files, tables=["failover"])
    assert made[1][1] == f"{duck.MIN_MEMORY >> 20}.0 MiB"


def test_the_duckdb_connection_reads_only_the_capture(tmp_path):
    files = _files(tmp_path, 6, 80)
    frames = duck.DuckFrames(files)
    try:
        assert frames.arrow("SELECT count(*) AS n FROM frames").column("n")[0].as_py() > 0
        for query in ("SELECT * FROM read_csv('/etc/passwd')", f"COPY (SELECT 1) TO '{tmp_path}/x.csv'",
                      "SET enable_external_access = true", "INSTALL httpfs"):
            with pytest.raises(Exception):
                frames.con.execute(query)
        assert not (tmp_path / "x.csv").exists()
    finally:
        frames.close()
    assert not os.path.exists(frames.tmp)


def test_documents_alone_run_no_python_pass(tmp_path, passes):
    """`documents` (and the other tables of replay/rules/plans.py) come from DuckDB: no pass of
    the per-vbucket rules over the frames, unless `vbuckets` or `snapshots` is asked for."""
    files = _files(tmp_path, 9, 200)
    rep = local.replay_local(files, tables=list(local.PLAN_TABLES))
    assert passes == [] and set(rep.results) == set(local.PLAN_TABLES)
    local.replay_local(files, tables=["vbuckets"])
    assert passes == [1]
