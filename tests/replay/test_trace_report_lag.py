"""The report's lag chart, ready for issue 26's `lag` table: drawn (per node, the highest
lag_items per time bin) when the replay has the table, left out when it has not. The table
here is made up with only the columns the report relies on (ts, node, vbucket, high_seqno,
seqno, lag_items)."""

from __future__ import annotations

import numpy as np
import pyarrow as pa

from dcptool.replay.check import report as RP
from dcptool.replay.check import report_data as D
from dcptool.replay.rules import tables as T
from dcptool.replay.store.reader import find_captures
from tests.support import capgen


def _files(tmp_path):
    capgen.write_captures(capgen.generate("dcp", seed=26, n_events=120, max_captures=1), str(tmp_path), seed=26)
    return find_captures([str(tmp_path)])


def _titles(d) -> list[str]:
    return [f.layout.title.text for f in RP.figures(d)]


def test_lag_chart_drawn_from_a_lag_table(tmp_path, monkeypatch):
    files = _files(tmp_path)
    t0, t1 = D.span(files)
    ts = np.linspace(t0, t1, 6).astype(np.int64)
    lag = pa.table({"ts": pa.array(ts, pa.int64()).cast(pa.timestamp("ns", "UTC")),
                    "node": ["n1", "n2", "n1", "n2", "n1", "n1"], "vbucket": [0, 0, 1, 1, 2, 3],
                    "high_seqno": [10, 10, 20, 20, 30, 30], "seqno": [7, 10, 11, 20, 0, 30],
                    "lag_items": [3, 0, 9, 0, 30, 0]})
    monkeypatch.setattr(D, "lag_table", lambda fs: lag)
    d = D.collect(files, max_points=3)
    assert sorted(d.lag) == ["n1", "n2"]
    x, v = d.lag["n1"]
    assert v.tolist() == [3, 9, 30] and len(x) == 3     # the highest of each bin
    assert d.lag["n2"][1].tolist() == [0, 0]
    assert RP.TITLES["lag"] in _titles(d)


def test_no_lag_table_no_lag_chart(tmp_path):
    d = D.collect(_files(tmp_path))
    if "lag" not in T.table_specs("dcp"):       # until issue 26 adds the table
        assert d.lag is None
        assert not any(t.startswith(RP.TITLES["lag"]) for t in _titles(d))
