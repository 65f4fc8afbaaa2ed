"""Issue 39, findings 2: what a person sees on a real 100-column terminal (tmux, read back
with capture-pane: a line the terminal wrapped is two lines there). `stream` of a Synapse
source, `trace` of a key whose explanation is a long sentence and `verify --explain` (the
failover logs' JSON) show no id, key, number or word split over two lines; the live
`stream` table prints its header once, a `ts` column, and none of the handshake rows."""

from __future__ import annotations

import json
import os
import re
import subprocess

import orjson
import pytest

from tests.support import tmux_screen
from tests.support.paths import DCPTOOL
from tests.support.synapse_serve import ServeSynapse

pytestmark = [pytest.mark.integration,
              pytest.mark.skipif(not tmux_screen.available(), reason="tmux is not installed")]
WIDTH = 100
TS_AT_START = re.compile(r"^\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{9}Z ")


def _pipe(*args: str) -> list[dict]:
    res = subprocess.run([DCPTOOL, *args, "--format", "jsonl"], capture_output=True, text=True, timeout=120)
    assert res.returncode in (0, 6), res.stderr
    return [json.loads(line) for line in res.stdout.splitlines()]


def _capdir(failover_capture) -> str:
    """The directory of the session's failover capture (tests/conftest.py)."""
    _, files = failover_capture
    return os.path.dirname(files[0].path)


def _whole(lines: list[str], texts: list[str]) -> None:
    """Every occurrence of every text is whole on one line of the screen: each is found on
    the screen exactly as often as the rows hold it (a split one is not found)."""
    assert texts
    for t in set(texts):
        assert sum(ln.count(t) for ln in lines) == texts.count(t), (t, "\n".join(lines))


def _tokens_in_order(lines: list[str], text: str) -> None:
    """The words of `text`, in order and each whole, among the words on the screen."""
    screen = " " + " ".join(" ".join(ln.split()) for ln in lines) + " "
    assert " " + " ".join(text.split()) + " " in screen, (text, "\n".join(lines))


def test_stream_of_a_synapse_source_keeps_every_id_whole(tmp_path):
    """Two servers of the same seed serve the same lines: one to a pipe (the ids the rows
    hold), one to the terminal."""
    args = ["--items", "400", "--seed", "5"]
    with ServeSynapse(*args) as a:
        rows = _pipe("stream", f"synapse://{a.address}", "--max-messages", "60")
    rdata = [r for r in rows if r["command"] == "RDATA"]
    ids = [v for r in rdata for v in (r["fields"] or {}).values() if isinstance(v, str) and len(v) > 12]
    assert len(rdata) >= 30 and any(i.startswith("$") for i in ids) and any(i.startswith("!") for i in ids)
    with ServeSynapse(*args) as b:
        lines, code = tmux_screen.run_on_terminal([DCPTOOL, "stream", f"synapse://{b.address}", "--max-messages",
                                                   "60"], width=WIDTH, tmpdir=str(tmp_path))
    assert code == 0, "\n".join(lines)
    assert max(map(len, lines)) <= WIDTH
    _whole(lines, ids)
    # the header once, with a ts column; a row per RDATA line and no handshake row
    heads = [ln for ln in lines if ln.split()[:2] == ["ts", "frame_no"]]
    assert len(heads) == 1 and "direction" not in heads[0]
    shown = [ln for ln in lines if TS_AT_START.match(ln)]
    assert len(shown) == len(rdata) and all(" RDATA " in ln for ln in shown)
    assert not any(w in ln.split() for ln in lines for w in ("NAME", "PING", "REPLICATE", "SERVER"))


def test_stream_with_v_shows_the_handshake(tmp_path):
    with ServeSynapse("--items", "100", "--seed", "5") as s:
        lines, code = tmux_screen.run_on_terminal([DCPTOOL, "-v", "stream", f"synapse://{s.address}",
                                                   "--max-messages", "30"], width=WIDTH, tmpdir=str(tmp_path))
    assert code == 0
    commands = {w for ln in lines for w in ln.split()}
    assert {"NAME", "REPLICATE", "SERVER", "POSITION", "RDATA", "out", "in"} <= commands


def test_trace_keeps_its_explanation_in_whole_words(failover_capture, tmp_path):
    capdir = _capdir(failover_capture)
    undone = _pipe("replay", capdir, "--table", "undone")
    key = undone[0]["key"]
    rows = _pipe("trace", capdir, key)
    explain = next(r["explain"] for r in rows if r["event"] == "verdict")
    assert len(explain) > 150 and "rollback" in explain
    lines, code = tmux_screen.run_on_terminal([DCPTOOL, "trace", capdir, key], width=WIDTH, tmpdir=str(tmp_path))
    assert code == 0 and max(map(len, lines)) <= WIDTH
    _tokens_in_order(lines, explain)
    ids = [r["capture_id"] for r in rows] + [r["ts"] for r in rows if r["ts"]]
    _whole(lines, ids)


def test_verify_explain_keeps_failover_log_ids_whole(failover_capture, tmp_path):
    capdir = _capdir(failover_capture)
    rows = [r for r in _pipe("verify", capdir, "--explain") if "rollback_seqno" in r]
    assert rows
    texts = []
    for r in rows:
        for v in r.values():
            cell = v if isinstance(v, str) else orjson.dumps(v).decode() if isinstance(v, (list, dict)) else ""
            texts += re.findall(r'"vbucket_uuid":\d+|"key":"[^"]+"', cell)
    lines, code = tmux_screen.run_on_terminal([DCPTOOL, "verify", capdir, "--explain"], width=WIDTH,
                                              tmpdir=str(tmp_path))
    assert code in (0, 6) and max(map(len, lines)) <= WIDTH
    assert any('"vbucket_uuid"' in t for t in texts) and any('"key"' in t for t in texts)
    _whole(lines, texts)


def test_inspect_never_splits_a_file_path(failover_capture, tmp_path):
    """inspect's `file` column (rich): a path too long for it is cut with …, never split
    over two lines (a split one left `arquet` alone on the next line)."""
    capdir = _capdir(failover_capture)
    lines, code = tmux_screen.run_on_terminal([DCPTOOL, "inspect", capdir], width=WIDTH, tmpdir=str(tmp_path))
    assert code == 0 and max(map(len, lines)) <= WIDTH
    paths = [ln for ln in lines if capdir[:12] in ln]
    assert paths and all(("\u2026" in ln) != (".parquet" in ln) for ln in paths), "\n".join(lines)
    assert not any(w in ln.split() for ln in lines for w in ("arquet", "parquet", "quet"))
