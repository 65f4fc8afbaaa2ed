"""`dcptool stream|capture synapse://` against `dcptool serve synapse` over loopback:
handshake, capture contents, keep-alive, reconnect and resume from committed tokens,
over-long lines, ERROR from the server, SERVER name mismatch, connection refused."""

from __future__ import annotations

import orjson
import pytest
from click.testing import CliRunner

from dcptool.capture import synapse_capture
from dcptool.cli import cli
from dcptool.protocol.synapse.server import generated_lines
from dcptool.replay.store.reader import find_captures, read_capture_table
from tests.support.ports import refused_port
from tests.support.synapse_serve import fast_capture_knobs

pytestmark = pytest.mark.integration


@pytest.fixture(autouse=True)
def fast_knobs(monkeypatch):
    fast_capture_knobs(monkeypatch)


def run(*args, env=None):
    return CliRunner().invoke(cli, list(args), env=env or {"DCPTOOL_PASSWORD": None})


def capture_rows(directory) -> list[dict]:
    files = [f for f in find_captures([str(directory)]) if f.protocol == "synapse"]
    return read_capture_table(files).to_pylist()


GREETING = 2 + 18  # SERVER, PING, then a POSITION per announced stream


def test_stream_jsonl_handshake_and_rows(serve):
    s = serve("--items", "50", "--seed", "5")
    res = run("stream", f"synapse://{s.address}?server_name=localhost", "--format", "jsonl",
              "--max-messages", str(GREETING + 50), "--duration", "20s", "--name", "t1")
    assert res.exit_code == 0, res.stderr
    rows = [orjson.loads(l) for l in res.stdout.splitlines()]
    out = [r for r in rows if r["direction"] == "out"]
    assert [r["command"] for r in out[:3]] == ["NAME", "PING", "REPLICATE"]
    assert out[0]["args"] == "t1"
    inn = [r for r in rows if r["direction"] == "in"]
    assert [r["command"] for r in inn[:2]] == ["SERVER", "PING"]
    # the server's keep-alive PINGs come every few seconds and may fall anywhere in a slow run
    later = [r["command"] for r in inn[2:] if r["command"] != "PING"]
    assert later[:18] == ["POSITION"] * 18
    rdata = [r for r in inn if r["command"] == "RDATA"]
    keepalives = sum(r["command"] == "PING" for r in inn[2:])   # each counts in --max-messages
    want = list(generated_lines(5, 50 - keepalives))
    assert [r["row"] for r in rdata] == [l.split(" ", 4)[4] for l in want]
    assert all(r["fields"] for r in rdata)
    assert [r["frame_no"] for r in rows] == list(range(len(rows)))


def test_stream_table_decodes_fields_and_filters_streams(serve):
    s = serve("--items", "200", "--seed", "2")
    res = run("stream", f"synapse://{s.address}", "--format", "table", "--streams", "events",
              "--max-messages", "6", "--duration", "20s")
    assert res.exit_code == 0, res.stderr
    assert "row_type=ev" in res.stdout and "event_id=$" in res.stdout
    assert "backfill" not in res.stdout and "typing" not in res.stdout


def test_capture_holds_every_line_exactly(serve, tmp_path):
    s = serve("--items", "3000", "--seed", "9")
    res = run("capture", f"synapse://{s.address}", "-o", str(tmp_path), "--quiet", "--json",
              "--max-messages", str(GREETING + 3000), "--duration", "30s")
    assert res.exit_code == 0, res.stderr
    summary = orjson.loads(res.stdout)
    assert summary["gaps"] == [] and summary["received"] == GREETING + 3000
    rows = capture_rows(tmp_path)
    assert [r["frame_no"] for r in rows] == list(range(len(rows)))
    assert {r["capture_id"] for r in rows} == {summary["capture_id"]}
    rdata = [r for r in rows if r["command"] == "RDATA"]
    assert [r["raw"].decode() for r in rdata] == list(generated_lines(9, 3000))
    for r in rdata:
        assert r["direction"] == "in" and r["channel"] is None and r["decode_error"] is None
        assert r["batch"] == (r["token"] is None)
        assert r["raw"].decode().endswith(" " + r["row"])
    pos = [r for r in rows if r["command"] == "POSITION"]
    assert len(pos) == 18 and all(r["prev_token"] == r["new_token"] for r in pos)
    last_events = max(r["token"] for r in rdata if r["stream"] == "events" and r["token"])
    assert summary["committed"]["events/master"] == last_events


def test_keepalive_drops_a_silent_server(serve, tmp_path, monkeypatch):
    monkeypatch.setitem(synapse_capture.DEFAULTS, "ping_interval", 0.05)
    monkeypatch.setitem(synapse_capture.DEFAULTS, "timeout", 0.3)
    monkeypatch.setitem(synapse_capture.DEFAULTS, "max_reconnects", 1)
    s = serve("--silent-after", "0")
    res = run("capture", f"synapse://{s.address}", "-o", str(tmp_path), "--quiet",
              "--duration", "30s")
    assert res.exit_code == 1, res.stderr
    assert "nothing received" in res.stderr
    rows = capture_rows(tmp_path)
    # two connections (one reconnect), each: greeting in, then only our PINGs going out
    assert sorted({r["conn"] for r in rows}) == [1, 2]
    for conn in (1, 2):
        mine = [r for r in rows if r["conn"] == conn]
        assert [r["command"] for r in mine if r["direction"] == "in"] == ["SERVER", "PING"]
        assert sum(1 for r in mine if r["direction"] == "out" and r["command"] == "PING") >= 2


def test_reconnect_continues_from_committed_tokens_without_gap(serve, tmp_path):
    s = serve("--items", "300", "--drop-after", "100", "--seed", "4")
    res = run("capture", f"synapse://{s.address}", "-o", str(tmp_path), "--quiet", "--json",
              "--max-messages", str(3 * (GREETING + 100)), "--duration", "30s")
    assert res.exit_code == 0, res.stderr
    summary = orjson.loads(res.stdout)
    assert summary["gaps"] == []
    rows = capture_rows(tmp_path)
    assert sorted({r["conn"] for r in rows}) == [1, 2, 3]
    rdata = [r for r in rows if r["command"] == "RDATA"]
    assert [r["raw"].decode() for r in rdata] == list(generated_lines(4, 300))
    # after each reconnect the events POSITION starts where the last numeric RDATA ended
    for conn in (2, 3):
        before = [r["token"] for r in rdata if r["conn"] == conn - 1 and r["stream"] == "events"
                  and r["token"] is not None][-1]
        pos = next(r for r in rows if r["conn"] == conn and r["command"] == "POSITION"
                   and r["stream"] == "events")
        assert pos["prev_token"] == before


def test_reconnect_reports_a_gap_when_the_server_skipped_rows(serve, tmp_path):
    s = serve("--items", "300", "--drop-after", "100", "--skip-on-reconnect", "20", "--seed", "4")
    res = run("capture", f"synapse://{s.address}", "-o", str(tmp_path), "--quiet", "--json",
              "--max-messages", str(2 * (GREETING + 100)), "--duration", "30s")
    assert res.exit_code == 0, res.stderr
    gaps = orjson.loads(res.stdout)["gaps"]
    assert gaps and gaps[0]["stream"] == "events" and gaps[0]["kind"] == "missed"
    assert gaps[0]["prev_token"] > gaps[0]["committed"]


def test_resume_seeds_committed_tokens_from_the_previous_capture(serve, tmp_path):
    s = serve("--items", "200", "--drop-after", "100", "--seed", "6")
    first = run("capture", f"synapse://{s.address}", "-o", str(tmp_path), "--quiet", "--json",
                "--max-messages", str(GREETING + 100), "--duration", "30s")
    assert first.exit_code == 0, first.stderr
    committed = orjson.loads(first.stdout)["committed"]
    second = run("capture", f"synapse://{s.address}", "-o", str(tmp_path), "--quiet", "--json",
                 "--resume", "--max-messages", str(GREETING + 100), "--duration", "30s")
    assert second.exit_code == 0, second.stderr
    s2 = orjson.loads(second.stdout)
    assert s2["gaps"] == []
    rows = capture_rows(tmp_path)
    assert len({r["capture_id"] for r in rows}) == 2
    rdata = [r for r in rows if r["command"] == "RDATA"]
    assert [r["raw"].decode() for r in rdata] == list(generated_lines(6, 200))
    assert s2["committed"]["events/master"] > committed["events/master"]
    # and without the previous tokens a resumed run that missed rows says so
    s.stop()
    s3 = serve("--items", "200", "--seed", "6", "--skip-on-reconnect", "0")
    third = run("capture", f"synapse://{s3.address}", "-o", str(tmp_path), "--quiet", "--json",
                "--resume", "--max-messages", str(GREETING), "--duration", "30s")
    assert third.exit_code == 0, third.stderr
    gaps = orjson.loads(third.stdout)["gaps"]
    # a fresh server starts its tokens again: every stream we had moved forward rewinds
    assert any(g["stream"] == "events" and g["kind"] == "rewind" for g in gaps)


def test_over_long_line_is_a_protocol_error_and_keeps_what_came_before(serve, tmp_path):
    s = serve("--items", "100", "--long-line-after", "5", "--seed", "3")
    res = run("capture", f"synapse://{s.address}", "-o", str(tmp_path), "--quiet",
              "--duration", "30s")
    assert res.exit_code == 5, res.stderr
    assert "longer than 16384" in res.stderr
    rows = capture_rows(tmp_path)
    rdata = [r for r in rows if r["command"] == "RDATA" and r["decode_error"] is None]
    assert [r["raw"].decode() for r in rdata] == list(generated_lines(3, 5))
    bad = rows[-1]
    assert "longer than 16384" in bad["decode_error"] and len(bad["raw"]) > 16384


def test_error_from_the_server_ends_with_exit_5(serve, tmp_path):
    s = serve("--items", "100", "--error-after", "3")
    res = run("capture", f"synapse://{s.address}", "-o", str(tmp_path), "--quiet",
              "--duration", "30s")
    assert res.exit_code == 5, res.stderr
    assert "scripted error" in res.stderr
    rows = capture_rows(tmp_path)
    assert rows[-1]["command"] == "ERROR" and rows[-1]["args"] == "dcptool serve: scripted error"
    assert sum(1 for r in rows if r["command"] == "RDATA") == 3


def test_server_name_mismatch_exits_5(serve):
    s = serve("--server-name", "real.example")
    res = run("stream", f"synapse://{s.address}?server_name=other.example", "--format", "jsonl",
              "--duration", "20s")
    assert res.exit_code == 5
    assert "real.example" in res.stderr and "other.example" in res.stderr
    commands = [orjson.loads(l)["command"] for l in res.stdout.splitlines()]
    assert "SERVER" in commands


def test_connection_refused_exits_3():
    with refused_port() as port:
        res = run("stream", f"synapse://127.0.0.1:{port}", "--duration", "5s")
    assert res.exit_code == 3
    assert "cannot connect" in res.stderr


def test_serve_answers_nonsense_with_error(serve):
    import socket
    s = serve("--items", "0")
    host, port = s.address.rsplit(":", 1)
    with socket.create_connection((host, int(port)), timeout=10) as sock:
        f = sock.makefile("rwb")
        assert f.readline() == b"SERVER localhost\n"
        assert f.readline().startswith(b"PING ")
        f.write(b"HELLO there\n")
        f.flush()
        assert f.readline() == b"ERROR invalid command: HELLO\n"


def test_inspect_and_resume_agree_with_the_live_run(serve, tmp_path):
    """What `inspect` and `capture --resume` read back from a capture with a gap equals what
    the live run saw (the one Synapse resume, replay/store/resume.py, and inspect's pass)."""
    from dcptool.replay.check.summary import summarize
    from dcptool.replay.store.resume import synapse_resume_state
    s = serve("--items", "300", "--drop-after", "100", "--skip-on-reconnect", "20", "--seed", "4")
    res = run("capture", f"synapse://{s.address}", "-o", str(tmp_path), "--quiet", "--json",
              "--max-messages", str(2 * (GREETING + 100)), "--duration", "30s")
    assert res.exit_code == 0, res.stderr
    live = orjson.loads(res.stdout)
    summary = summarize([str(tmp_path)])
    assert [(g["stream"], g["instance"], g["from_token"], g["to_token"]) for g in summary["gaps"]] == \
        [(g["stream"], g["instance"], g["committed"], g["prev_token"]) for g in live["gaps"]] and live["gaps"]
    committed = {f"{st}/{i}": t for (st, i), t in sorted(synapse_resume_state([tmp_path]).items())}
    assert committed == live["committed"]
    assert summary["commands"]["RDATA"] == 200 and summary["commands"]["POSITION"] == 36
    ev = next(p for p in summary["positions"] if (p["stream"], p["instance"]) == ("events", "master"))
    assert ev["rows"] > 150 and ev["token"] == live["committed"]["events/master"]