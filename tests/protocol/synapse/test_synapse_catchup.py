"""Catch-up of missed Synapse rows (issue 38): the sans-IO planning and answer checks
(protocol/synapse/catchup.py), the catch-up endpoint of `serve synapse --http-port`, and
`capture --catch-up` filling the gaps a server made by skipping rows between connections:
replay's rows then equal those of a capture that saw everything live, `gaps` is empty and
`verify` exits 0; without --catch-up the gap stays as before."""

from __future__ import annotations

import json
import pathlib

import orjson
import pyarrow.compute as pc
import pytest
from click.testing import CliRunner

from dcptool.cli import cli
from dcptool.protocol.errors import RemoteError
from dcptool.protocol.synapse import catchup
from dcptool.protocol.synapse.server import Feed, catch_up_answer, generated_lines
from dcptool.replay.store.reader import find_captures, read_capture_table
from tests.support.synapse_serve import fast_capture_knobs

SECRET = "catch-up-test-secret-9f3a"   # a throwaway secret for a throwaway server
GREETING = 2 + 18


@pytest.fixture(autouse=True)
def fast_knobs(monkeypatch):
    fast_capture_knobs(monkeypatch)


def run(*args, env=None):
    return CliRunner().invoke(cli, list(args), env={"DCPTOOL_PASSWORD": None, **(env or {})})


# -- sans-IO ----------------------------------------------------------------------------------

def test_page_lines_batch_rows_sharing_a_token_as_synapse_does():
    page = catchup.parse_page(b'{"updates":[[5,["ev",["$a"]]],[6,["state",[1]]],[6,["ev",["$b"]]],'
                              b'[7,["ev",["\\u00e9"]]]],"upto_token":9,"limited":false}', 4, 9)
    lines = catchup.page_lines("events", "master", page, 4, 9)
    assert lines == ['RDATA events master 5 ["ev",["$a"]]',
                     'RDATA events master batch ["state",[1]]',
                     'RDATA events master 6 ["ev",["$b"]]',
                     'RDATA events master 7 ["ev",["\\u00e9"]]',   # ASCII escapes, as Synapse's encoder
                     "POSITION events master 4 9"]


@pytest.mark.parametrize("body", [
    b"not json", b"[]", b'{"updates":[],"upto_token":"9","limited":false}',
    b'{"updates":[[3,[]]],"upto_token":9,"limited":false}',          # a token at or below from
    b'{"updates":[[7,[]],[6,[]]],"upto_token":9,"limited":false}',   # tokens going back
    b'{"updates":[[12,[]]],"upto_token":12,"limited":false}',        # above what was asked
    b'{"updates":[],"upto_token":4,"limited":true}',                 # a page that makes no progress
])
def test_answers_that_are_not_what_was_asked_are_refused(body):
    with pytest.raises(RemoteError):
        catchup.parse_page(body, 4, 9)


def test_fetch_pages_until_the_writer_is_not_limited():
    feed = Feed(generated_lines(3, 400), keep_history=True)
    feed.take(400)
    committed = 1
    end = feed.tokens[("events", "master")]
    fetch = catchup.fetch_for("events", "master", committed, end)
    got = []
    while not fetch.done:
        status, body = catch_up_answer(feed, fetch.target("t1"), None, None)
        assert status == 200
        got += fetch.answered(body)
    assert fetch.pages > 1          # 400 lines of mostly events: more than one 100-row page
    live = [line for line in generated_lines(3, 400) if line.startswith("RDATA events ")]
    assert [line for line in got if line.startswith("RDATA")] == live


def test_endpoint_checks_the_secret_and_the_stream():
    feed = Feed(generated_lines(3, 50), keep_history=True)
    feed.take(50)
    target = catchup.request_target("events", 1, 5, "t")
    assert catch_up_answer(feed, target, None, SECRET)[0] == 401
    assert catch_up_answer(feed, target, "Bearer wrong", SECRET)[0] == 401
    assert catch_up_answer(feed, target, f"Bearer {SECRET}", SECRET)[0] == 200
    assert catch_up_answer(feed, catchup.request_target("nosuch", 1, 5, "t"), None, None)[0] == 400
    assert catch_up_answer(feed, "/elsewhere", None, None)[0] == 404


# -- against serve synapse ------------------------------------------------------------------------

def _tables(directory, *names) -> dict:
    res = run("replay", str(directory), "--format", "jsonl", *[a for n in names for a in ("--table", n)])
    assert res.exit_code == 0, res.stderr
    out: dict = {n: [] for n in names}
    for line in res.stdout.splitlines():
        row = orjson.loads(line)
        out[row.pop("table") if len(names) > 1 else names[0]].append(row)
    return out


def _content(rows):
    return sorted((r["stream"], r["instance"], r["token"], r["index"], r["row"]) for r in rows)


def _capture(serve, directory, *extra, skip="20", env=None, catch=True):
    s = serve("--items", "300", "--drop-after", "100", "--skip-on-reconnect", skip, "--seed", "4",
              "--http-port", "0")
    # three connections of 100 lines each but the last (300 items, `skip` dropped twice)
    args = ["capture", f"synapse://{s.address}", "-o", str(directory), "--quiet", "--json",
            "--max-messages", str(3 * GREETING + 300 - 2 * int(skip)), "--duration", "30s", *extra]
    if catch:
        args += ["--catch-up", f"master=http://{s.http}"]
    res = run(*args, env=env)
    assert res.exit_code == 0, res.stderr
    return s, res


def test_capture_catches_up_what_the_server_skipped(serve, tmp_path):
    live_dir, caught_dir = tmp_path / "live", tmp_path / "caught"
    _capture(serve, live_dir, skip="0", catch=False)           # everything live
    _, res = _capture(serve, caught_dir)
    summary = orjson.loads(res.stdout)
    assert summary["gaps"] and summary["gaps_filled"] == len(summary["gaps"])
    assert summary["caught_up_rows"] > 0 and summary["catch_up_failed"] == []
    live, caught = _tables(live_dir, "rows", "gaps"), _tables(caught_dir, "rows", "gaps")
    assert caught["gaps"] == []
    assert _content(caught["rows"]) == _content(live["rows"])
    # the caught-up lines are marked: direction catch-up, channel catch-up, the request went out
    files = [f for f in find_captures([str(caught_dir)]) if f.protocol == "synapse"]
    t = read_capture_table(files)
    direction = t.column("direction").to_pylist()
    assert direction.count("catch-up") >= summary["caught_up_rows"]
    gets = [r for r, d in zip(t.column("raw").to_pylist(), direction) if d == "out" and r.startswith(b"GET ")]
    assert gets and all(b"get_repl_stream_updates/" in g for g in gets)
    verify = run("verify", str(caught_dir))
    assert verify.exit_code == 0, verify.stdout + verify.stderr
    report = run("report", str(caught_dir), "-o", str(tmp_path / "r.html"), "--no-verify")
    assert report.exit_code == 0, report.stderr
    assert f"{summary['caught_up_rows']:,} rows caught up" in (tmp_path / "r.html").read_text()
    inspect = orjson.loads(run("inspect", str(caught_dir), "--json").stdout)
    assert inspect["caught_up_rows"] == summary["caught_up_rows"] and inspect["gaps"] == []
    assert inspect["directions"]["catch-up"] >= summary["caught_up_rows"]


def test_without_catch_up_the_gap_stays(serve, tmp_path):
    _capture(serve, tmp_path, catch=False)
    gaps = _tables(tmp_path, "gaps")["gaps"]
    assert gaps and gaps[0]["stream"] == "events"
    assert run("verify", str(tmp_path)).exit_code == 6


def test_a_writer_that_refuses_leaves_the_gap_and_one_warning(serve, tmp_path, monkeypatch):
    monkeypatch.setenv("DCPTOOL_REPLICATION_SECRET", SECRET)      # the server's secret
    s = serve("--items", "300", "--drop-after", "100", "--skip-on-reconnect", "20", "--seed", "4",
              "--http-port", "0")
    res = run("capture", f"synapse://{s.address}", "-o", str(tmp_path), "--json",
              "--max-messages", str(3 * GREETING + 260), "--duration", "30s",
              "--catch-up", f"master=http://{s.http}", env={"DCPTOOL_REPLICATION_SECRET": SECRET + "x"})
    assert res.exit_code == 0, res.stderr
    summary = orjson.loads(res.stdout)
    assert summary["gaps_filled"] == 0 and summary["catch_up_failed"]
    assert "catch-up of events/master" in res.stderr and "HTTP 200" not in res.stderr
    assert _tables(tmp_path, "gaps")["gaps"]


def test_the_secret_never_reaches_the_capture(serve, tmp_path, monkeypatch):
    monkeypatch.setenv("DCPTOOL_REPLICATION_SECRET", SECRET)
    s = serve("--items", "300", "--drop-after", "100", "--skip-on-reconnect", "20", "--seed", "4",
              "--http-port", "0")
    res = run("capture", f"synapse://{s.address}", "-o", str(tmp_path), "--json",
              "--max-messages", str(3 * GREETING + 260), "--duration", "30s",
              "--catch-up", f"master=http://{s.http}", env={"DCPTOOL_REPLICATION_SECRET": SECRET})
    assert res.exit_code == 0, res.stderr
    summary = orjson.loads(res.stdout)
    assert summary["gaps_filled"] >= 1, res.stderr          # the server checked the secret
    files = [f for f in find_captures([str(tmp_path)]) if f.protocol == "synapse"]
    t = read_capture_table(files)
    assert not pc.any(pc.match_substring(t.column("raw").cast("string"), SECRET)).as_py()
    for f in pathlib.Path(tmp_path).rglob("*"):
        if f.is_file():
            assert SECRET.encode() not in f.read_bytes(), f
    assert SECRET not in res.stdout + res.stderr


def test_catch_up_option_is_checked_before_connecting(tmp_path):
    for bad in ("master", "master=ftp://x", "=http://x", "bad name=http://127.0.0.1:1"):
        res = run("capture", "synapse://127.0.0.1:1", "-o", str(tmp_path), "--catch-up", bad)
        assert res.exit_code == 2, (bad, res.stderr)
        assert "--catch-up" in res.stderr
    res = run("capture", "couchbase://127.0.0.1:1/default", "-o", str(tmp_path),
              "--catch-up", "master=http://127.0.0.1:1")
    assert res.exit_code == 2 and "Synapse" in res.stderr


def test_resume_catches_up_from_the_last_recorded_token(serve, tmp_path):
    s = serve("--items", "3000", "--seed", "5", "--rate", "2000", "--http-port", "0")
    first = run("capture", f"synapse://{s.address}", "-o", str(tmp_path), "--quiet", "--json",
                "--max-messages", str(GREETING + 100), "--duration", "30s",
                "--catch-up", f"master=http://{s.http}")
    assert first.exit_code == 0, first.stderr
    # meanwhile the writer moves on: a second client reads 100 lines the capture never sees
    other = run("stream", f"synapse://{s.address}", "--max-messages", str(GREETING + 100), "--duration", "30s")
    assert other.exit_code == 0, other.stderr
    second = run("capture", f"synapse://{s.address}", "-o", str(tmp_path), "--quiet", "--json", "--resume",
                 "--max-messages", str(GREETING + 90), "--duration", "30s",
                 "--catch-up", f"master=http://{s.http}")
    assert second.exit_code == 0, second.stderr
    summary = orjson.loads(second.stdout)
    assert summary["gaps_filled"] >= 1 and summary["caught_up_rows"] > 0
    assert _tables(tmp_path, "gaps")["gaps"] == []
    rows = _tables(tmp_path, "rows")["rows"]
    events = sorted(r["token"] for r in rows if r["stream"] == "events")
    expected = sorted({int(line.split(" ")[3]) for line in generated_lines(5, 3000)
                       if line.startswith("RDATA events ") and line.split(" ")[3] != "batch"})
    assert sorted(set(events)) == [t for t in expected if t <= max(events)]
    assert json.dumps(summary)   # the summary is JSON (no bytes, no secret objects)
