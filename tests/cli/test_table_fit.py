"""Tables on a terminal fit its width the way people read documents (CLI.md, issue 24 item
16): keys and ids are never split, columns empty in the rows shown take no room, and the
document value takes the room left, cut with "…" after two lines."""

from __future__ import annotations

import io
import json
import random
import re

import pytest

from dcptool.cli.runners.dcp_live import TABLE_COLUMNS
from dcptool.cli.view.output import Sink
from dcptool.live.table import MARK, TextTable
from dcptool.replay.display import display_columns

COLUMNS = display_columns(TABLE_COLUMNS, values=True)


def _row(**kw) -> dict:
    row = dict.fromkeys(COLUMNS)
    row.update({"conn": 1, "direction": "in", "opaque": 11, **kw})
    return row


def _handshake() -> list[dict]:
    """What a stream prints before its first document: controls with long keys, a map."""
    return [_row(direction="out", op="control", vbucket=0, opaque=6, key=key, value_len=len(val),
                 value_base64="MjA5NzE1MjA=") for key, val in
            [("enable_out_of_order_snapshots", "true_with_seqno_advanced"),
             ("connection_buffer_size", "20971520"), ("set_noop_interval", "30")]] + \
        [_row(op="get_cluster_config", vbucket=0, status=0, opaque=3, value_len=1174,
              value={"rev": 1, "nodes": ["127.0.0.1:11210"] * 40})]


def _markers(vbs) -> list[dict]:
    return [_row(op="snapshot_marker", vbucket=vb, snap_start=0, snap_end=155 + vb,
                 snap_flag_names="disk|checkpoint") for vb in vbs]


def _mutations(seed: int, n: int) -> tuple[list[dict], list[str]]:
    rnd = random.Random(seed)
    keys = [f"doc-{rnd.randrange(10**8):08d}" for _ in range(n)]
    keys[0] = "doc-00001012"
    rows = []
    for i, key in enumerate(keys):
        value = {"n": key[4:], "r": "%038x" % rnd.getrandbits(152)}   # 61 bytes of JSON
        assert len(json.dumps(value, separators=(",", ":"))) == 61
        rows.append(_row(op="mutation", vbucket=i % 4, by_seqno=i + 1, key=key, value_len=61, value=value))
    return rows, keys


def _render(width: int, *batches) -> str:
    out = io.StringIO()
    table = TextTable(out, COLUMNS, title="stream", width=width)
    for b in batches:
        table.write(b)
    return out.getvalue()


def _body(text: str, marker: str) -> list[str]:
    """The lines from the last header (holding `marker`) on, without the header."""
    lines = text.replace("\x1b[1m", "").replace("\x1b[0m", "").splitlines()
    at = max(i for i, ln in enumerate(lines) if marker in ln and "conn" in ln)
    return lines[at:]


def _col(header: str, name: str) -> int:
    """Where the column `name` starts in a header line."""
    return re.search(r"(?:^|(?<= ))%s(?= |$)" % name, header).start()


def _rows_of(lines: list[str]) -> list[list[str]]:
    """Table lines grouped by row: a row starts with its `conn` cell."""
    rows: list[list[str]] = []
    for ln in lines:
        if ln[:4].strip():
            rows.append([ln])
        else:
            rows[-1].append(ln)
    return rows


@pytest.mark.parametrize("width", [160, 120])
def test_documents_after_snapshot_markers_get_the_room(width):
    """A batch of documents only: the snapshot columns (empty in it) take no room, every key
    is whole on its row's first line, and the 61-byte value fits on one line (160 columns);
    at 120 columns, where the value would have to wrap inside one of its strings, it goes
    whole on an indented line of its own (issue 39: no word, id or number split)."""
    muts, keys = _mutations(7, 40)
    text = _render(width, _handshake(), _markers(range(4)), muts)
    lines = _body(text, "by_seqno")
    header = lines[0]
    assert "snap_start" not in header and "snap_flag_names" not in header and "value_base64" not in header
    banded = width < 160
    rows = _rows_of(lines[2:] if banded else lines[1:])
    assert len(rows) == len(muts)
    if banded:
        assert lines[1].split() == ["value"] and lines[1].startswith("    ")
    value_at = 4 if banded else _col(header, "value")
    for row, key, m in zip(rows, keys, muts):
        assert len(row) == (2 if banded else 1), row
        assert f"  {key}  " in row[0]                 # the key whole
        assert row[-1][value_at:] == json.dumps(m["value"], separators=(",", ":"))
    assert max(len(ln) for ln in lines[1:]) <= width


def test_a_backfill_batch_shows_documents_whole_and_markers_below():
    """Markers and documents in one batch (a backfill) on 160 columns: each document is one
    line with its key and its whole value; the snapshot columns, empty in document rows, go
    on an indented line under each marker instead of squeezing the value."""
    muts, keys = _mutations(11, 30)
    text = _render(160, _handshake(), _markers(range(4)) + muts)
    lines = text.replace("\x1b[1m", "").replace("\x1b[0m", "").splitlines()
    assert max(map(len, lines)) <= 160
    at = max(i for i, ln in enumerate(lines) if ln.startswith("conn"))
    header, band = lines[at], lines[at + 1]
    assert "by_seqno" in header and "snap_start" not in header
    assert band.startswith("    ") and band.split() == ["snap_start", "snap_end", "snap_flag_names"]
    rows = _rows_of(lines[at + 2:])
    assert len(rows) == 4 + len(muts)
    for row in rows[:4]:
        assert len(row) == 2 and row[1].startswith("    ") and row[1].split()[-1] == "disk|checkpoint"
    value_at = _col(header, "value")
    for row, key, m in zip(rows[4:], keys, muts):
        assert len(row) == 1 and f"  {key}  " in row[0], row
        assert row[0][value_at:] == json.dumps(m["value"], separators=(",", ":"))


@pytest.mark.parametrize("width", [160, 80])
def test_long_values_are_cut_with_the_mark_never_inside_a_word(width):
    """A value that no line can hold is cut with the mark; it wraps only at its commas
    (between JSON members), so a 400-character string is cut, not split over lines."""
    rnd = random.Random(5)
    muts, keys = _mutations(19, 12)
    for m in muts:
        m["value"] = {"blob": "".join(rnd.choice("abcdef") for _ in range(400)), "n": 7}
        m["value_len"] = 417
    header, rows = _table(_render(width, _markers(range(2)) + muts))
    assert max(len(ln) for r in rows for ln in r) <= width and len(rows) == 2 + len(muts)
    for row, key, m in zip(rows[2:], keys, muts):
        assert sum(key in ln for ln in row) == 1 and sum(key[:-1] in ln for ln in row) == 1
        first = next(i for i, ln in enumerate(row) if '{"blob"' in ln)
        start = row[first].index('{"blob"')
        pieces = [ln[start:] for ln in row[first:]]
        assert len(pieces) == 2, row                  # the cut string, then the next member
        full = json.dumps(m["value"], separators=(",", ":"))
        assert pieces[0].endswith(MARK) and full.startswith(pieces[0][:-1]) and len(pieces[0]) > 40, pieces
        assert pieces[1] == '"n":7}'


def _table(text: str) -> tuple[list[str], list[list[str]]]:
    """(the last header's lines, the rows after it, each a list of lines)."""
    lines = text.replace("\x1b[1m", "").replace("\x1b[0m", "").splitlines()
    at = max(i for i, ln in enumerate(lines) if ln.startswith("conn"))
    end = at + 1
    while end < len(lines) and lines[end].startswith("    ") and all(w in COLUMNS for w in lines[end].split()):
        end += 1
    return lines[at:end], _rows_of(lines[end:])


@pytest.mark.parametrize("width", [80, 100])
def test_a_narrow_terminal_gets_indented_bands_never_a_split_cell(width):
    """Columns that cannot share one line go on over indented lines of whole columns: no
    line is wider than the terminal (so the terminal never splits a key), a document's
    value is whole on its own line, and a band empty in a row is left out of it."""
    muts, keys = _mutations(17, 30)
    text = _render(width, _handshake(), _markers(range(4)) + muts)
    lines = text.replace("\x1b[1m", "").replace("\x1b[0m", "").splitlines()
    assert max(map(len, lines)) <= width
    for key in keys:
        assert sum(key in ln for ln in lines) == 1 and sum(key[:-1] in ln for ln in lines) == 1
    body = lines[max(i for i, ln in enumerate(lines) if ln.startswith("conn")):]
    header_lines = [ln for ln in body if not ln[:4].strip() and ln.strip().split()[0] in COLUMNS
                    and all(w in COLUMNS for w in ln.split())]
    assert len(header_lines) >= 1 and all(ln.startswith("    ") for ln in header_lines)
    rows = _rows_of(body[1 + len(header_lines):])
    assert len(rows) == 4 + len(muts)
    for row in rows[:4]:       # a marker: its snapshot band, no empty value band
        assert len(row) == 2 and row[1].split() == ["0", row[1].split()[1], "disk|checkpoint"]
    for row, key, m in zip(rows[4:], keys, muts):
        assert len(row) == 2 and key in row[0], row
        assert row[1].split()[-1] == json.dumps(m["value"], separators=(",", ":"))


def test_the_issue_layout_on_a_160_column_terminal_through_the_sink(monkeypatch):
    """The Sink as `stream --values` uses it on a 160-column terminal: the key
    doc-00001012 on one line, its value on at most two."""
    class Tty(io.StringIO):
        def isatty(self):
            return True

    monkeypatch.setenv("COLUMNS", "160")
    out = Tty()
    sink = Sink("table", columns=COLUMNS, out=out)
    sink.write_many(_handshake())
    sink.write_many(_markers(range(4)) + _mutations(3, 12)[0])
    sink.write_many(_mutations(5, 12)[0])
    sink.close()
    text = out.getvalue()
    hits = [ln for ln in text.splitlines() if "doc-0000101" in ln]
    assert len(hits) == 2 and all("doc-00001012" in ln for ln in hits)
    for ln in text.splitlines():
        assert len(ln.replace("\x1b[1m", "").replace("\x1b[0m", "")) <= 160


def test_a_pipe_still_gets_every_byte_on_one_line():
    muts, keys = _mutations(13, 10)
    out = io.StringIO()
    TextTable(out, COLUMNS, width=None).write(_markers(range(2)) + muts)
    lines = out.getvalue().splitlines()
    assert len(lines) == 1 + 2 + len(muts)
    for ln, m in zip(lines[3:], muts):
        assert json.dumps(m["value"], separators=(",", ":")) in ln and MARK not in ln
