"""`replay --apply` finds modules in the working directory and by path, and `--out` works
with every table and with --checksum (issue 15 items 6 and 7); local engine, CliRunner."""

from __future__ import annotations

import json
import os
import sys

import pyarrow.parquet as pq
import pytest
from click.testing import CliRunner

from dcptool.cli import cli
from dcptool.replay import apply
from dcptool.replay.local import engine as local
from dcptool.replay.rules import tables as T
from dcptool.replay.store import reader
from tests.support import capgen
from tests.support.paths import FIXTURES

MODULE = '''
import pyarrow as pa

def frames_per_group(key, table):
    return pa.table({"key": [str(key)], "frames": [table.num_rows], "tag": ["%s"]})
'''


def _capture(tmp_path, protocol="dcp", s=4):
    d = tmp_path / f"caps-{protocol}"
    capgen.write_captures(capgen.generate(protocol, s, n_events=120), str(d), seed=s)
    return str(d)


def _run(*args):
    return CliRunner().invoke(cli, ["replay", *args], catch_exceptions=False)


def _expected(d, tag):
    import pyarrow as pa

    def fn(key, table):
        return pa.table({"key": [str(key)], "frames": [table.num_rows], "tag": [tag]})
    return apply.apply_local(reader.find_captures([d]), fn).to_pylist()


@pytest.fixture
def clean_modules():
    before = set(sys.modules)
    path = list(sys.path)
    yield
    for name in set(sys.modules) - before:
        if name.startswith("cs_apply_"):
            del sys.modules[name]
    sys.path[:] = path


def test_apply_module_in_the_working_directory(tmp_path, monkeypatch, clean_modules):
    d = _capture(tmp_path)
    work = tmp_path / "work"
    work.mkdir()
    (work / "cs_apply_cwd.py").write_text(MODULE % "cwd")
    monkeypatch.chdir(work)
    r = _run(d, "--apply", "cs_apply_cwd:frames_per_group", "--format", "jsonl")
    assert r.exit_code == 0, r.output
    assert [json.loads(x) for x in r.stdout.splitlines()] == _expected(d, "cwd")


@pytest.mark.parametrize("form", ["relative", "absolute"])
def test_apply_by_path(tmp_path, monkeypatch, clean_modules, form):
    d = _capture(tmp_path)
    lib = tmp_path / "lib"
    lib.mkdir()
    name = f"cs_apply_path_{form}"
    (lib / f"{name}.py").write_text(MODULE % form)
    monkeypatch.chdir(tmp_path)
    spec = f"./lib/{name}.py:frames_per_group" if form == "relative" else f"{lib}/{name}.py:frames_per_group"
    r = _run(d, "--apply", spec, "--format", "jsonl")
    assert r.exit_code == 0, r.output
    assert [json.loads(x) for x in r.stdout.splitlines()] == _expected(d, form)


def test_apply_example_in_fixtures(tmp_path, clean_modules):
    d = _capture(tmp_path, "synapse")
    r = _run(d, "--apply", f"{FIXTURES}/apply_example.py:summarise", "--format", "jsonl")
    assert r.exit_code == 0, r.output
    rows = [json.loads(x) for x in r.stdout.splitlines()]
    frames = reader.read_capture_table(reader.find_captures([d]))
    ins = [r for r in frames.select(["direction", "stream"]).to_pylist() if r["direction"] == "in" and r["stream"]]
    assert rows and sum(r["frames"] for r in rows) == len(ins)
    assert all(sum(json.loads(r["ops"]).values()) == r["frames"] for r in rows)


@pytest.mark.parametrize("spec, says", [
    ("cs_apply_missing_xyz:f", "no module named 'cs_apply_missing_xyz'"),
    ("./nowhere/cs_apply_gone.py:f", "no such file ./nowhere/cs_apply_gone.py"),
    ("cs_apply_attr:nope", "has no 'nope'"),
    ("just_a_name", "wants module:function"),
])
def test_apply_that_cannot_be_found_is_one_line_and_exit_2(tmp_path, monkeypatch, clean_modules, spec, says):
    d = _capture(tmp_path)
    (tmp_path / "cs_apply_attr.py").write_text(MODULE % "x")
    monkeypatch.chdir(tmp_path)
    r = _run(d, "--apply", spec)
    assert r.exit_code == 2 and r.stdout == ""
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and says in lines[0] and spec in lines[0], r.stderr


def test_out_with_checksum_creates_the_directory_for_every_table(tmp_path):
    d = _capture(tmp_path)
    out = tmp_path / "results2" / "nested"
    r = _run(d, "--table", "frames", "--out", str(out), "--checksum")
    assert r.exit_code == 0, r.output
    rep = local.replay_local(reader.find_captures([d]))
    frames = pq.read_table(out / "frames.parquet")
    assert frames.equals(rep.table("frames"))
    assert r.stdout.splitlines() == [f"{T.checksum('frames', rep.table('frames'))}  frames"]
    out2 = tmp_path / "all"
    r = _run(d, "--table", "all", "--out", str(out2), "--checksum", "--format", "jsonl")
    assert r.exit_code == 0, r.output
    sums = {x["table"]: x["sha256"] for x in map(json.loads, r.stdout.splitlines())}
    assert sorted(os.listdir(out2)) == sorted(f"{n}.parquet" for n in rep.names())
    for name in rep.names():
        assert pq.read_table(out2 / f"{name}.parquet").equals(rep.table(name)), name
        assert sums[name] == T.checksum(name, rep.table(name))


def test_out_with_apply_writes_the_apply_table(tmp_path, clean_modules):
    d = _capture(tmp_path)
    out = tmp_path / "applied"
    r = _run(d, "--apply", f"{FIXTURES}/apply_example.py:summarise", "--out", str(out))
    assert r.exit_code == 0, r.output
    assert r.stdout == ""
    assert pq.read_table(out / "apply.parquet").num_rows > 0
