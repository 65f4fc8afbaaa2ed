"""Every option of `capture` may come from the environment as DCPTOOL_CAPTURE_<OPTION>
(--rotate-size: DCPTOOL_CAPTURE_ROTATE_SIZE); the command line wins; --help names them."""

from __future__ import annotations

import json
import os
import subprocess

from click.testing import CliRunner

from dcptool.cli import cli
from dcptool.replay.store.reader import find_captures
from tests.support.paths import DCPTOOL


def _capture(url, env, *args):
    return subprocess.run([DCPTOOL, "capture", url, "--quiet", *args], capture_output=True, text=True,
                          timeout=120, env={**os.environ, **env})


def _recorded_vbuckets(out) -> list:
    return sorted({v for f in find_captures([str(out)])
                   for v in json.loads(f.metadata["dcptool.options"])["vbuckets"]})


def test_an_env_var_sets_an_option_and_the_command_line_wins(tmp_path):
    from dcptool.protocol.dcp.server import producer as P
    from tests.support.threaded_server import ThreadedServer
    env = {"DCPTOOL_CAPTURE_OUTPUT": str(tmp_path / "from-env"), "DCPTOOL_CAPTURE_VBUCKETS": "0-1",
           "DCPTOOL_CAPTURE_TO": "forever", "DCPTOOL_CAPTURE_RETAIN_SEGMENTS": "1"}
    with ThreadedServer(P.server_from_options(vbuckets=4, items=40, seed=3)) as srv:
        res = _capture(f"couchbase://{srv.host}:{srv.port}/default", env, "--vbuckets", "2", "--to", "now",
                       "--json")
    assert res.returncode == 0, res.stderr
    # output and the ring from the environment; vbuckets and --to from the command line
    assert _recorded_vbuckets(tmp_path / "from-env") == [2]
    summary = json.loads(res.stdout)
    assert summary["stopped"] == "to" and summary["retained_away"] == 0


def test_a_bad_value_from_the_environment_is_a_usage_error_naming_it(tmp_path):
    res = _capture("couchbase://127.0.0.1:9/default", {"DCPTOOL_CAPTURE_RETAIN_SEGMENTS": "none"},
                   "-o", str(tmp_path / "x"))
    assert res.returncode == 2 and "--retain-segments" in res.stderr and "Traceback" not in res.stderr


def test_help_names_the_variables():
    out = CliRunner().invoke(cli, ["capture", "--help"], terminal_width=200).output
    for name in ("DCPTOOL_CAPTURE_ROTATE_SIZE", "DCPTOOL_CAPTURE_RETAIN_AGE", "DCPTOOL_CAPTURE_SHARD",
                 "DCPTOOL_CAPTURE_VBUCKETS", "DCPTOOL_CAPTURE_OUTPUT", "DCPTOOL_CAPTURE_FROM"):
        assert name in out, name
