"""`stream` and `capture` of a DCP source run one session with one tap and one set of
settings (capture/dcp_session.py, capture/dcp_tap.py): the same reconnect count against a
server that drops every connection, the same default connection name. Issue 35 found them
drifted (reconnects 3 for `stream`, 5 for `capture`; the default name written twice)."""

from __future__ import annotations

import json
import os

import pytest
from click.testing import CliRunner

from dcptool.capture import dcp_capture as capture_dcp
from dcptool.capture import dcp_session
from dcptool.capture.dcp_tap import CaptureTap, DcpTap
from dcptool.capture.options import default_name
from dcptool.capture.sources import parse_source
from dcptool.cli import cli
from dcptool.cli.runners import dcp_live
from dcptool.live.dcp_rows import RowTap
from dcptool.protocol.dcp.server import producer as P
from dcptool.replay.store.reader import find_captures, read_capture_table
from tests.support.threaded_server import ThreadedServer

pytestmark = pytest.mark.integration


def _invoke(*args):
    runner = CliRunner(mix_stderr=False) if "mix_stderr" in CliRunner.__init__.__code__.co_varnames else CliRunner()
    return runner.invoke(cli, list(args), env={}, catch_exceptions=False)


def test_both_commands_use_the_one_session_and_tap():
    assert dcp_live.S is dcp_session and capture_dcp.make_session is dcp_session.make_session
    assert not hasattr(dcp_live, "DEFAULTS") and "reconnects" not in capture_dcp.DEFAULTS
    assert issubclass(RowTap, DcpTap) and issubclass(CaptureTap, DcpTap)
    # the tap's transport hooks are DcpTap's own, not overridden by either command
    for hook in ("attach", "on_sent", "on_received"):
        assert getattr(RowTap, hook) is getattr(CaptureTap, hook) is getattr(DcpTap, hook)


def _opened(rows) -> tuple[int, set]:
    """The connections a run made (conn numbers count from 1 across reconnects) and the
    names its DCP_OPENs gave."""
    return (max(r["conn"] for r in rows),
            {k.decode() if isinstance(k, bytes) else k   # the capture keeps keys as bytes
             for r in rows if r["op"] == "open" and r["direction"] == "out" for k in [r["key"]]})


def test_stream_and_capture_reconnect_the_same_number_of_times_and_use_one_name(tmp_path):
    """A producer that goes silent after the first stream request: every connection dies of
    missed noops and is made again, DEFAULTS["reconnects"] times, then the run fails (exit 1)."""
    opened = {}
    for command in ("stream", "capture"):
        model = P.server_from_options(vbuckets=2, items=20, scenarios=P.Scenarios(silent=True))
        with ThreadedServer(model) as srv:
            url = f"couchbase://{srv.host}:{srv.port}/default"
            out = ["-o", str(tmp_path), "--quiet"] if command == "capture" else ["--format", "jsonl"]
            res = _invoke(command, url, "--noop-interval", "0.1", *out)
        assert res.exit_code == 1, res.stderr
        assert "no frame from the producer" in res.stderr
        if command == "stream":
            rows = [json.loads(line) for line in res.stdout.splitlines() if line.strip()]
        else:
            rows = read_capture_table(find_captures([str(tmp_path)])).select(["conn", "op", "direction", "key"]).to_pylist()
        opened[command] = _opened(rows)
    name = default_name(parse_source(url))
    assert name == f"dcptool-127.0.0.1-{os.getpid()}"
    assert opened == {"stream": (dcp_session.DEFAULTS["reconnects"] + 1, {name}),
                      "capture": (dcp_session.DEFAULTS["reconnects"] + 1, {name})}
