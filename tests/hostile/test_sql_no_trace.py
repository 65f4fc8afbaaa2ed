"""Issue 36 #3: the in-process SQL fence leaves no trace on disk, `--unsafe-sql` included
(CLI.md: DuckDB still has no file, network or extension access). `EXPORT DATABASE 'DIR'`
created DIR: the tables it reads were found by binding the statement on a connection without
the fence, and DuckDB binds EXPORT by creating its directory. Every statement whose job is
files is refused before it runs or binds, and every connection has external access off."""

from __future__ import annotations

import os

import pytest
from click.testing import CliRunner

from dcptool.cli import cli
from tests.support import capgen


@pytest.fixture(scope="module")
def capture_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("notrace") / "dcp"
    capgen.write_captures(capgen.generate("dcp", 5, n_events=80), str(d), seed=5)
    return str(d)


FILE_STATEMENTS = [
    ("EXPORT DATABASE '{tmp}/exported'", "EXPORT"),
    ("EXPORT DATABASE '{tmp}/exported_pq' (FORMAT parquet)", "EXPORT"),
    ("SELECT 1 AS one; EXPORT DATABASE '{tmp}/second'", "EXPORT"),
    ("IMPORT DATABASE '{tmp}/imported'", "IMPORT"),
    ("/* a comment */ IMPORT DATABASE '{tmp}/imported'", "IMPORT"),
    ("COPY (SELECT 1) TO '{tmp}/parts' (FORMAT parquet, PARTITION_BY (1))", "COPY"),
    ("COPY documents TO '{tmp}/per_thread' (FORMAT csv, PER_THREAD_OUTPUT true)", "COPY"),
    ("ATTACH '{tmp}/sub/attached.db'", "ATTACH"),
    ("INSTALL httpfs", "LOAD"),
    ("FORCE INSTALL json", "LOAD"),
    ("UPDATE EXTENSIONS", "a statement of a kind this DuckDB cannot name"),
]


@pytest.mark.parametrize("sql, kind", FILE_STATEMENTS)
def test_unsafe_sql_file_statements_are_refused_and_leave_nothing(capture_dir, tmp_path, monkeypatch, sql, kind):
    home = tmp_path / "home"
    home.mkdir()
    monkeypatch.setenv("HOME", str(home))      # ~/.duckdb (extensions, secrets) is here
    monkeypatch.setenv("TMPDIR", str(tmp_path))
    monkeypatch.chdir(tmp_path)
    before = sorted(os.listdir(tmp_path))
    r = CliRunner().invoke(cli, ["replay", capture_dir, "--unsafe-sql", "--sql", sql.format(tmp=tmp_path)],
                           catch_exceptions=False)
    lines = r.stderr.strip().splitlines()
    assert r.exit_code == 2 and r.stdout == "" and len(lines) == 1, r.output
    assert lines[0] == (f"dcptool: SQL error [Permission Error] {kind} is refused before it runs: DuckDB "
                        "in-process has no file system, network or extension access, --unsafe-sql included")
    assert sorted(os.listdir(tmp_path)) == before and os.listdir(home) == []


def test_unsafe_sql_statements_in_memory_still_run(capture_dir, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    r = CliRunner().invoke(cli, ["replay", capture_dir, "--format", "jsonl", "--unsafe-sql", "--sql",
                                 "CREATE TABLE t AS SELECT count(*) AS n FROM documents; SELECT n FROM t"],
                           catch_exceptions=False)
    assert r.exit_code == 0 and int(r.stdout.split(":")[1].strip(" }\n")) > 0, r.output
    assert os.listdir(tmp_path) == []


def test_a_secret_is_never_stored_nor_its_extension_fetched(capture_dir, tmp_path, monkeypatch):
    """CREATE PERSISTENT SECRET binds on a connection with no extension autoloading and no file
    access: refused by DuckDB's fence, nothing under ~/.duckdb."""
    home = tmp_path / "home"
    home.mkdir()
    monkeypatch.setenv("HOME", str(home))
    monkeypatch.chdir(tmp_path)
    r = CliRunner().invoke(cli, ["replay", capture_dir, "--unsafe-sql", "--sql",
                                 "CREATE PERSISTENT SECRET s (TYPE s3, KEY_ID 'k', SECRET 'v')"],
                           catch_exceptions=False)
    assert r.exit_code == 2 and "Permission Error" in r.stderr, r.output
    assert os.listdir(home) == []
