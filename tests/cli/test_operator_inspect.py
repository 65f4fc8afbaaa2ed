"""Issue 39 (an operator's day), `inspect`: identical per-vbucket rows as one row of vbucket
ranges, JSON when stdout is not a terminal (`--json` and `--format table` kept), and a
1,024-vbucket capture summarised in one screen."""

from __future__ import annotations

import json
import random
import subprocess

from click.testing import CliRunner

from dcptool.cli import cli
from tests.support.capture_rows import Rec
from tests.support.paths import DCPTOOL


def _capture(directory, vbuckets, seed=7, items=lambda rng: 3):
    rng = random.Random(seed)
    r = Rec(directory)
    for vb in range(vbuckets):
        r.stream_ok(vb, [(1000 + vb, 0)])
        n = items(rng)
        r.marker(vb, 0, n)
        r.items(vb, 1, n)
        r.add(op="stream_end", vbucket=vb, stream_end_reason=1)
    for i, row in enumerate(r.rows):
        row["ts"] = 1_700_000_000_000_000_000 + i * 1000
    r.close()


def _table(path):
    res = CliRunner().invoke(cli, ["inspect", str(path), "--format", "table"])
    assert res.exit_code == 0, res.stderr
    return res.stdout


def test_vb_ranges():
    from dcptool.replay.check.summary import vb_ranges
    assert vb_ranges([3, 0, 1, 2, 7, 9, 10]) == "0-3,7,9-10"
    assert vb_ranges(range(0, 40, 2), limit=3) == "0,2,4,… (20 vbuckets)"


def test_identical_vbucket_rows_are_one_row_of_ranges(tmp_path):
    _capture(tmp_path, 64)
    out = _table(tmp_path)
    ends = [ln for ln in out.splitlines() if "1 (closed)" in ln]
    assert len(ends) == 1 and "0-63" in ends[0], out
    vb_rows = [ln for ln in out.splitlines() if "0-63" in ln]
    assert len(vb_rows) == 2, out                       # the vbuckets table and the stream ends
    assert len(out.splitlines()) < 40, out


def test_1024_vbuckets_fit_one_screen(tmp_path):
    _capture(tmp_path, 1024, items=lambda rng: rng.randrange(1, 9))
    out = _table(tmp_path)
    lines = out.splitlines()
    assert len(lines) <= 60, out
    assert "1,024: 0-1023" in out and "0-1023" in [c.strip() for ln in lines for c in ln.split("│")]


def test_json_in_a_pipe_and_with_json(tmp_path):
    _capture(tmp_path, 4)
    for extra in ([], ["--json"], ["--format", "json"]):
        r = subprocess.run([DCPTOOL, "inspect", str(tmp_path), *extra], capture_output=True, text=True, timeout=60)
        assert r.returncode == 0, r.stderr
        doc = json.loads(r.stdout)
        assert [v["vbucket"] for v in doc["vbuckets"]] == [0, 1, 2, 3]
        assert len(doc["stream_ends"]) == 4
    r = subprocess.run([DCPTOOL, "inspect", str(tmp_path), "--format", "table"], capture_output=True, text=True,
                       timeout=60)
    assert r.returncode == 0 and "stream ends" in r.stdout and "0-3" in r.stdout
