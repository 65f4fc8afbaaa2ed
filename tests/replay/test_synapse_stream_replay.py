"""Synapse replay in bounded chunks (replay/rules/synapse_stream.py, issue 14 item 8): any chunk
size gives the tables of the one-shot rules (synapse_rules.synapse_tables) and of the row-by-row
oracle; the reader is asked for chunks, never the whole capture; `rows` and its `row`
column are read only when that table is wanted; `inspect` reads in chunks too."""

from __future__ import annotations

import pyarrow as pa
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from dcptool.replay.check import summary as inspect_mod
from dcptool.replay.local import engine as local
from dcptool.replay.rules import synapse_tables as synapse_rules
from dcptool.replay.store import reader
from tests.support import capgen, oracle

SETTINGS = dict(max_examples=40, deadline=None, derandomize=True,
                suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])


def _files(tmp_path, s, n, max_captures=3, in_progress=False):
    d = tmp_path / f"syn-{s}-{n}-{in_progress}"
    caps = capgen.generate("synapse", s, n_events=n, max_captures=max_captures)
    capgen.write_captures(caps, str(d), seed=s, in_progress_last=in_progress, row_group_size=16)
    return reader.find_captures([str(d)])


def _one_shot(files) -> dict[str, pa.Table]:
    """The rules applied to the whole capture at once (the engine before chunking)."""
    ranks = reader.capture_ranks(files)
    t = pa.concat_tables(local.ordered_frames(files, list(dict.fromkeys(
        ["direction", "decode_error"] + synapse_rules.SYN_STATE_COLUMNS)), ranks, batch_rows=1 << 30))
    frames = t.filter(pa.array(synapse_rules.synapse_group_frames(t))).select(
        synapse_rules.SYN_STATE_COLUMNS + ["_seq", "_conn"])
    out = synapse_rules.synapse_tables(frames, int(pa.compute.max(t.column("_conn")).as_py()))
    out["commands"] = synapse_rules.commands_table(t)
    return out


@settings(**SETTINGS)
@given(s=st.integers(0, 2**32 - 1), n=st.integers(1, 300), in_progress=st.booleans(),
       chunk=st.sampled_from([1, 2, 5, 17, 64, 1 << 20]))
def test_chunked_equals_one_shot_and_oracle(tmp_path_factory, s, n, in_progress, chunk):
    files = _files(tmp_path_factory.mktemp("c"), s, n, in_progress=in_progress)
    want = _one_shot(files)
    got = local.replay_local(files, chunk_rows=chunk)
    for name in ("positions", "rows", "gaps", "commands"):
        assert got.table(name).equals(want[name]), (name, chunk)
    for name, table in oracle.synapse(files).items():
        assert got.table(name).equals(table), name


def test_generated_runs_cover_the_carried_state(tmp_path):
    """Chunks of 1 row make every batch, gap and reconnect cross a chunk boundary; the
    generated runs really have them."""
    seen = dict.fromkeys(["batches", "gaps", "dropped", "pending"], 0)
    for s in range(8):
        p = local.replay_local(_files(tmp_path, s, 250), chunk_rows=1).table("positions")
        for k in seen:
            seen[k] += sum(p.column(k).to_pylist())
    assert all(seen.values()), seen


def test_reader_is_asked_for_chunks_and_rows_only_when_wanted(tmp_path, monkeypatch):
    files = _files(tmp_path, 3, 300, max_captures=1)
    total = sum(reader.read_file(f, ["frame_no"]).num_rows for f in files)
    asked = []
    real = reader.iter_capture_tables

    def spy(files, columns=None, batch_rows=1 << 20, threads=True):
        for t in real(files, columns, batch_rows=batch_rows, threads=threads):
            asked.append((tuple(columns or ()), batch_rows, t.num_rows))
            yield t
    monkeypatch.setattr(reader, "iter_capture_tables", spy)

    rep = local.replay_local(files, chunk_rows=32, tables=["positions", "gaps", "commands"])
    positions = rep.table("positions")
    assert total > 100 and len(asked) > 3
    assert all(b == 32 and n <= 32 for _, b, n in asked)
    assert all("row" not in cols for cols, _, _ in asked)       # `rows` was not built
    assert "rows" not in dict.keys(rep.results)
    asked.clear()
    rows = rep.table("rows")                                       # a second pass, with `row`
    assert asked and all("row" in cols and n <= 32 for cols, _, n in asked)
    want = _one_shot(files)
    assert rows.equals(want["rows"]) and positions.equals(want["positions"])


def _inspect_oracle(files):
    """inspect's Synapse rules row by row (the implementation before chunking)."""
    streams, gaps, state = {}, [], {"conn": None}

    def connection(conn):
        if conn != state["conn"]:
            if state["conn"] is not None:
                for st in streams.values():
                    st["dropped"] += st["waiting"]
                    st["waiting"] = 0
            state["conn"] = conn

    for f in files:
        t = reader.read_file(f)
        if not t.num_rows:
            continue
        for r in t.to_pylist():
            if r["direction"] != "in" or r["command"] not in ("RDATA", "POSITION"):
                continue
            connection((f.capture_id, r["conn"]))
            key = (r["stream"], r["instance"])
            st = streams.setdefault(key, {"stream": key[0], "instance": key[1], "token": None,
                                          "rows": 0, "batches": 0, "positions": 0, "gaps": 0,
                                          "dropped": 0, "waiting": 0})
            if r["command"] == "RDATA":
                if r["batch"]:
                    st["waiting"] += 1
                elif r["token"] is not None:
                    st["batches"] += bool(st["waiting"])
                    st["rows"] += st["waiting"] + 1
                    st["waiting"] = 0
                    st["token"] = r["token"]
            else:
                st["positions"] += 1
                prev, new = r["prev_token"], r["new_token"]
                if st["token"] is not None and prev is not None and st["token"] < prev:
                    st["gaps"] += 1
                    gaps.append({"stream": key[0], "instance": key[1], "from_token": st["token"],
                                 "to_token": prev, "capture_id": f.capture_id,
                                 "frame_no": r["frame_no"]})
                if new is not None:
                    st["token"] = new
        connection((f.capture_id, t.column("conn")[-1].as_py()))
    return [streams[k] for k in sorted(streams, key=lambda k: (str(k[0]), str(k[1])))], gaps


@pytest.mark.parametrize("s", range(6))
def test_inspect_reads_in_chunks_and_matches(tmp_path, monkeypatch, s):
    files = _files(tmp_path, s, 300, max_captures=3, in_progress=s % 2 == 1)
    paths = [f.path for f in files]
    whole = inspect_mod.summarize(paths)
    positions, gaps = _inspect_oracle(reader.find_captures(paths))
    assert whole["positions"] == positions and whole["gaps"] == gaps
    monkeypatch.setattr(inspect_mod, "CHUNK_ROWS", 7)
    sizes = []
    real = inspect_mod._chunks

    def spy(f, cols):
        for t in real(f, cols):
            sizes.append(t.num_rows)
            yield t
    monkeypatch.setattr(inspect_mod, "_chunks", spy)
    small = inspect_mod.summarize(paths)
    assert max(sizes) <= 7 and len(sizes) > 10
    assert small == whole
