"""`dcptool.replay.replay`, the library call under `dcptool replay` (issue 35): the three lines
of docs/REPLAY.md "From Python" run as written, without click, and give the command's checksums;
the call's other paths give what the command gives."""

from __future__ import annotations

import ast
import json
import os
import re
import subprocess
import sys

import pyarrow.parquet as pq
import pytest
from click.testing import CliRunner

from dcptool.cli import cli
from dcptool.replay import ApplyLoadError, Hooks, RequestError, replay
from dcptool.replay.local import engine as local
from dcptool.replay.store import reader
from tests.support import capgen
from tests.support.paths import ROOT


@pytest.fixture(scope="module")
def workdir(tmp_path_factory):
    d = tmp_path_factory.mktemp("library")
    capgen.write_captures(capgen.generate("dcp", 13, n_events=200), str(d / "caps"), seed=13)
    return d


def _doc_lines() -> str:
    text = (ROOT / "docs" / "REPLAY.md").read_text()
    section = text.split("## From Python", 1)[1]
    return re.search(r"```python\n(.*?)```", section, re.S).group(1)


def _cli(*args) -> str:
    r = CliRunner().invoke(cli, ["replay", *args], catch_exceptions=False)
    assert r.exit_code == 0, r.output
    return r.stdout


def test_the_three_lines_of_replay_md_give_the_commands_checksums(workdir, monkeypatch):
    lines = _doc_lines()
    assert len(lines.strip().splitlines()) == 3
    code = lines + ("import sys\n"
                    "sys.stderr.write('LOADED:' + ','.join(m for m in ('click', 'rich', 'dcptool.cli') "
                    "if m in sys.modules))\n")
    out = subprocess.run([sys.executable, "-c", code], cwd=str(workdir), capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stderr.strip().endswith("LOADED:"), out.stderr      # no click, no rich, no CLI
    got = ast.literal_eval(out.stdout.strip())
    monkeypatch.chdir(workdir)
    want = [line.split("  ") for line in _cli("caps/", "--checksum").splitlines()]
    assert [(name, digest) for digest, name in want] == [(n, d) for n, (d, _) in got.items()]
    assert all(rows >= 0 for _, rows in got.values()) and got["documents"][1] > 0


def test_tables_sql_and_as_of_are_the_commands(workdir):
    caps = str(workdir / "caps")
    files = reader.find_captures([caps])
    result = replay(caps, tables=["documents", "vbuckets"])
    want = local.replay_local(files)
    assert list(result.tables) == ["documents", "vbuckets"] and result.engine == "in-process"
    assert result.tables["documents"].equals(want.table("documents"))
    assert result.tables["vbuckets"].equals(want.table("vbuckets"))
    got = replay(caps, sql="SELECT count(*) AS n FROM documents").tables["sql"]
    assert got.column("n").to_pylist() == [want.table("documents").num_rows]
    docs = want.table("documents")
    seqno = sorted(docs.column("by_seqno").to_pylist())[len(docs) // 2]
    vb = docs.column("vbucket")[0].as_py()
    cut = replay(caps, "documents", as_of_seqnos={vb: seqno}, checksum=True).checksums
    assert cut == json_sums(_cli(caps, "--table", "documents", "--as-of-seqno", f"{vb}:{seqno}",
                                 "--checksum", "--format", "jsonl"))


def json_sums(stdout: str) -> dict:
    return {r["table"]: (r["sha256"], r["rows"]) for r in map(json.loads, stdout.splitlines())}


def test_output_streams_to_files_and_hooks_hear_them(workdir, tmp_path):
    caps = str(workdir / "caps")
    heard = []

    class Listen(Hooks):
        def wrote(self, path, rows):
            heard.append((path, rows))

    result = replay(caps, ["documents", "failover"], output=tmp_path / "out", hooks=Listen())
    assert result.tables == {} and result.written == heard and len(heard) == 2
    want = local.replay_local(reader.find_captures([caps]))
    for path, rows in heard:
        name = os.path.basename(path).removesuffix(".parquet")
        assert pq.read_table(path).equals(want.table(name)) and rows == want.table(name).num_rows
    kept = replay(caps, "documents", output=tmp_path / "kept", keep=True)
    assert kept.tables["documents"].equals(want.table("documents"))


def test_errors_are_typed(workdir):
    caps = str(workdir / "caps")
    with pytest.raises(RequestError, match="choose one of --sql, --apply, --checksum"):
        replay(caps, sql="SELECT 1", checksum=True)
    with pytest.raises(RequestError, match="unknown table 'nope'"):
        replay(caps, "nope")
    with pytest.raises(RequestError, match="is a capture directory"):
        replay(caps, output=caps)
    with pytest.raises(ApplyLoadError, match="--apply no_such_module_xyz:f"):
        replay(caps, apply="no_such_module_xyz:f")
