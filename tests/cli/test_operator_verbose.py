"""Issue 39 (an operator's day): `-v` anywhere on the command line (after the subcommand it was
"No such option: -v"), in nested and lazy groups too; `dcptool -v CMD` keeps working."""

from __future__ import annotations

import subprocess

import pytest

from tests.support.paths import DCPTOOL


def _run(*args):
    return subprocess.run([DCPTOOL, *args], capture_output=True, text=True, timeout=60,
                           stdin=subprocess.DEVNULL)


@pytest.mark.parametrize("where", ["before", "after", "end"])
def test_v_anywhere_gives_the_traceback(tmp_path, where):
    bad = tmp_path / "bad.parquet"
    bad.write_bytes(b"not parquet")
    args = {"before": ["-v", "inspect", str(bad)], "after": ["inspect", "-v", str(bad)],
            "end": ["inspect", str(bad), "--verbose"]}[where]
    r = _run(*args)
    assert r.returncode == 1, r.stderr
    assert "Traceback" in r.stderr and "No such option" not in r.stderr
    assert r.stderr.strip().splitlines()[-1].startswith("dcptool: ")
    plain = _run("inspect", str(bad))
    assert plain.returncode == 1 and "Traceback" not in plain.stderr and len(plain.stderr.strip().splitlines()) == 1


def test_v_in_subgroups():
    r = _run("spark", "status", "-v", "--json")          # a click group's subcommand
    assert r.returncode == 0 and '"running"' in r.stdout, r.stderr
    r = _run("serve", "dcp", "-v", "--help")               # a lazy group's subcommand
    assert r.returncode == 0 and "Usage: dcptool serve dcp" in r.stdout, r.stderr
    r = _run("serve", "-v", "dcp", "--help")
    assert r.returncode == 0, r.stderr
    # another unknown option is still a usage error
    r = _run("inspect", "-x")
    assert r.returncode == 2 and "No such option" in r.stderr
