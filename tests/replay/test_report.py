"""`dcptool report`: the numbers (checked against the capture columns read directly), the page
(self-contained: no script or stylesheet from the network), and the page as a browser draws it
(headless Chromium: a screenshot that is not blank, the chart titles in the rendered DOM).

docs/report.png is a report of a real minute-long capture of `serve dcp`, made by
scripts/report_png.sh."""

from __future__ import annotations

import os
import re
import shutil
import subprocess

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pytest

from dcptool.replay.check import report as R
from dcptool.replay.check import report_data as D
from dcptool.replay.check import report_html as H
from dcptool.replay.check import verify as V
from dcptool.replay.store import reader
from tests.support import capgen
from tests.support.paths import DCPTOOL

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
INSTALL = ("chromium is missing: install it with `DEBIAN_FRONTEND=noninteractive apt-get install -y chromium` "
           "(scripts/setup.sh --test does)")


def _dir(files) -> str:
    return os.path.dirname(files[0].path)


@pytest.fixture(scope="module")
def synapse_caps(tmp_path_factory):
    out = tmp_path_factory.mktemp("syn") / "caps"
    capgen.write_captures(capgen.generate("synapse", 27, 600), str(out), seed=27)
    return str(out)


@pytest.fixture(scope="module")
def dcp_page(failover_capture, tmp_path_factory):
    _, files = failover_capture
    out = str(tmp_path_factory.mktemp("rep") / "dcp.html")
    d = R.report([_dir(files)], out)
    return files, d, out


@pytest.fixture(scope="module")
def synapse_page(synapse_caps, tmp_path_factory):
    out = str(tmp_path_factory.mktemp("rep") / "synapse.html")
    d = R.report([synapse_caps], out)
    return d, out


def _plain(col):
    return col.cast(pa.string()) if pa.types.is_dictionary(col.type) else col


def _assert_self_contained(path: str) -> None:
    text = open(path, encoding="utf-8").read()
    assert "<script" in text and "Plotly.newPlot" in text
    assert not re.search(r"<script[^>]*\bsrc\s*=", text, re.I), "a script is loaded from elsewhere"
    assert not re.search(r"<link[^>]*\bhref\s*=\s*[\"']?(https?:)?//", text, re.I), "a stylesheet from the network"
    assert not re.search(r"<img[^>]*\bsrc\s*=\s*[\"']?(https?:)?//", text, re.I)


def test_time_bins_are_bounded_and_keep_every_frame(tmp_path):
    """Never more than max_points bins, each as wide as the others, and every frame in one of them."""
    out = tmp_path / "caps"
    capgen.write_captures(capgen.generate("dcp", 5, 300), str(out), seed=5)
    files = reader.find_captures([str(out)])
    first, last = D.span(files)
    for points in (10, 2000):
        d = D.collect(files, max_points=points)
        assert len(d.bins) <= points and d.frames_per_bin.sum() == d.frames
        assert d.bins[0] == first and d.bins[-1] <= last < d.bins[-1] + d.width_ns
        assert d.bytes_per_bin.sum() == d.bytes


def test_dcp_failover_report_numbers(dcp_page):
    files, d, out = dcp_page
    t = reader.read_capture_table(files, ["direction", "op", "status", "vbucket", "by_seqno", "key",
                                          "collection_id", "raw"])
    assert d.frames == t.num_rows
    assert d.bytes == pc.sum(pc.binary_length(t.column("raw"))).as_py()
    op = _plain(t.column("op"))
    inbound = pc.equal(t.column("direction"), "in")
    rollbacks = t.filter(pc.and_(pc.and_(pc.equal(op, "stream_req"), inbound),
                                 pc.equal(t.column("status"), 0x23)).fill_null(False))
    assert rollbacks.num_rows > 0, "the failover capture holds rollbacks"
    assert d.mark_counts["rollback"] == rollbacks.num_rows
    assert "reconnect" in d.mark_counts        # the failover moved the streams to a new connection
    for kind, pts in d.marks.items():          # one mark per bin drawn, every mark counted
        assert sum(c for _, _, c in pts) == d.mark_counts[kind]
        bins = [(ts - d.t0_ns) // d.width_ns for ts, _, _ in pts]
        assert bins == sorted(set(bins))
    # progress: each drawn vbucket ends at its highest seqno received
    changes = t.filter(pc.and_(pc.is_in(op, pa.array(["mutation", "deletion", "expiration", "commit"])),
                               inbound).fill_null(False))
    for label, (_, vals) in d.progress.items():
        vb = int(label.split()[1])
        rows = t.filter(pc.and_(pc.equal(t.column("vbucket"), vb), pc.is_valid(t.column("by_seqno"))))
        assert vals[-1] == pc.max(rows.column("by_seqno")).as_py()
    assert len(d.progress) == min(32, d.progress_series)
    counts = changes.group_by(["key", "collection_id"]).aggregate([("key", "count")])
    top = max(counts.column("key_count").to_pylist())
    assert d.top_keys[0][2] == top and len(d.top_keys) == 20
    assert sum(d.kinds.values()) == pc.sum(pc.equal(op, "snapshot_marker").cast(pa.int64())).as_py()
    assert [s.rows for s in d.segments] == [pq_rows(f) for f in files]
    _assert_self_contained(out)


def pq_rows(f) -> int:
    import pyarrow.parquet as pq
    return pq.ParquetFile(f.path).metadata.num_rows


def test_synapse_report_numbers(synapse_page, synapse_caps):
    d, out = synapse_page
    files = reader.find_captures([synapse_caps])
    t = reader.read_capture_table(files, ["direction", "command", "stream", "instance", "token", "raw"])
    assert d.protocol == "synapse" and d.frames == t.num_rows
    rdata = t.filter(pc.and_(pc.and_(pc.equal(_plain(t.column("command")), "RDATA"),
                                     pc.equal(t.column("direction"), "in")),
                             pc.is_valid(t.column("token"))).fill_null(False))
    per_stream = {}     # per stream and instance
    for s, i, tok in zip(_plain(rdata.column("stream")).to_pylist(), _plain(rdata.column("instance")).to_pylist(),
                         rdata.column("token").to_pylist()):
        per_stream.setdefault(f"{s} / {i}", []).append(tok)
    assert len({k.split(" / ")[1] for k in per_stream}) > 1, "several instances"
    assert d.kinds == {s: len(v) for s, v in per_stream.items()}
    assert {s: int(v[1][-1]) for s, v in d.progress.items()} == {s: max(v) for s, v in per_stream.items()}
    assert not d.top_keys
    _assert_self_contained(out)


def _chromium() -> str:
    exe = shutil.which("chromium") or shutil.which("chromium-browser")
    if exe is None:
        pytest.fail(INSTALL)
    return exe


def _render(html_path: str, png: str) -> str:
    exe = _chromium()
    base = [exe, "--headless", "--disable-gpu", "--no-sandbox", "--hide-scrollbars",
            "--virtual-time-budget=15000"]
    url = "file://" + html_path
    shot = subprocess.run(base + [f"--screenshot={png}", "--window-size=1280,2000", url],
                          capture_output=True, timeout=120)
    assert shot.returncode == 0 and os.path.exists(png), shot.stderr[-2000:]
    dom = subprocess.run(base + ["--dump-dom", url], capture_output=True, timeout=120)
    assert dom.returncode == 0, dom.stderr[-2000:]
    return dom.stdout.decode("utf-8", "replace")


def _rendered_titles(dom: str) -> list[str]:
    return re.findall(r'class="gtitle"[^>]*>([^<]*)<', dom)


def _check_render(dom: str, png: str, expected: list[str]) -> None:
    from PIL import Image
    img = np.asarray(Image.open(png).convert("L"), dtype=np.float64)
    assert img.shape == (2000, 1280)
    assert img.std() > 10, "the screenshot is blank"
    assert (img < 200).mean() > 0.01, "hardly anything drawn"
    titles = _rendered_titles(dom)
    for want in expected:
        assert any(t.startswith(want) for t in titles), (want, titles)
    plots = dom.count('class="plot-container plotly"')
    assert plots == len(titles) and dom.count('class="main-svg"') >= plots
    assert R.FINDINGS_TITLE in dom


def test_dcp_report_renders_in_chromium(dcp_page, tmp_path):
    files, _, out = dcp_page
    png = str(tmp_path / "dcp.png")
    dom = _render(out, png)
    _check_render(dom, png, [R.TITLES[k] for k in ("rate", "ops_dcp", "backfill", "progress_dcp", "marks",
                                                   "kinds_dcp", "segments", "keys")])
    assert "rolled back to seqno" in open(out, encoding="utf-8").read()
    n = V.verify([_dir(files)]).summary()["findings"]
    assert (f"{n:,} finding(s)" if n else "no findings") in dom
    # the summary strip is drawn above the first chart, the verify verdict first
    strip = dom.index('class="strip"')
    assert strip < dom.index('class="plot-container plotly"')
    assert dom.index(">verify<", strip) < dom.index(">documents<", strip) < dom.index(">rollbacks<", strip)
    # a `--to now` capture ends at lag 0: the lag chart is one line of text, no plot
    assert f'<p class="empty"><b>{R.TITLES["lag"]}</b>: 0 items at every poll: never behind</p>' in dom
    assert not any(t.startswith(R.TITLES["lag"]) for t in _rendered_titles(dom))


def test_synapse_report_renders_in_chromium(synapse_page, tmp_path):
    _, out = synapse_page
    png = str(tmp_path / "syn.png")
    dom = _render(out, png)
    _check_render(dom, png, [R.TITLES[k] for k in ("rate", "ops_synapse", "progress_synapse", "kinds_synapse",
                                                   "segments")])
    assert f"<h2>{H.STREAMS_TITLE}</h2>" in dom


def test_cli_report_and_bad_capture(failover_capture, tmp_path):
    _, files = failover_capture
    out = tmp_path / "r.html"
    res = subprocess.run([DCPTOOL, "report", _dir(files), "-o", str(out), "--no-verify", "--top-keys", "3"],
                         capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr
    text = out.read_text(encoding="utf-8")
    assert "not run (--no-verify)" in text and R.TITLES["keys"] in text
    bad = subprocess.run([DCPTOOL, "report", str(tmp_path / "nothing-here"), "-o", str(tmp_path / "x.html")],
                         capture_output=True, text=True, timeout=60)
    assert bad.returncode == 2 and "Traceback" not in bad.stderr
    assert not (tmp_path / "x.html").exists()
