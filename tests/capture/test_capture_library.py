"""dcptool.capture as a library: a capture of a source into a directory is one call, with no
click and no rich in the process, returning the summary the CLI prints."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from dcptool.capture import parse_source
from dcptool.protocol.errors import BadSource, DcptoolError
from dcptool.replay.store.reader import find_captures, read_capture_table

SCRIPT = r"""
import json, sys
from dcptool.protocol.dcp.server import producer as P
from tests.support.threaded_server import ThreadedServer
from dcptool.capture import CaptureSettings, LiveOptions, capture, parse_source

model = P.server_from_options(vbuckets=4, items=300, seed=5)
told, notes = [], []
with ThreadedServer(model) as srv:
    opts = LiveOptions(source=parse_source(f"couchbase://{srv.host}:{srv.port}/default"), user=None,
                       name="library-test")
    result = capture(opts, CaptureSettings(output=sys.argv[1]), note=notes.append,
                     tell=lambda event, state: told.append(type(event).__name__))
print(json.dumps({"error": None if result.error is None else repr(result.error), "summary": result.summary(),
                  "files": len(result.files), "told": sorted(set(told)),
                  "ui": [m for m in ("click", "rich") if m in sys.modules]}))
"""


@pytest.mark.integration
def test_a_dcp_capture_is_one_call_without_click_or_rich(tmp_path):
    out = tmp_path / "caps"
    res = subprocess.run([sys.executable, "-c", SCRIPT, str(out)], capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr
    got = json.loads(res.stdout.splitlines()[-1])
    assert got["error"] is None and got["ui"] == []
    s = got["summary"]
    assert s["protocol"] == "dcp" and s["stopped"] == "to" and s["error"] is None
    assert got["files"] >= 1 and s["frames"] > 300 and s["received"] > 300
    assert "HandshakeComplete" in got["told"] and "StreamEnded" in got["told"]
    t = read_capture_table(find_captures([str(out)]))
    assert t.num_rows == s["frames"]
    assert sum(1 for op in t.column("op").to_pylist() if op == "mutation") == 300


def test_a_bad_source_is_a_typed_error_not_a_click_one():
    with pytest.raises(BadSource) as info:
        parse_source("couchbase://user:secret@host/bucket")
    assert isinstance(info.value, DcptoolError) and info.value.hint == "SOURCE"
    assert "secret" not in str(info.value)


SYNAPSE_SCRIPT = r"""
import json, subprocess, sys
from dcptool.capture import CaptureSettings, LiveOptions, capture, parse_source

server = subprocess.Popen([sys.executable, "-m", "dcptool.cli", "serve", "synapse", "--port", "0",
                           "--items", "200", "--seed", "4"], stdout=subprocess.PIPE, stderr=subprocess.DEVNULL)
try:
    address = json.loads(server.stdout.readline())["listening"]
    opts = LiveOptions(source=parse_source(f"synapse://{address}"), user=None, name="library-test",
                       max_messages=int(sys.argv[2]), duration=60.0)
    result = capture(opts, CaptureSettings(output=sys.argv[1]))
finally:
    server.terminate()
    server.wait(10)
print(json.dumps({"error": None if result.error is None else repr(result.error), "summary": result.summary(),
                  "ui": [m for m in ("click", "rich") if m in sys.modules]}))
"""


@pytest.mark.integration
def test_a_synapse_capture_is_the_same_call(tmp_path):
    out, wanted = tmp_path / "caps", 2 + 18 + 200     # SERVER, PING, a POSITION per stream, the rows
    res = subprocess.run([sys.executable, "-c", SYNAPSE_SCRIPT, str(out), str(wanted)], capture_output=True,
                         text=True, timeout=120)
    assert res.returncode == 0, res.stderr
    got = json.loads(res.stdout.splitlines()[-1])
    assert got["error"] is None and got["ui"] == []
    s = got["summary"]
    assert s["protocol"] == "synapse" and s["stopped"] == "max-messages" and s["received"] == wanted
    rows = read_capture_table(find_captures([str(out)])).to_pylist()
    assert sum(1 for r in rows if r["command"] == "RDATA") == 200 and len(rows) == s["lines"]
